"""Triton kernels of the MXFP4 grouped expert GEMMs. Launched only from `megatron_gptoss.ops.mxfp4_gemm`,
which states the contracts.

Weights: expert e's W[e] [N, K] is `Wb` [E, N, K / 2] bytes (value k of row n in byte k // 2 of the row,
the low nibble for even k) and `Ws` [E, N, K / 32] scale bytes (2 ** (s - 127) for values 32 g .. 32 g + 31).
Rows are sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), `bounds` int32 [E + 1]).

The forward kernel addresses the weights tile by tile, so that they may be stored row-major or
tile-contiguous (`mxfp4_relaid.kernel_weights`; a model's "tiled_pairs", `mxfp4_bytes.tile_experts`): byte
j < BLOCK_K / 2 of row n < BLOCK_N of the tile at column block c and K step t, in half h (fc1's [gate; up]),
sits at Wb + e stride_wbe + h wb_half + c wb_col +
t wb_step + n wb_row + j (the scales likewise with ws_*, j < BLOCK_K / 32). Row-major: wb_half = N S,
wb_col = BLOCK_N S, wb_step = BLOCK_K / 2, wb_row = S (S the row stride); tile-contiguous: each tile's
[BLOCK_N, BLOCK_K / 2] bytes one contiguous run, wb_row = BLOCK_K / 2.

Grid (column blocks, E, SPLIT), static: program (c, e, s) owns output columns block c of expert e and that
expert's row tiles s, s + SPLIT, ...; an expert without rows returns at once (its weight is never read),
and with one row tile per expert every weight byte is read once. Products are accumulated in fp32 over K in
a fixed order; the epilogue rounds them to the output dtype (the library GEMM's output), adds an optional
addend in fp32 and rounds the sum again (a tensor addition's output), and adds bias and SwiGLU in fp32 on the
rounded values, one more rounding (`mxfp4_fwd_kernel`).

Two ways to form the products:
- portable (`_portable_products`): plain loads and `tl.dot`. The byte tile is decoded in registers to x's
  dtype, once per nibble (the low nibbles are W's even columns of K, the high ones its odd columns), and the
  two halves interleaved back into K's order before the product, so that the fp32 sums run over K in the
  order of the library's GEMM on the dequantized weights: products split as W_even x_even^T +
  W_odd x_odd^T instead differed from it in about 2e-5 of the bf16 outputs (an H100, gpt-oss-20b width),
  enough to raise the engine/learner log-prob mismatch of a 2-layer LoRA run from 2e-4 to 2e-3 through the
  routers. The weight tile is the left operand (its rows fill the matrix unit's wide side, the few rows of
  x the narrow one). The decoding (DECODE): "bytes" (`_decode`: a scale
  load and its conversion per byte, fp32 arithmetic per value), "groups" (`_decode_groups`: the bytes in
  16-byte block vectors, one scale load per block, the same arithmetic) or "ptx" (`_decode_groups` through
  `_E2M1_BF16_PTX`: byte-permute table lookups and one bf16x2 fma per two values, ~3 instructions a value;
  compiled for sm_90 the fc1 loop takes ~6 instructions a value in all against ~9 for "bytes"; bf16 on
  NVIDIA GPUs only, not under the interpreter).
- scaled (`_scaled_products`): `tl.dot_scaled` with x (bf16 / fp16) and the packed bytes and scales (on
  the right, or with SWAP on the left), Triton's own e2m1 decoding (on Hopper: decoded to bf16, then its
  matrix units).
`mxfp4_dequant_kernel` decodes whole weights to 16-bit or fp32 (the dequantized path of large row counts:
the library's grouped GEMM then multiplies them). The input gradient (`mxfp4_bwd_kernel`) decodes the same
byte tiles along the other axis: grad_x's even and odd columns are grad_y W_even and grad_y W_odd, joined
(interleaved) before the store.

Byte formats (BYTE_FORMAT; `mxfp4_gemm.BYTE_FORMATS`): 0 the checkpoint's bytes; 1 "shuffled" (each 16-byte
block as its [4, 4] transpose, `_decode_groups`); 2 "pairs" (`_decode_pairs`: each block as four 32-bit words
whose bits decode into bf16 pairs in K's order by a shift and a mask; one word an inline-assembly call), read
by the forward kernel, the input gradient (the decoded tile in K's order, multiplied as W^T g^T) and the
whole-weight decoding alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_gptoss.ops.moe_decode_kernels import _bias_rows, _store_rows

try:  # grid dependency control (programmatic dependent launch): not in every Triton the project accepts
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    GDC = True
except ImportError:  # the forward's PDL is then never set (`mxfp4_gemm._launch_forward`)
    GDC = False


@triton.jit
def _fp4_values(codes):
    """int32 FP4 e2m1 codes (0..15) -> their values times 2 ** -14 in fp32, exactly and without branches:
    the code's exponent and mantissa bits moved into an fp16's (code 1, 0.5, lands on the fp16 subnormal
    2 ** -15, which the conversion to fp32 keeps), bit 3 into its sign."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_values(s):
    """uint8 E8M0 scales -> 2 ** (s - 127) * 2 ** 14 in fp32 (the factor `_fp4_values` leaves out): the fp32
    with exponent field s + 14, exact for s <= 240 (larger scales, values beyond 2 ** 113, are out of the
    kernels' range)."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _decode(byte_ptrs, scale_ptrs, mask, DTYPE: tl.constexpr):
    """The weight values of a byte tile in DTYPE: (even, odd) = (low nibbles, high nibbles), each times
    the scale of its block (exact: powers of two times at most two significant bits). Masked bytes read 0."""
    byte = tl.load(byte_ptrs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    scale = _scale_values(tl.load(scale_ptrs, mask=mask, other=0, eviction_policy="evict_first"))
    even = (_fp4_values(byte & 15) * scale).to(DTYPE)
    odd = (_fp4_values(byte >> 4) * scale).to(DTYPE)
    return even, odd


# FP4 e2m1 bytes and E8M0 scale bytes -> bf16 (`_decode_groups` with PTX; 4 bytes a call in register $4,
# their 4 scale bytes in $5): the magnitudes' high and low bf16 bytes looked up by `prmt` (code c & 7 picks
# byte c of an 8-byte table), the sign (bit 3 of the code, through prmt's sign-replicating selector) moved
# into the high byte, the bytes paired into bf16 words (the low nibbles' values in $0, $1, the high ones' in
# $2, $3; element 2 i in a word's low half), then times the scale 2 ** (s - 127) (bf16 bits s << 7) by one
# exact bf16x2 fma (+0 added) per pair.
_E2M1_BF16_PTX = tl.constexpr(
    """
{
.reg .b32 m, mh, rh, ha, hb, la, lb, sg, z, h01, l01, h23, l23, s01, s23, e0, e1, o0, o1, sc01, sc23;
mov.b32 ha, 0x3F3F3F00;
mov.b32 hb, 0x40404040;
mov.b32 la, 0xC0800000;
mov.b32 lb, 0xC0804000;
mov.b32 sg, 0x80808080;
mov.b32 z, 0;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
shr.u32 rh, $4, 16;
prmt.b32 h01, ha, hb, m;
prmt.b32 l01, la, lb, m;
prmt.b32 h23, ha, hb, mh;
prmt.b32 l23, la, lb, mh;
prmt.b32 s01, sg, sg, $4;
prmt.b32 s23, sg, sg, rh;
shl.b32 s01, s01, 7;
shl.b32 s23, s23, 7;
and.b32 s01, s01, 0x80808080;
and.b32 s23, s23, 0x80808080;
or.b32 h01, h01, s01;
or.b32 h23, h23, s23;
prmt.b32 e0, l01, h01, 0x6240;
prmt.b32 o0, l01, h01, 0x7351;
prmt.b32 e1, l23, h23, 0x6240;
prmt.b32 o1, l23, h23, 0x7351;
prmt.b32 sc01, $5, z, 0x4140;
prmt.b32 sc23, $5, z, 0x4342;
shl.b32 sc01, sc01, 7;
shl.b32 sc23, sc23, 7;
fma.rn.bf16x2 $0, e0, sc01, z;
fma.rn.bf16x2 $1, e1, sc23, z;
fma.rn.bf16x2 $2, o0, sc01, z;
fma.rn.bf16x2 $3, o1, sc23, z;
}
"""
)


@triton.jit
def _scale_tile(ws_tile, rows_s, col_ok, k_in, kg, K, GROUPS: tl.constexpr):
    """[BLOCK_N, GROUPS] uint8: the scale bytes of the tile's rows (each at its byte offset rows_s) for its K
    columns k_in .. k_in + 32 GROUPS - 1 (the weight's kg ..; blocks from K up, and rows not col_ok, read as
    0)."""
    g = tl.arange(0, GROUPS)
    mask = col_ok[:, None] & ((kg // 32 + g) < K // 32)[None, :]
    # one 32-byte sector of a row's scales serves 1024 / BLOCK_K steps in the row-major layout: left to L2's
    # default policy (the weight bytes, read once, are evicted first)
    return tl.load(ws_tile + rows_s[:, None] + (k_in // 32 + g)[None, :], mask=mask, other=0)


@triton.jit
def _decode_groups(
    wb_tile, scale, rows_b, col_ok, k_in, kg, K, DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, BYTE_FORMAT: tl.constexpr,
):  # fmt: skip
    """(even, odd) [BLOCK_N, BLOCK_K / 2] in DTYPE: the weight values of the tile's rows (at byte offsets
    rows_b) at its K columns k_in + 2 j and k_in + 2 j + 1 (`_decode`'s; K column kg + 2 j of the weight,
    masked from K up), the bytes read as 16-byte vectors and each block's scale (`scale`: `_scale_tile`'s)
    broadcast over its 16 bytes. PTX (bf16 on NVIDIA GPUs): decoded by `_E2M1_BF16_PTX`, exact for scale bytes
    2..240 (values 2 ** -126 .. 6 * 2 ** 113: normal bf16); else by `_fp4_values` and `_scale_values`.
    BYTE_FORMAT 0: the checkpoint's bytes; 1: each 16-byte block stored as the transpose of its [4, 4] view
    (`mxfp4_bytes.shuffle_bytes`: byte 4 b + a at 4 a + b), so that the bytes one thread of the matrix unit's
    operand needs (every fourth) come from shared memory as one vector. (Format 2: `_decode_pairs`.)"""
    GROUPS: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, GROUPS)
    mask = col_ok[:, None] & ((kg // 32 + g) < K // 32)[None, :]
    ptrs = wb_tile + rows_b[:, None, None] + (k_in // 2) + (g * 16)[None, :, None]
    byte = tl.load(ptrs + tl.arange(0, 16)[None, None, :], mask=mask[:, :, None], other=0,
                   eviction_policy="evict_first")  # fmt: skip
    if BYTE_FORMAT == 1:  # the 16-byte runs viewed as [4, 4]: [N, g, a, b] = stored byte 16 g + 4 a + b
        byte = tl.reshape(byte, [BLOCK_N, GROUPS, 4, 4])
        scale = tl.broadcast_to(scale[:, :, None, None], [BLOCK_N, GROUPS, 4, 4])
    else:
        scale = tl.broadcast_to(scale[:, :, None], [BLOCK_N, GROUPS, 16])
    if PTX:
        even, odd = tl.inline_asm_elementwise(
            _E2M1_BF16_PTX, "=r,=r,=r,=r,r,r", [byte, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
            pack=4,
        )  # fmt: skip
    else:
        codes = byte.to(tl.int32)
        factor = _scale_values(scale)
        even = (_fp4_values(codes & 15) * factor).to(DTYPE)
        odd = (_fp4_values(codes >> 4) * factor).to(DTYPE)
    if BYTE_FORMAT == 1:  # [N, g, a, b] holds byte 16 g + 4 b + a: -> [N, g, b, a]
        even, odd = tl.permute(even, (0, 1, 3, 2)), tl.permute(odd, (0, 1, 3, 2))
    return tl.reshape(even, [BLOCK_N, BLOCK_K // 2]), tl.reshape(odd, [BLOCK_N, BLOCK_K // 2])


@triton.jit
def _decode_tile(
    wb_tile, ws_tile, scale, rows_b, rows_s, col_ok, k_in, kg, K, DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB_K: tl.constexpr, DECODE: tl.constexpr, BYTE_FORMAT: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, SUB_K] in DTYPE, K's order: the values of the tile's rows at its K columns k_in .. k_in +
    SUB_K - 1 (the weight's kg ..), decoded by DECODE (0 `_decode`, reading its scales from ws_tile; 1
    `_decode_groups`, 2 the same through PTX, both with `scale`, the piece's `_scale_tile`) from bytes in
    BYTE_FORMAT (0 and 1: `_decode_groups`', 2: `_decode_pairs`')."""
    if BYTE_FORMAT == 2:
        return _decode_pairs(wb_tile, scale, rows_b, col_ok, k_in, kg, K, DTYPE, BLOCK_N, SUB_K, DECODE == 2)
    if DECODE == 0:
        jj = tl.arange(0, SUB_K // 2)
        mask = col_ok[:, None] & ((kg // 2 + jj) < K // 2)[None, :]
        b_ptrs = wb_tile + rows_b[:, None] + (k_in // 2 + jj)[None, :]
        s_ptrs = ws_tile + rows_s[:, None] + ((k_in // 2 + jj) // 16)[None, :]
        even, odd = _decode(b_ptrs, s_ptrs, mask, DTYPE)
    else:
        even, odd = _decode_groups(
            wb_tile, scale, rows_b, col_ok, k_in, kg, K, DTYPE, BLOCK_N, SUB_K, DECODE == 2, BYTE_FORMAT
        )
    return _interleave(even, odd, BLOCK_N, SUB_K)


# Byte format 2 ("pairs", `mxfp4_bytes.pair_words`): each 16-byte block as four 32-bit words, word a holding
# the 8 values at K 2 (a + 4 i) + t (i = 0..3, t = 0, 1: the K pairs one thread of the matrix unit's operand
# takes at lane a of its quad), their codes' bits placed so that pair i is a bf16x2 word by one mask: slots
# 0, 1, 2 are (word << 3 i) & 0x81C081C0 (sign to bit 15, exponent and mantissa bits to 8..6, the second value
# 16 bits up), slot 3 takes the remaining bits (sign at 14, exponent at 11, 10, mantissa at 13). A code in
# those bits reads as a bf16 of value 2 ** -126 times its FP4 value (code 1, 0.5, as the subnormal 2 ** -127),
# so one exact bf16x2 fma by 2 ** (s - 1) (bf16 bits (s + 126) << 7 in both halves; scale bytes 2..128) gives
# the weight; -0 is added, so signed zeros stay. One word a call ($8, its factor $9; the decoding is not
# elementwise in bytes, so no bytes of two words may share a call); $0..$7: values 0..7 (pair i: $2i, $2i+1).
_PAIRS_BF16_PTX = tl.constexpr(
    """
{
.reg .b32 w0, w1, w2, w3, t1, t2, t3, nz;
mov.b32 nz, 0x80008000;
and.b32 w0, $8, 0x81C081C0;
shl.b32 w1, $8, 3;
and.b32 w1, w1, 0x81C081C0;
shl.b32 w2, $8, 6;
and.b32 w2, w2, 0x81C081C0;
shl.b32 t1, $8, 1;
and.b32 t1, t1, 0x80008000;
shr.b32 t2, $8, 3;
and.b32 t2, t2, 0x01800180;
shr.b32 t3, $8, 7;
and.b32 t3, t3, 0x00400040;
or.b32 w3, t1, t2;
or.b32 w3, w3, t3;
fma.rn.bf16x2 w0, w0, $9, nz;
fma.rn.bf16x2 w1, w1, $9, nz;
fma.rn.bf16x2 w2, w2, $9, nz;
fma.rn.bf16x2 w3, w3, $9, nz;
mov.b32 {$0, $1}, w0;
mov.b32 {$2, $3}, w1;
mov.b32 {$4, $5}, w2;
mov.b32 {$6, $7}, w3;
}
"""
)


@triton.jit
def _pair_bits(word, v: tl.constexpr):
    """The bf16 bit pattern (int32, 0..65535) of value v (0..7: pair v // 2, its half v % 2) of byte format
    2's word (int64; `_PAIRS_BF16_PTX`'s decoding, without the factor)."""
    if v // 2 == 3:
        bits = ((word << 1) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040)
    else:
        bits = (word << (3 * (v // 2))) & 0x81C081C0
    return ((bits >> (16 * (v % 2))) & 0xFFFF).to(tl.int32)


@triton.jit
def _pair_value(word, factor, v: tl.constexpr, DTYPE: tl.constexpr):
    """Value v of byte format 2's word in DTYPE: its code read back from `_pair_bits` (sign at bit 15,
    exponent and mantissa at 8..6) and decoded as the checkpoint's codes are (`_fp4_values` times the
    `_scale_values` factor, exact; no fp32 subnormal is formed)."""
    bits = _pair_bits(word, v)
    return (_fp4_values(((bits >> 12) & 8) | ((bits >> 6) & 7)) * factor).to(DTYPE)


@triton.jit
def _decode_pairs(
    wb_tile, scale, rows_b, col_ok, k_in, kg, K, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, BLOCK_K] in DTYPE, K's order: byte format 2's words of the tile's rows (at byte offsets
    rows_b, multiples of 16) at its K columns k_in .. (the weight's kg .., masked from K up), read as 32-bit
    words [N, g, a] (a block's four words side by side: 16-byte vectors), each decoded into its 8 values
    with its block's scale (`scale`: `_scale_tile`'s; PTX: `_PAIRS_BF16_PTX`, one word a call; else the same
    bits by `_pair_value` in fp32),
    then put in K's order: 32 g + 8 i + 2 a + t."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, GROUPS)
    mask = col_ok[:, None] & ((kg // 32 + g) < K // 32)[None, :]
    words = wb_tile.to(tl.pointer_type(tl.int32))  # the tile's byte offsets are multiples of 16
    ptrs = words + (rows_b // 4)[:, None, None] + (k_in // 8) + (g * 4)[None, :, None]
    word = tl.load(ptrs + tl.arange(0, 4)[None, None, :], mask=mask[:, :, None], other=0,
                   eviction_policy="evict_first")  # fmt: skip
    exponent = (scale.to(tl.int32) + 126)[:, :, None]  # 2 ** (s - 1): the bf16 exponent field s + 126
    if PTX:
        factor = tl.broadcast_to((exponent << 7) | (exponent << 23), [BLOCK_N, GROUPS, 4])
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PAIRS_BF16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, factor], dtype=(tl.bfloat16,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        wide = word.to(tl.int64) & 0xFFFFFFFF  # the word's bits, unsigned
        factor = _scale_values(scale)[:, :, None]
        v0, v1 = _pair_value(wide, factor, 0, DTYPE), _pair_value(wide, factor, 1, DTYPE)
        v2, v3 = _pair_value(wide, factor, 2, DTYPE), _pair_value(wide, factor, 3, DTYPE)
        v4, v5 = _pair_value(wide, factor, 4, DTYPE), _pair_value(wide, factor, 5, DTYPE)
        v6, v7 = _pair_value(wide, factor, 6, DTYPE), _pair_value(wide, factor, 7, DTYPE)
    # pairs [N, g, a, t], then [N, g, a, t, i_lo, i_hi] with i = i_lo + 2 i_hi
    w = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    w = tl.permute(w, (0, 1, 5, 4, 2, 3))  # [N, g, i_hi, i_lo, a, t]: K 32 g + 8 i + 2 a + t
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _interleave(even, odd, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(even, odd) [BLOCK_N, BLOCK_K / 2] -> [BLOCK_N, BLOCK_K], K's order: columns 2 j and 2 j + 1 side by
    side."""
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])


@triton.jit
def _portable_products(
    X, wb_e, ws_e, rows, row_ok, c, N, K, stride_x, wb_half, wb_col, wb_step, wb_row, ws_half, ws_col,
    ws_step, ws_row, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr, SUB_K: tl.constexpr,
    BYTE_FORMAT: tl.constexpr, PREFETCH_SCALES: tl.constexpr, SUB_ROWS: tl.constexpr,
):  # fmt: skip
    """(lo, hi) fp32 [BLOCK_M, BLOCK_N]: x[rows] W[cols]^T and, GATED, x[rows] W[N + cols]^T for the
    columns of block c, the weights addressed tile by tile (module doc). SUB_ROWS (0: BLOCK_N): the block's
    rows come in stored tiles of SUB_ROWS rows, consecutive tiles wb_col / (BLOCK_N / SUB_ROWS) bytes apart
    (scales: ws_col / ...), each row wb_row bytes after the one before. Each BLOCK_K step is decoded and
    multiplied in SUB_K pieces (`_decode_tile`; BLOCK_K with DECODE 0), from k0 up: the step's loads are
    issued together, its decoded values held SUB_K at a time, in K's order before their `tl.dot`.

    PREFETCH_SCALES (`mxfp4_gemm.prefetch_scales`): the scale bytes are loaded a step ahead where a step is
    one piece (SUB_K = BLOCK_K, DECODE 1 or 2). The compiler's pipeline stages the weight bytes and x through
    shared memory but not these single bytes, and read in the step that decodes them each step waited out
    one memory latency before its decoding began (on sm_90: the loop's scale load and its first use ~30
    instructions apart). Loaded one step early, the next step's scales are in flight while this step
    decodes and multiplies; the values are the same."""
    GROUPS: tl.constexpr = SUB_K // 32
    PREFETCH: tl.constexpr = PREFETCH_SCALES and SUB_K == BLOCK_K and DECODE != 0
    local = tl.arange(0, BLOCK_N)
    col_ok = c * BLOCK_N + local < N
    if SUB_ROWS == 0 or SUB_ROWS == BLOCK_N:
        rows_b = local * wb_row
        rows_s = local * ws_row
    else:
        PER_BLOCK: tl.constexpr = BLOCK_N // SUB_ROWS
        rows_b = (local // SUB_ROWS) * (wb_col // PER_BLOCK) + (local % SUB_ROWS) * wb_row
        rows_b = tl.multiple_of(rows_b, 16)  # whole 16-byte vectors (the division hides it from the compiler)
        rows_s = (local // SUB_ROWS) * (ws_col // PER_BLOCK) + (local % SUB_ROWS) * ws_row
    lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    hi = lo
    dtype = X.dtype.element_ty
    wb_c = wb_e + c * wb_col
    ws_c = ws_e + c * ws_col
    if PREFETCH:  # step 0's scales; each step then loads the next one's
        s_lo = _scale_tile(ws_c, rows_s, col_ok, 0, 0, K, GROUPS)
        s_hi = s_lo
        if GATED:
            s_hi = _scale_tile(ws_c + ws_half, rows_s, col_ok, 0, 0, K, GROUPS)
    for k0 in range(0, K, BLOCK_K):
        wb_t = wb_c + (k0 // BLOCK_K) * wb_step
        ws_t = ws_c + (k0 // BLOCK_K) * ws_step
        if PREFETCH:
            scale_lo, scale_hi = s_lo, s_hi
            ws_next, k_next = ws_t + ws_step, k0 + BLOCK_K
            s_lo = _scale_tile(ws_next, rows_s, col_ok, 0, k_next, K, GROUPS)
            if GATED:
                s_hi = _scale_tile(ws_next + ws_half, rows_s, col_ok, 0, k_next, K, GROUPS)
        for k1 in tl.static_range(0, BLOCK_K, SUB_K):
            ks = k0 + k1 + tl.arange(0, SUB_K)
            xt = tl.load(
                X + rows[None, :] * stride_x + ks[:, None],
                mask=row_ok[None, :] & (ks < K)[:, None],
                other=0.0,
                eviction_policy="evict_last",
            )  # [SUB_K, BLOCK_M]
            if not PREFETCH:
                scale_lo = _scale_tile(ws_t, rows_s, col_ok, k1, k0 + k1, K, GROUPS)
            w = _decode_tile(
                wb_t, ws_t, scale_lo, rows_b, rows_s, col_ok, k1, k0 + k1, K, dtype, BLOCK_N, SUB_K,
                DECODE, BYTE_FORMAT,
            )  # fmt: skip
            lo = tl.dot(w, xt, lo, input_precision=DOT_PRECISION)
            if GATED:
                if not PREFETCH:
                    scale_hi = _scale_tile(ws_t + ws_half, rows_s, col_ok, k1, k0 + k1, K, GROUPS)
                w = _decode_tile(
                    wb_t + wb_half, ws_t + ws_half, scale_hi, rows_b, rows_s, col_ok, k1, k0 + k1, K,
                    dtype, BLOCK_N, SUB_K, DECODE, BYTE_FORMAT,
                )  # fmt: skip
                hi = tl.dot(w, xt, hi, input_precision=DOT_PRECISION)
    return tl.trans(lo), tl.trans(hi)


@triton.jit
def _scaled_products(
    X, wb_base, ws_base, rows, row_ok, cols, col_ok, K, stride_x, stride_wbn, stride_wsn, wb_half, ws_half,
    GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, X_FORMAT: tl.constexpr,
):  # fmt: skip
    """`_portable_products` through `tl.dot_scaled` (x in bf16 or fp16, X_FORMAT its name): x's tile on the
    left and the weight's bytes [BLOCK_K / 2, BLOCK_N] on the right, or with SWAP the weight's bytes
    [BLOCK_N, BLOCK_K / 2] on the left (the wide side of the matrix unit) and x's tile transposed."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    if SWAP:
        lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        lo = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    hi = lo
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kb = k0 // 2 + tl.arange(0, HALF)
        kg = k0 // 32 + tl.arange(0, GROUPS)
        s_ptrs = ws_base + cols[:, None] * stride_wsn + kg[None, :]  # [BLOCK_N, GROUPS]
        s_mask = col_ok[:, None] & (kg < K // 32)[None, :]
        if SWAP:
            xt = tl.load(
                X + rows[None, :] * stride_x + ks[:, None],
                mask=row_ok[None, :] & (ks < K)[:, None],
                other=0.0,
                eviction_policy="evict_last",
            )
            b_ptrs = wb_base + cols[:, None] * stride_wbn + kb[None, :]  # [BLOCK_N, HALF]
            b_mask = col_ok[:, None] & (kb < K // 2)[None, :]
        else:
            x = tl.load(
                X + rows[:, None] * stride_x + ks[None, :],
                mask=row_ok[:, None] & (ks < K)[None, :],
                other=0.0,
                eviction_policy="evict_last",
            )
            b_ptrs = wb_base + cols[None, :] * stride_wbn + kb[:, None]  # [HALF, BLOCK_N]: packed along K
            b_mask = col_ok[None, :] & (kb < K // 2)[:, None]
        w = tl.load(b_ptrs, mask=b_mask, other=0, eviction_policy="evict_first")
        s = tl.load(s_ptrs, mask=s_mask, other=0, eviction_policy="evict_first")
        if SWAP:
            lo = tl.dot_scaled(w, s, "e2m1", xt, None, X_FORMAT, acc=lo)
        else:
            lo = tl.dot_scaled(x, None, X_FORMAT, w, s, "e2m1", acc=lo)
        if GATED:
            w = tl.load(b_ptrs + wb_half, mask=b_mask, other=0, eviction_policy="evict_first")
            s = tl.load(s_ptrs + ws_half, mask=s_mask, other=0, eviction_policy="evict_first")
            if SWAP:
                hi = tl.dot_scaled(w, s, "e2m1", xt, None, X_FORMAT, acc=hi)
            else:
                hi = tl.dot_scaled(x, None, X_FORMAT, w, s, "e2m1", acc=hi)
    if SWAP:
        lo = tl.trans(lo)
        hi = tl.trans(hi)
    return lo, hi


@triton.jit
def _row_tile(
    X, wb_base, ws_base, Add, Out, r0, end, cols, col_ok, b_lo, b_hi, N, K, stride_x, wb_half, wb_col,
    wb_step, wb_row, ws_half, ws_col, ws_step, ws_row, stride_add, stride_out, limit, alpha,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, SCALED: tl.constexpr,
    SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, X_FORMAT: tl.constexpr, DECODE: tl.constexpr, SUB_K: tl.constexpr,
    BYTE_FORMAT: tl.constexpr, PREFETCH_SCALES: tl.constexpr, SUB_ROWS: tl.constexpr,
):  # fmt: skip
    """`mxfp4_fwd_kernel`'s rows r0 .. r0 + BLOCK_M (those below `end`) at the program's columns: products,
    epilogue, store."""
    rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < end
    if SCALED:
        lo, hi = _scaled_products(
            X, wb_base, ws_base, rows, row_ok, cols, col_ok, K, stride_x, wb_row, ws_row, wb_half, ws_half,
            GATED, SWAP, BLOCK_M, BLOCK_N, BLOCK_K, X_FORMAT,
        )  # fmt: skip
    else:
        lo, hi = _portable_products(
            X, wb_base, ws_base, rows, row_ok, tl.program_id(0), N, K, stride_x, wb_half, wb_col, wb_step,
            wb_row, ws_half, ws_col, ws_step, ws_row, GATED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, DECODE,
            SUB_K, BYTE_FORMAT, PREFETCH_SCALES, SUB_ROWS,
        )  # fmt: skip
    _store_rows(
        lo, hi, b_lo, b_hi, Add, Out, rows, row_ok, cols, col_ok, N, stride_add, stride_out, limit, alpha,
        GATED, HAS_BIAS, HAS_ADD,
    )  # fmt: skip


@triton.jit
def mxfp4_fwd_kernel(
    X, Wb, Ws, Bias, Add, Out, bounds, N, K, stride_x, stride_wbe, wb_half, wb_col, wb_step, wb_row,
    stride_wse, ws_half, ws_col, ws_step, ws_row, stride_be, stride_add, stride_out, limit, alpha,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, SCALED: tl.constexpr,
    SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, X_FORMAT: tl.constexpr, DECODE: tl.constexpr, SUB_K: tl.constexpr,
    BYTE_FORMAT: tl.constexpr, PREFETCH_SCALES: tl.constexpr, HALF_TAIL: tl.constexpr,
    SUB_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Out[r, c] for the rows r of expert e and the program's columns c < N; X [M, K] with unit stride
    along K. GATED: W [E, 2N, K] as [gate; up], Bias [E, 2N], Add [M, 2N]; Out = (up + 1) * gate *
    sigmoid(alpha gate) with gate = min(g, limit), up = clamp(u, -limit, limit) of g, u = the rounded
    products with W[e, c] and W[e, N + c] (HAS_ADD: plus Add[r, c] and Add[r, N + c], rounded again) plus the
    bias. Not GATED: W [E, N, K], Bias [E, N], Add [M, N]; Out = rounded product (+ Add[r, c], rounded again)
    (+ bias). The weights addressed tile by tile (wb_*, ws_*: module doc; the scaled kernel reads the
    row-major layout only). SCALED: the products by `tl.dot_scaled`, else by the in-register decoding (module
    doc; DECODE, SUB_K, PREFETCH_SCALES and SUB_ROWS: `_portable_products`).

    HALF_TAIL: a program whose rows fill at most half a row tile (at decode sizes, an expert's only tile)
    runs a tile of BLOCK_M / 2 rows, its own compiled loop: the matrix unit's products over padding rows
    halve, the weight is decoded as often. Each output is the same sum in the same order at either height.

    PDL (launched with programmatic dependent launch, sm_90): every program first lets the next launch begin
    (its programs then start on the SMs this grid's last ones leave free, waiting there), then waits until
    the grid before it has finished and its writes are visible, before reading anything (bounds, x, the
    addend)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    e = tl.program_id(1)
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    first = start + tl.program_id(2) * BLOCK_M
    if first >= end:
        return
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wb_base = Wb + e.to(tl.int64) * stride_wbe
    ws_base = Ws + e.to(tl.int64) * stride_wse
    b_lo, b_hi = _bias_rows(Bias, e, stride_be, cols, col_ok, N, GATED, HAS_BIAS)
    if HALF_TAIL and end - first <= BLOCK_M // 2:
        _row_tile(
            X, wb_base, ws_base, Add, Out, first, end, cols, col_ok, b_lo, b_hi, N, K, stride_x, wb_half,
            wb_col, wb_step, wb_row, ws_half, ws_col, ws_step, ws_row, stride_add, stride_out, limit, alpha,
            GATED, HAS_BIAS, HAS_ADD, SCALED, SWAP, BLOCK_M // 2, BLOCK_N, BLOCK_K, DOT_PRECISION, X_FORMAT,
            DECODE, SUB_K, BYTE_FORMAT, PREFETCH_SCALES, SUB_ROWS,
        )  # fmt: skip
    else:
        for r0 in range(first, end, tl.num_programs(2) * BLOCK_M):
            _row_tile(
                X, wb_base, ws_base, Add, Out, r0, end, cols, col_ok, b_lo, b_hi, N, K, stride_x, wb_half,
                wb_col, wb_step, wb_row, ws_half, ws_col, ws_step, ws_row, stride_add, stride_out, limit,
                alpha, GATED, HAS_BIAS, HAS_ADD, SCALED, SWAP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                X_FORMAT, DECODE, SUB_K, BYTE_FORMAT, PREFETCH_SCALES, SUB_ROWS,
            )  # fmt: skip


@triton.jit
def mxfp4_bwd_kernel(
    G, Wb, Ws, GX, bounds, N, K, stride_g, stride_wbe, stride_wbn, stride_wse, stride_wsn, stride_gx,
    wb_col, wb_step, ws_col, ws_step, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BYTE_FORMAT: tl.constexpr, PTX: tl.constexpr, TILE_ROWS: tl.constexpr,
):  # fmt: skip
    """GX[r, k] = sum_n G[r, n] W[e][n, k] for the rows r of expert e and the program's columns k (block
    c of BLOCK_K columns of K), G [M, N] with unit stride along N, accumulated in fp32 over N in BLOCK_R
    steps from 0 up, rounded once to GX's dtype. BYTE_FORMAT 0: the checkpoint's bytes, the even and odd
    columns decoded and multiplied apart; 2: byte format 2 ("pairs"), the tile decoded in K's order by
    `_decode_pairs` (PTX: its inline assembly) and multiplied at once: the same sums over N. TILE_ROWS > 0
    (format 2 only): the weights stored tile by tile (`mxfp4_bytes.tile_experts`), the tile of row block b
    and K step s at b wb_col + s wb_step (scales: ws_*), its rows stride_wbn (stride_wsn) apart; BLOCK_K
    is the tiles' K step and BLOCK_R divides TILE_ROWS."""
    HALF: tl.constexpr = BLOCK_K // 2
    e = tl.program_id(1)
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    first = start + tl.program_id(2) * BLOCK_M
    if first >= end:
        return
    kb = tl.program_id(0) * HALF + tl.arange(0, HALF)  # byte columns: values 2 kb (low) and 2 kb + 1
    k_ok = kb < K // 2
    wb_base = Wb + e.to(tl.int64) * stride_wbe
    ws_base = Ws + e.to(tl.int64) * stride_wse
    dtype = GX.dtype.element_ty
    for r0 in range(first, end, tl.num_programs(2) * BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        even = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        odd = even
        both_t = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)  # format 2: GX^T, the weight on the left
        for n0 in range(0, N, BLOCK_R):
            ns = n0 + tl.arange(0, BLOCK_R)
            n_ok = ns < N
            g = tl.load(
                G + rows[:, None] * stride_g + ns[None, :],
                mask=row_ok[:, None] & n_ok[None, :],
                other=0.0,
                eviction_policy="evict_last",
            )
            if BYTE_FORMAT == 2:
                k0 = tl.program_id(0) * BLOCK_K
                local = tl.arange(0, BLOCK_R)
                if TILE_ROWS > 0:  # the tile holding rows n0.. at K step program_id(0), from its column 0
                    b, r = n0 // TILE_ROWS, n0 % TILE_ROWS
                    wb_n = wb_base + b * wb_col + tl.program_id(0) * wb_step + r * stride_wbn
                    ws_n = ws_base + b * ws_col + tl.program_id(0) * ws_step + r * stride_wsn
                    k_in = 0
                else:
                    wb_n, ws_n, k_in = wb_base + n0 * stride_wbn, ws_base + n0 * stride_wsn, k0
                scale = _scale_tile(ws_n, local * stride_wsn, n_ok, k_in, k0, K, BLOCK_K // 32)
                w = _decode_pairs(
                    wb_n, scale, local * stride_wbn, n_ok, k_in, k0, K, dtype, BLOCK_R, BLOCK_K, PTX
                )
                both_t = tl.dot(tl.trans(w), tl.trans(g), both_t, input_precision=DOT_PRECISION)
            else:
                w_mask = n_ok[:, None] & k_ok[None, :]
                b_ptrs = wb_base + ns[:, None] * stride_wbn + kb[None, :]
                s_ptrs = ws_base + ns[:, None] * stride_wsn + (kb // 16)[None, :]
                w_even, w_odd = _decode(b_ptrs, s_ptrs, w_mask, dtype)
                even = tl.dot(g, w_even, even, input_precision=DOT_PRECISION)
                odd = tl.dot(g, w_odd, odd, input_precision=DOT_PRECISION)
        ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        if BYTE_FORMAT == 2:
            both = tl.trans(both_t).to(dtype)
        else:
            both = tl.reshape(
                tl.join(even.to(dtype), odd.to(dtype)), [BLOCK_M, BLOCK_K]
            )  # columns interleaved
        mask = row_ok[:, None] & (ks < K)[None, :]
        tl.store(GX + rows[:, None] * stride_gx + ks[None, :], both, mask=mask)


@triton.jit
def mxfp4_dequant_kernel(
    blocks_ptr, scales_ptr, out_ptr, groups, row_groups, expert_groups, BLOCK_G: tl.constexpr,
    BYTE_FORMAT: tl.constexpr, PTX: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_GROUPS: tl.constexpr,
):  # fmt: skip
    """`groups` blocks of 32 values (bytes [groups, 16], scales [groups], both contiguous) -> out [groups, 32]
    in out's dtype, exactly: value 2j of a block from the low nibble of byte j, 2j + 1 from the high one,
    times the block's scale (`_decode`'s arithmetic); BYTE_FORMAT 2: the blocks in byte format 2 ("pairs"),
    decoded by `_decode_pairs` (each block a row of 32 values; PTX, bf16 out on NVIDIA GPUs: its inline
    assembly). Program p decodes blocks [p BLOCK_G, (p + 1) BLOCK_G). TILE_ROWS > 0: the blocks and scales
    stored tile by tile (`mxfp4_bytes.tile_experts`: each expert's expert_groups blocks as tiles of TILE_ROWS
    rows x TILE_GROUPS blocks, a row block's K steps in order), each block written at its row-major place
    (rows of row_groups blocks)."""
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    inside = g < groups
    if BYTE_FORMAT == 2:
        base = tl.program_id(0).to(tl.int64) * BLOCK_G
        local = tl.arange(0, BLOCK_G)
        scale = _scale_tile(scales_ptr + base, local, inside, 0, 0, 32, 1)
        values = _decode_pairs(
            blocks_ptr + base * 16, scale, local * 16, inside, 0, 0, 32,
            out_ptr.dtype.element_ty if PTX else tl.float32, BLOCK_G, 32, PTX,
        )  # fmt: skip
    else:
        byte = tl.load(
            blocks_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], mask=inside[:, None], other=0
        )
        scale = _scale_values(tl.load(scales_ptr + g, mask=inside, other=0))[:, None]
        even = _fp4_values(byte.to(tl.int32) & 15) * scale
        odd = _fp4_values(byte.to(tl.int32) >> 4) * scale
        values = tl.reshape(
            tl.join(even, odd), (BLOCK_G, 32)
        )  # [BLOCK_G, 16, 2]: values 2j, 2j + 1 side by side
    dest = g
    if TILE_ROWS > 0:  # stored block g -> (expert, row block, K step, row, block of the step) -> row-major
        tile: tl.constexpr = TILE_ROWS * TILE_GROUPS
        local = g % expert_groups
        row_block, in_block = local // (row_groups * TILE_ROWS), local % (row_groups * TILE_ROWS)
        step, in_tile = in_block // tile, in_block % tile
        row = row_block * TILE_ROWS + in_tile // TILE_GROUPS
        dest = g - local + row * row_groups + step * TILE_GROUPS + in_tile % TILE_GROUPS
    offsets = dest[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=inside[:, None])
