"""Grouped expert GEMMs on MXFP4 weights, dequantized in registers, with a PyTorch reference.

The released GPT-OSS experts are MXFP4: a weight W[e] [out, in] is stored quantized along `in` as
`blocks` [E, out, in / 32, 16] uint8 (32 FP4 e2m1 codes per block, two per byte, the low nibble first)
and `scales` [E, out, in / 32] uint8 (one E8M0 power of two 2 ** (s - 127) per block): the checkpoints'
`*_blocks` / `*_scales` per-expert layout. Every dequantized value is exact in bf16 and fp32.

    rows x [M, in] sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), bounds int32 [E + 1] on x's
    device)
    grouped_linear_mxfp4(x, blocks, scales, bounds, addend=a [M, out] | None) -> y [M, out] = x W[e]^T (+ a)
        in x's dtype; differentiable in x (the weights are frozen): grad_x = grad_y W[e], and in a: grad_y
    fc1_swiglu_mxfp4(x, blocks, scales, bias, bounds, limit, alpha, addend=a [M, 2I] | None) -> h [M, I],
        W[e] [2I, in] as [gate; up], a in the same column order: the clamped SwiGLU of x W[e]^T (+ a) +
        bias[e] (`fused_moe.swiglu_bias`'s); forward only
    The addend a (an expert adapter's update, `model.lora`; in x's dtype) is added as a tensor addition adds.

Precision, the dequantize-then-bf16 path's (`reference_dequantized`: the weights dequantized to x's dtype,
the library's grouped GEMM, the addend added as a tensor, then `fused_moe`'s bias and SwiGLU): products
accumulated in fp32 and rounded to x's dtype, the addend added in fp32 and the sum rounded to x's dtype;
bias and SwiGLU in fp32 on those rounded values, one more rounding. The kernels sum over K
in the library GEMM's order: on an H100 the portable kernel's products equal the dequantized path's bit for
bit (the scaled kernel's too, at the sizes measured); elsewhere they may differ where another order of the
fp32 sums moves a product across a rounding boundary of x's dtype.

Paths (`path=`, default from the environment variable MEGATRON_GPTOSS_MXFP4_PATH, else "auto"):
    "reference"    dequantize, then the PyTorch path (`reference_dequantized`)
    "portable"     Triton kernels with plain loads and `tl.dot` (no tensor descriptors, nothing Hopper-only)
    "scaled"       the `tl.dot_scaled` kernel for 16-bit rows on Hopper and later (elsewhere "portable")
    "dequantized"  bf16 rows on Hopper and later (elsewhere "portable"): the weights decoded to bf16 by one
                   Triton launch (`dequantize_kernel`, a transient copy of at most `DEQUANTIZE_CHUNK_BYTES`
                   at a time, experts in chunks), then the library's grouped GEMM `torch._grouped_mm`, the
                   learner's bf16 path: the same products, bit for bit, as the bf16 experts holding those
                   values; the input gradient likewise (the weights decoded again, nothing kept)
    "auto"         the fastest for the device: at decode sizes (at most `PORTABLE_MAX_ROWS` rows) the
                   portable kernel with its "ptx" decoding, above them "dequantized" for bf16 rows on Hopper
                   and later ("scaled" for fp16), so the learner's and the prefill's large products run at the
                   library's speed (measured on an H100 at gpt-oss-20b widths, benchmarks/RESULTS.md: 64 and
                   256 tokens 356 / 532 us a layer with the portable kernel against the scaled kernel's
                   490 / 621; at 4,096 tokens the scaled kernel took 4.7 ms a layer, the library 1.7 ms);
                   while a CUDA graph is captured, the portable kernel at any size (a graph would hold the
                   dequantized path's transient weights for as long as it lives)
The kernels run on CUDA and, under TRITON_INTERPRET=1, on the CPU in fp32; elsewhere (16-bit rows on the
CPU, fp64 rows, a CPU without the interpreter, no Triton) every path is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gptoss.ops import fused_moe
from megatron_gptoss.ops.fused_moe import _cdiv, expert_of_rows
from megatron_gptoss.ops.moe_decode import row_tile
from megatron_gptoss.ops.mxfp4_bytes import (
    BLOCK,
    BLOCK_BYTES,
    TILE_K,
    TILE_ROWS,
    byte_format_of,
    check_held_format,
    check_tileable,
    is_tiled,
    unpair_words,
    untile_experts,
)

PATHS = ("auto", "portable", "scaled", "dequantized", "reference")
PORTABLE_MAX_ROWS = 1024  # auto: the portable kernel up to this many rows (256 decode slots at top-4)
DEQUANTIZE_CHUNK_BYTES = 1 << 31  # the dequantized path's transient weights, at most (one expert at least)
_DEQUANTIZE_GROUPS = 64  # blocks of 32 values per program of `dequantize_kernel`
PATH_ENV = "MEGATRON_GPTOSS_MXFP4_PATH"
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_CHUNK_BLOCKS = 1 << 18  # blocks decoded at once by `dequantize` (bounds its temporaries)


# ------------------------------------------------------------------------------------------------
# Checks
def _check_weights(blocks: Tensor, scales: Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"blocks must be [E, out, in / 32, {BLOCK_BYTES}] uint8, got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(
            f"scales must be [E, out, in / 32] = {list(blocks.shape[:3])} (blocks' first three dims), "
            f"got {tuple(scales.shape)}"
        )


def _check(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, bias: Tensor | None = None,
    addend: Tensor | None = None, byte_format: str = "checkpoint",
) -> None:  # fmt: skip
    """Shapes, dtypes and devices of the grouped GEMM's inputs, with errors naming the tensor."""
    _check_weights(blocks, scales)
    check_held_format(byte_format)
    e, out, groups = blocks.shape[:3]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"x must be a floating-point tensor (fp32, bf16, fp16 or fp64), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != groups * BLOCK:
        raise ValueError(f"x must be [M, in] with in = {groups * BLOCK} (blocks {tuple(blocks.shape)}), "
                         f"got {tuple(x.shape)}")  # fmt: skip
    if bounds.dtype != torch.int32 or tuple(bounds.shape) != (e + 1,):
        raise ValueError(f"bounds must be int32 [E + 1] = [{e + 1}], got {bounds.dtype} "
                         f"{tuple(bounds.shape)}")  # fmt: skip
    for name, t in (("blocks", blocks), ("scales", scales), ("bounds", bounds)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: they must share a device")
    if bias is not None:
        if tuple(bias.shape) != (e, out):
            raise ValueError(f"bias must be [E, out] = [{e}, {out}], got {tuple(bias.shape)}")
        if bias.device != x.device or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating-point tensor on {x.device}, got {bias.dtype} on "
                             f"{bias.device}")  # fmt: skip
    if addend is not None:
        if tuple(addend.shape) != (x.shape[0], out):
            raise ValueError(f"addend must be [M, out] = [{x.shape[0]}, {out}], got {tuple(addend.shape)}")
        if addend.device != x.device or addend.dtype != x.dtype:
            raise ValueError(f"addend must be {x.dtype} on {x.device} (x's), got {addend.dtype} on "
                             f"{addend.device}")  # fmt: skip


def _resolve_path(path: str | None) -> str:
    path = os.environ.get(PATH_ENV, "auto") if path is None else path
    if path not in PATHS:
        raise ValueError(f"MXFP4 GEMM path must be one of {PATHS}, got {path!r}")
    return path


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _ptx_decodes(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernels' inline-assembly decodings run for `dtype` values on t's device: bf16 on NVIDIA
    GPUs."""
    return t.is_cuda and dtype == torch.bfloat16 and torch.version.hip is None


def kernels_can_run(x: Tensor) -> bool:
    """Whether the Triton kernels can run on x's device: CUDA with Triton, or the CPU under
    TRITON_INTERPRET=1."""
    if not _triton_installed():
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------------------------------
# Reference (PyTorch)
def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype, byte_format: str = "checkpoint") -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`: value 2j of a
    block from the low nibble of byte j, 2j + 1 from the high nibble, times 2 ** (s - 127); decoded in fp32,
    then rounded to `dtype` (exact in bf16 and fp32). The same values as `hf.mxfp4.dequantize_mxfp4`. Blocks
    in `byte_format` "pairs" (`mxfp4_bytes.pair_words`) are read back to the checkpoint's bytes first;
    "tiled_pairs" ([E, out, in / 32, 16] stored tile by tile) are put back in rows first."""
    check_held_format(byte_format)
    if is_tiled(byte_format):
        blocks, scales = untile_experts(blocks), untile_experts(scales)
    if byte_format_of(byte_format) == "pairs":
        blocks = unpair_words(blocks)
    magnitudes = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32)
    values = torch.cat([magnitudes, -magnitudes])
    codes = torch.arange(256)
    table = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(blocks.device)  # [256, 2]
    *lead, groups = scales.shape
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK_BYTES), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        decoded = table[flat_blocks[start:stop].long()].reshape(-1, BLOCK)
        s = flat_scales[start:stop]
        # 2 ** (s - 127) exactly: the byte is the fp32 exponent field (0 gives the subnormal 2 ** -127)
        power = (s.to(torch.int32) << 23).view(torch.float32)
        power = torch.where(s == 0, torch.full_like(power, 2.0**-127), power)
        out[start:stop] = decoded * power.unsqueeze(-1)
    return out.reshape(*lead, groups * BLOCK)


def reference_dequantized(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, bias: Tensor | None = None,
    swiglu: tuple[float, float] | None = None, addend: Tensor | None = None, byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """The dequantize-then-compute path: W = dequantize(blocks, scales, byte_format) in x's dtype, then per
    expert x_e W[e]^T (the library's grouped product: fp32 accumulation, one rounding to x's dtype), plus
    `addend` [M, out] in x's dtype (a tensor addition: one more rounding). With `swiglu` = (limit, alpha):
    `fused_moe.swiglu_reference` of it (bias [E, 2I] added in fp32 to the rounded products, clamped SwiGLU
    in fp32, one rounding) -> [M, I]; else the products plus bias[e] (added in fp32 to the rounded products,
    one rounding) -> [M, out]. Differentiable in x and addend through autograd."""
    _check(x, blocks, scales, bounds, bias, addend)
    weight = dequantize(blocks, scales, x.dtype, byte_format)  # [E, out, in]
    counts = (bounds[1:] - bounds[:-1]).tolist()
    pieces = [chunk @ weight[e].t() for e, chunk in enumerate(x.split(counts)) if chunk.shape[0]]
    y = torch.cat(pieces) if pieces else x @ weight[0].t()  # no rows: an empty product, still tied to x
    if addend is not None:
        y = y + addend
    acc = torch.promote_types(x.dtype, torch.float32)
    if swiglu is None:
        if bias is None:
            return y
        return (y.to(acc) + bias.to(acc)[expert_of_rows(bounds, y.shape[0])]).to(x.dtype)
    limit, alpha = swiglu
    if y.shape[1] % 2:
        raise ValueError(f"fc1 blocks {tuple(blocks.shape)}: the output width must be even ([gate; up])")
    h = y.to(acc)
    if bias is not None:
        h = h + bias.to(acc)[expert_of_rows(bounds, h.shape[0])]
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Kernels: tiles, dispatch, launches
@dataclass(frozen=True)
class Mxfp4Config:
    """Tiles and launch parameters of the forward kernel (`block_n` output columns, `block_k` a multiple of
    32) and of the input-gradient kernel (`bwd_*`: `block_k` columns of x, `bwd_block_r` of the reduction
    over the output width)."""

    block_m: int  # rows per tile (an expert with more rows loops over tiles, reading its weight again)
    block_n: int
    block_k: int
    warps: int
    stages: int
    swap: bool = False  # scaled kernel: the weight on the left of tl.dot_scaled (the portable one always is)
    # portable kernel's decoding (`DECODES`, module doc of the kernels): "bytes", "groups" or "ptx" (bf16 rows
    # on CUDA only; elsewhere "groups")
    decode: str = "bytes"
    # "groups" / "ptx": K values decoded and multiplied at once inside a block_k step (a multiple of 32 that
    # divides block_k; 0: block_k): the step's loads are issued together, its decoded tile held in pieces
    sub_k: int = 0
    # registers a thread at most (Triton's `maxnreg`; 0: the compiler's choice): fewer let more programs share
    # an SM (sm_90, the pairs' fc1 at 64-row tiles: 168 registers, 3 programs; at 128, 4 programs and 128
    # bytes spilled: `benchmarks/sass_mxfp4.py --maxnreg`)
    maxnreg: int = 0
    # portable kernel, row tiles of 32 rows or more: a program whose rows fill at most half its row tile runs
    # a tile of half the height, the matrix unit's products over padding rows halved (the same values either
    # way; `default_config` sets it for fc1)
    half_tail: bool = False
    # CUDA, sm_90 and later: the forward launched with programmatic dependent launch (the kernel's PDL), so
    # that it starts while the kernel before it finishes (the same values; off: on an H200 it saved 1-3 us a
    # layer and nothing in the engine's decode step)
    pdl: bool = False
    bwd_block_m: int = 64
    bwd_block_r: int = 64
    bwd_block_k: int = 64
    bwd_warps: int = 4


DECODES = ("bytes", "groups", "ptx")
# the byte formats (`ops.mxfp4_bytes`, `ops.mxfp4_relaid.kernel_weights`), in the kernels' numbering
BYTE_FORMATS = ("checkpoint", "shuffled", "pairs")


# Interpreter tiles (the CPU): small, few numpy calls.
CPU_CONFIG = Mxfp4Config(
    block_m=16, block_n=16, block_k=32, warps=1, stages=1, bwd_block_m=16, bwd_block_r=16, bwd_block_k=32,
    bwd_warps=1,
)  # fmt: skip
_MAX_SPLIT = 16  # programs sharing one expert's row tiles, at most


def default_config(
    rows: int, experts: int, device: torch.device, gated: bool, byte_format: str = "checkpoint"
) -> Mxfp4Config:
    """Tiles for `rows` expert-sorted rows over `experts` experts: a row tile of twice the average rows per
    expert in [16, 128] (`moe_decode.row_tile`), so at decode sizes each hit expert's weight is read once.
    K steps of 128 values for the checkpoint's bytes, of 64 for the pairs (`benchmarks/RESULTS.md`: on an
    H200 at gpt-oss-20b width the pairs' fc1 took 148 / 220 us at 256 / 1024 rows with 64, 179 / 259 us
    with 128; fc2 likewise). Eight warps for the gated 128-row tiles of the checkpoint's bytes, four for the
    pairs' (the pairs' fc1 at 2,048 rows, 512 decode slots: 322 us with four against 673 with eight).
    Half-height tail tiles (`Mxfp4Config.half_tail`) for fc1: on an H200 over the pairs tile by tile its
    fc1 took 260 / 187 us against 277 / 199 at 2,048 / 1,024 rows, fc2 158 / 103 us against 150 / 100.
    `byte_format` is a held format (`mxfp4_bytes.HELD_FORMATS`): "tiled_pairs" takes its tiles' shape
    (TILE_ROWS x TILE_K, the pairs' on a GPU), forward and input gradient."""
    if device.type != "cuda":  # the interpreter's tiles; the other byte formats need a block-vector decoding
        if byte_format == "checkpoint":
            return CPU_CONFIG
        return _held_tiles(dataclasses.replace(CPU_CONFIG, decode="groups"), byte_format)
    block_m = row_tile(rows, experts, 2)
    warps = default_warps(block_m, gated, byte_format)
    block_k = 64 if byte_format_of(byte_format) == "pairs" else 128
    cfg = Mxfp4Config(
        block_m=block_m, block_n=64, block_k=block_k, warps=warps, stages=3, decode="ptx", half_tail=gated
    )
    return _held_tiles(fit_shared_memory(cfg, _shared_memory(device), gated), byte_format)


def _held_tiles(cfg: Mxfp4Config, byte_format: str) -> Mxfp4Config:
    """cfg with the tiles weights held in `byte_format` are stored in ("tiled_pairs"), else cfg."""
    if not is_tiled(byte_format):
        return cfg
    return dataclasses.replace(cfg, block_n=TILE_ROWS, block_k=TILE_K, bwd_block_k=TILE_K)


def default_warps(block_m: int, gated: bool, byte_format: str) -> int:
    """`default_config`'s warps a program: eight for the gated 128-row tiles of the checkpoint's bytes,
    else four."""
    return 8 if gated and block_m >= 128 and byte_format_of(byte_format) != "pairs" else 4


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory one block may use on `device` (H100: 227 KB; Ada and consumer Ampere: 99 KB)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


def fit_shared_memory(cfg: Mxfp4Config, budget: int, gated: bool) -> Mxfp4Config:
    """cfg with stages (down to 2), then block_k (down to 64) lowered until the forward's pipelined tiles
    (per stage: x's tile in 16-bit, the weight's bytes and scales, twice when `gated`) fit 3/4 of `budget`
    (the rest is left to the epilogue's layout conversions)."""
    stages, block_k = cfg.stages, cfg.block_k

    def over() -> bool:
        per_stage = cfg.block_m * block_k * 2 + (2 if gated else 1) * cfg.block_n * (
            block_k // 2 + block_k // 32
        )
        return stages * per_stage > budget * 3 // 4

    while over() and stages > 2:
        stages -= 1
    while over() and block_k > 64:
        block_k //= 2
    return dataclasses.replace(cfg, stages=stages, block_k=block_k)


# Triton releases (major, minor) under which the forward kernel loads each K step's scale bytes a step ahead.
# The sm_90 code of the K loop read by `benchmarks/sass_mxfp4.py --prefetch on|off` (16 rows, K steps of 64
# and 128): 3.6 keeps the loop's layout with the early load (pairs fc1 at K step 64: 270 instructions against
# 269), and on an H200 the pairs' expert layer took 265 / 376 us against 296 / 430 us at 64 / 256 tokens
# (`benchmarks/RESULTS.md`). 3.7, 3.8 and 3.9 then read the decoded bytes by ldmatrix and permute them (342
# to 373 instructions against 261 to 286): not timed on a GPU, so the load stays in its step there.
PREFETCH_TRITON = ((3, 6),)


@functools.cache
def prefetch_scales() -> bool:
    """Whether the forward kernel loads each K step's scale bytes a step ahead (`mxfp4_kernels.
    _portable_products`; the same values either way): under the Triton releases of PREFETCH_TRITON."""
    try:
        release = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(part) for part in release.split(".")[:2])
    return (major, minor) in PREFETCH_TRITON


def _split(rows: int, experts: int, block_m: int) -> int:
    """Programs per (column block, expert): the average row tiles per expert, in [1, _MAX_SPLIT]."""
    return max(1, min(_MAX_SPLIT, _cdiv(rows, max(experts, 1) * block_m)))


def _kernels():
    """The Triton kernels, imported on first use (TRITON_INTERPRET must be set before, on the CPU)."""
    return importlib.import_module("megatron_gptoss.ops.mxfp4_kernels")


_X_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # kernels' x dtypes
# (device name, tiles, gated) -> why the scaled kernel did not compile or run there (`scaled_failures`)
_SCALED_FAILED: dict[tuple[str, Mxfp4Config, bool], str] = {}


def scaled_failures() -> dict[tuple[str, Mxfp4Config, bool], str]:
    """The (device name, tiles, gated) launches of the scaled kernel that failed and ran the portable
    kernel instead, with the error: empty where every scaled launch compiled and ran."""
    return dict(_SCALED_FAILED)


def kernel_for(x: Tensor, path: str | None = None, byte_format: str = "checkpoint") -> str:
    """Which implementation a call on x runs: "reference", "portable", "scaled" (`tl.dot_scaled`; tiles it
    fails on run the portable kernel, `scaled_failures`) or "dequantized" (the module doc's paths). The
    interpreter (CPU) runs the kernels on fp32 rows only: its `tl.dot` does not model 16-bit floats and its
    casts to them truncate."""
    path = _resolve_path(path)
    if path == "reference" or not kernels_can_run(x) or x.dtype not in _X_FORMATS:
        return "reference"
    if not x.is_cuda and x.dtype != torch.float32:
        return "reference"
    if path == "portable" or x.dtype == torch.float32:
        return "portable"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "portable"
    if path == "auto" and (x.shape[0] <= PORTABLE_MAX_ROWS or torch.cuda.is_current_stream_capturing()):
        return "portable"  # a graph would keep the dequantized path's transient weights for its lifetime
    if path == "scaled" or x.dtype != torch.bfloat16:
        return "portable" if byte_format != "checkpoint" else "scaled"  # dot_scaled reads the released bytes
    return "dequantized"


def dequantize_kernel(
    blocks: Tensor, scales: Tensor, dtype: torch.dtype, byte_format: str = "checkpoint"
) -> Tensor:
    """`dequantize` by one Triton launch (CUDA, or the CPU under TRITON_INTERPRET=1): the same values in
    `dtype` (bf16, fp16 or fp32), scales up to 240 (2 ** 113; the kernels' range). Blocks held
    "tiled_pairs" are read tile by tile and written in rows."""
    _check_weights(blocks, scales)
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*scales.shape, BLOCK, dtype=dtype, device=blocks.device)
    groups = scales.numel()
    tiled = is_tiled(byte_format)
    if tiled:
        check_tileable(scales.shape[1], scales.shape[2] * BLOCK, f"a weight of {tuple(blocks.shape)} bytes")
    if groups:
        grid = (_cdiv(groups, _DEQUANTIZE_GROUPS),)
        _kernels().mxfp4_dequant_kernel[grid](
            blocks, scales, out, groups, scales.shape[2], scales.shape[1] * scales.shape[2],
            BLOCK_G=_DEQUANTIZE_GROUPS, BYTE_FORMAT=BYTE_FORMATS.index(byte_format_of(byte_format)),
            PTX=_ptx_decodes(blocks, dtype), TILE_ROWS=TILE_ROWS if tiled else 0, TILE_GROUPS=TILE_K // BLOCK,
        )  # fmt: skip
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def _dequantized_product(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, transposed: bool, byte_format: str
) -> Tensor:
    """x [M, in] times each expert's W[e]^T ([M, out]), or with `transposed` x [M, out] times W[e] ([M, in]):
    the weights decoded to x's dtype `DEQUANTIZE_CHUNK_BYTES` at a most at a time (one expert at least;
    more than one chunk reads the bounds on the host), each chunk's rows by `torch._grouped_mm`."""
    experts, out, groups = blocks.shape[:3]
    width = groups * BLOCK if transposed else out
    per_expert = out * groups * BLOCK * x.element_size()
    step = max(1, DEQUANTIZE_CHUNK_BYTES // per_expert)

    def product(rows: Tensor, first: int, stop: int, offs: Tensor) -> Tensor:
        w = dequantize_kernel(blocks[first:stop], scales[first:stop], x.dtype, byte_format)
        return torch._grouped_mm(rows, w if transposed else w.transpose(1, 2), offs=offs)

    if step >= experts:
        return product(x, 0, experts, bounds[1:])
    host = bounds.tolist()
    pieces = []
    for first in range(0, experts, step):
        stop = min(experts, first + step)
        rows = x[host[first] : host[stop]]
        if rows.shape[0]:
            pieces.append(product(rows, first, stop, bounds[first + 1 : stop + 1] - host[first]))
    return torch.cat(pieces) if pieces else x.new_empty(0, width)


class _DequantizedLinear(torch.autograd.Function):
    """The dequantized path of `grouped_linear_mxfp4`: nothing saved but the bytes; the backward decodes the
    weights again."""

    @staticmethod
    def forward(ctx, x, blocks, scales, bounds, byte_format):
        ctx.save_for_backward(blocks, scales, bounds)
        ctx.dtype, ctx.byte_format = x.dtype, byte_format
        return _dequantized_product(_contiguous_rows(x), blocks, scales, bounds, False, byte_format)

    @staticmethod
    def backward(ctx, grad):
        blocks, scales, bounds = ctx.saved_tensors
        grad = _contiguous_rows(grad.to(ctx.dtype))
        grad_x = _dequantized_product(grad, blocks, scales, bounds, True, ctx.byte_format)
        return grad_x, None, None, None, None


def _contiguous_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_layout(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """blocks and scales as the kernels read them: any strides over (expert, row), each row's bytes and
    scales contiguous (a slice of experts or rows is not copied)."""
    if blocks.stride(3) != 1 or blocks.stride(2) != BLOCK_BYTES:
        blocks = blocks.contiguous()
    return blocks, scales if scales.stride(2) == 1 else scales.contiguous()


def _tiled_layout(n: int, k: int, tiles_a_block: int = 1) -> tuple[int, ...]:
    """The kernels' tile addressing (`_row_major_layout`'s order) of blocks and scales held "tiled_pairs"
    (`mxfp4_bytes.tile_experts`; each expert contiguous): the tiles of a half (fc1's gate, up) n k / 2 bytes
    apart, a column block (`tiles_a_block` row blocks of TILE_ROWS rows) its K steps in order, each tile
    TILE_ROWS rows of TILE_K / 2 bytes (scales: / 16)."""
    check_tileable(n, k, f"a weight of {n} output columns a half")
    row_b, row_s = TILE_K // 2, TILE_K // BLOCK
    return (n * k // 2, tiles_a_block * TILE_ROWS * k // 2, TILE_ROWS * row_b, row_b,
            n * k // BLOCK, tiles_a_block * TILE_ROWS * k // BLOCK, TILE_ROWS * row_s, row_s)  # fmt: skip


def _tiled_weights(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """blocks and scales held "tiled_pairs" with each expert's bytes contiguous (a slice of experts is not
    copied)."""
    if not blocks[:1].is_contiguous():
        blocks = blocks.contiguous()
    return blocks, scales if scales[:1].is_contiguous() else scales.contiguous()


def _row_major_layout(blocks: Tensor, scales: Tensor, n: int, cfg: Mxfp4Config) -> tuple[int, ...]:
    """The forward kernel's tile addressing (wb_half, wb_col, wb_step, wb_row, then the same for the
    scales; the kernels' module doc) of row-major blocks [E, R, K / 32, 16] and scales [E, R, K / 32]."""
    sb, ss = blocks.stride(1), scales.stride(1)
    return n * sb, cfg.block_n * sb, cfg.block_k // 2, sb, n * ss, cfg.block_n * ss, cfg.block_k // 32, ss


def _forward(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, addend: Tensor | None, bounds: Tensor,
    gated: bool, limit: float, alpha: float, kernel: str, config: Mxfp4Config | None,
    out_dtype: torch.dtype | None = None, byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """One launch of the forward kernel over the weights as held (`byte_format`, a held format: row-major
    bytes, or the pairs tile by tile); the output in x's dtype (`out_dtype`: another, which the products and
    their sums with the addend are rounded to instead: the tests' fp32 view of the bf16 kernels under the
    interpreter)."""
    tiled = is_tiled(byte_format)
    blocks, scales = _tiled_weights(blocks, scales) if tiled else _kernel_layout(blocks, scales)
    e, rows_w = blocks.shape[:2]
    n = rows_w // 2 if gated else rows_w
    cfg = default_config(x.shape[0], e, x.device, gated, byte_format) if config is None else config
    if tiled:
        if cfg.block_k != TILE_K or cfg.block_n % TILE_ROWS:
            raise ValueError(
                f"weights held 'tiled_pairs' are read in their {TILE_ROWS} x {TILE_K} tiles: the kernel's "
                f"block_n must be a multiple of {TILE_ROWS} and its block_k {TILE_K}, got {cfg.block_n} x "
                f"{cfg.block_k}"
            )
        layout = _tiled_layout(n, blocks.shape[2] * BLOCK, cfg.block_n // TILE_ROWS)
    else:
        layout = _row_major_layout(blocks, scales, n, cfg)
    return _launch_forward(
        x, blocks, scales, layout, n, bias, addend, bounds, gated, limit, alpha, kernel, cfg, out_dtype,
        BYTE_FORMATS.index(byte_format_of(byte_format)), TILE_ROWS if tiled else 0,
    )  # fmt: skip


def _launch_forward(
    x: Tensor, wb: Tensor, ws: Tensor, layout: tuple[int, ...], n: int, bias: Tensor | None,
    addend: Tensor | None, bounds: Tensor, gated: bool, limit: float, alpha: float, kernel: str,
    cfg: Mxfp4Config, out_dtype: torch.dtype | None, byte_format: int, sub_rows: int = 0,
) -> Tensor:  # fmt: skip
    """The forward kernel over weights wb / ws (expert e at wb[e], ws[e]) addressed by `layout`
    (`_row_major_layout`'s, `_tiled_layout`'s, or an `mxfp4_relaid.KernelWeights`'s), their bytes in
    BYTE_FORMATS[byte_format]; `sub_rows` (0: none): a column block's rows stored in tiles of that many
    (`_tiled_layout`'s row blocks)."""
    x = _contiguous_rows(x)
    bias = bias if bias is None else _contiguous_rows(bias)
    addend = addend if addend is None else _contiguous_rows(addend)
    m, k = x.shape
    e = wb.shape[0]
    out = x.new_empty(m, n, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if cfg.decode not in DECODES:
        raise ValueError(f"Mxfp4Config.decode must be one of {DECODES}, got {cfg.decode!r}")
    decode = DECODES.index(cfg.decode)
    sub_k = cfg.block_k if cfg.sub_k == 0 or decode == 0 else cfg.sub_k
    if sub_k % BLOCK or cfg.block_k % sub_k:
        raise ValueError(f"Mxfp4Config.sub_k must be a multiple of {BLOCK} dividing block_k {cfg.block_k}, "
                         f"got {cfg.sub_k}")  # fmt: skip
    if byte_format and decode == 0:
        raise ValueError(f"byte format {BYTE_FORMATS[byte_format]!r} needs the 'groups' or 'ptx' decoding, "
                         f"got {cfg}")  # fmt: skip
    if cfg.decode == "ptx" and not _ptx_decodes(x, x.dtype):
        decode = DECODES.index("groups")
    has_bias, has_add = bias is not None, addend is not None
    bias_arg = x if bias is None else bias
    add_arg = x if addend is None else addend
    grid = (_cdiv(n, cfg.block_n), e, _split(m, e, cfg.block_m))
    pdl = cfg.pdl and x.is_cuda and _kernels().GDC and torch.cuda.get_device_capability(x.device) >= (9, 0)
    _kernels().mxfp4_fwd_kernel[grid](
        x, wb, ws, bias_arg, add_arg, out, bounds, n, k, x.stride(0), wb.stride(0), *layout[:4], ws.stride(0),
        *layout[4:], bias_arg.stride(0) if has_bias else 0, add_arg.stride(0) if has_add else 0,
        out.stride(0), float(limit), float(alpha),
        GATED=gated, HAS_BIAS=has_bias, HAS_ADD=has_add, SCALED=kernel == "scaled", SWAP=cfg.swap,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        X_FORMAT=_X_FORMATS[x.dtype], DECODE=decode, SUB_K=sub_k, BYTE_FORMAT=byte_format,
        PREFETCH_SCALES=prefetch_scales(), HALF_TAIL=half_tail(cfg, kernel), SUB_ROWS=sub_rows, PDL=pdl,
        num_warps=cfg.warps, num_stages=cfg.stages, **_registers(cfg), **({"launch_pdl": pdl} if pdl else {}),
    )  # fmt: skip
    return out


def half_tail(cfg: Mxfp4Config, kernel: str) -> bool:
    """Whether the forward kernel runs a program whose rows fill at most half its row tile at half height
    (`Mxfp4Config.half_tail`; the portable kernel at row tiles of 32 or more: the matrix unit's tiles are 16
    rows at least)."""
    return cfg.half_tail and kernel != "scaled" and cfg.block_m >= 32


def _registers(cfg: Mxfp4Config) -> dict[str, int]:
    """The forward's launch option capping its registers a thread, where `cfg` sets one."""
    if cfg.maxnreg < 0:
        raise ValueError(f"Mxfp4Config.maxnreg must be >= 0 (0: the compiler's choice), got {cfg.maxnreg}")
    return {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}


def _forward_any(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, addend: Tensor | None, bounds: Tensor,
    gated: bool, limit: float, alpha: float, kernel: str, config: Mxfp4Config | None,
    byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """`_forward`; where the scaled kernel fails to compile or launch on a GPU with these tiles, warns once
    and runs the portable kernel from then on for them (`scaled_failures`)."""
    args = (x, blocks, scales, bias, addend, bounds, gated, limit, alpha)
    if kernel != "scaled" or not x.is_cuda:
        return _forward(*args, kernel, config, None, byte_format)
    cfg = default_config(x.shape[0], blocks.shape[0], x.device, gated) if config is None else config
    key = (torch.cuda.get_device_name(x.device), cfg, gated)
    if key in _SCALED_FAILED:
        return _forward(*args, "portable", cfg)
    compile_errors = (importlib.import_module("triton.compiler.errors").CompilationError, RuntimeError)
    try:
        return _forward(*args, kernel, cfg)
    except compile_errors as error:
        _SCALED_FAILED[key] = f"{type(error).__name__}: {error}"
        warnings.warn(f"MXFP4 GEMM: the tl.dot_scaled kernel failed on {key[0]} with {cfg} (gated {gated}), "
                      f"running the portable kernel: {_SCALED_FAILED[key][:300]}", stacklevel=3)  # fmt: skip
        return _forward(*args, "portable", cfg)


def _input_grad(grad: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, dtype: torch.dtype,
                config: Mxfp4Config | None, byte_format: str = "checkpoint") -> Tensor:  # fmt: skip
    """grad_x = grad_y W[e] by the input-gradient kernel over the weights as held (`byte_format`)."""
    grad = _contiguous_rows(grad.to(dtype))
    tiled = is_tiled(byte_format)
    blocks, scales = _tiled_weights(blocks, scales) if tiled else _kernel_layout(blocks, scales)
    m, n = grad.shape
    e = blocks.shape[0]
    k = blocks.shape[2] * BLOCK
    grad_x = grad.new_empty(m, k)
    if m == 0:
        return grad_x
    cfg = default_config(m, e, grad.device, False, byte_format) if config is None else config
    # a row's stride, and a tile's row block's and K step's (row-major: rows only)
    wb_row, ws_row, wb_col, wb_step, ws_col, ws_step = blocks.stride(1), scales.stride(1), 0, 0, 0, 0
    if tiled:
        if cfg.bwd_block_k != TILE_K or TILE_ROWS % cfg.bwd_block_r:
            raise ValueError(f"weights held 'tiled_pairs' need bwd_block_k {TILE_K} and bwd_block_r dividing "
                             f"{TILE_ROWS}, got {cfg}")  # fmt: skip
        _, wb_col, wb_step, wb_row, _, ws_col, ws_step, ws_row = _tiled_layout(n, k)
    grid = (_cdiv(k, cfg.bwd_block_k), e, _split(m, e, cfg.bwd_block_m))
    _kernels().mxfp4_bwd_kernel[grid](
        grad, blocks, scales, grad_x, bounds, n, k, grad.stride(0), blocks.stride(0), wb_row,
        scales.stride(0), ws_row, grad_x.stride(0), wb_col, wb_step, ws_col, ws_step,
        BLOCK_M=cfg.bwd_block_m, BLOCK_R=cfg.bwd_block_r, BLOCK_K=cfg.bwd_block_k,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        BYTE_FORMAT=BYTE_FORMATS.index(byte_format_of(byte_format)), PTX=_ptx_decodes(grad, dtype),
        TILE_ROWS=TILE_ROWS if tiled else 0, num_warps=cfg.bwd_warps,
    )  # fmt: skip
    return grad_x


class _GroupedLinear(torch.autograd.Function):
    """x W[e]^T (+ addend) by the forward kernel; the gradients: grad_y W[e] for x, grad_y for the addend."""

    @staticmethod
    def forward(ctx, x, blocks, scales, bounds, addend, kernel, config, byte_format):
        ctx.save_for_backward(blocks, scales, bounds)
        ctx.dtype, ctx.config, ctx.byte_format = x.dtype, config, byte_format
        args = (x, blocks, scales, None, addend, bounds, False, 0.0, 0.0, kernel, config, byte_format)
        return _forward_any(*args)

    @staticmethod
    def backward(ctx, grad):
        blocks, scales, bounds = ctx.saved_tensors
        grad_x = _input_grad(grad, blocks, scales, bounds, ctx.dtype, ctx.config, ctx.byte_format)
        grad_addend = grad if ctx.needs_input_grad[4] else None
        return grad_x, None, None, None, grad_addend, None, None, None


# ------------------------------------------------------------------------------------------------
# Public API
def grouped_linear_mxfp4(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, path: str | None = None,
    config: Mxfp4Config | None = None, addend: Tensor | None = None, byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """x [M, in] sorted by expert, blocks [E, out, in / 32, 16] / scales [E, out, in / 32] uint8, bounds int32
    [E + 1], addend [M, out] in x's dtype or None -> x W[e]^T (+ addend) [M, out] in x's dtype (module doc).
    Differentiable in x: grad_x = grad_y W[e], decoded in registers along the other axis (the portable kernel
    on every path but "reference"); and in the addend: grad_y. `byte_format`: the blocks' bytes as the
    checkpoint holds them or as `mxfp4_bytes.pair_words` re-encodes them (every path reads both; "scaled"
    runs the portable kernel on pairs)."""
    _check(x, blocks, scales, bounds, addend=addend, byte_format=byte_format)
    kernel = kernel_for(x, path, byte_format)
    if kernel == "reference":
        return reference_dequantized(x, blocks, scales, bounds, addend=addend, byte_format=byte_format)
    if kernel == "dequantized":
        y = _DequantizedLinear.apply(x, blocks, scales, bounds, byte_format)
        return y if addend is None else y + addend
    return _GroupedLinear.apply(x, blocks, scales, bounds, addend, kernel, config, byte_format)


def fc1_swiglu_mxfp4(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, bounds: Tensor,
    limit: float, alpha: float, path: str | None = None, config: Mxfp4Config | None = None,
    addend: Tensor | None = None, byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """x [M, in] sorted by expert, fc1 blocks [E, 2I, in / 32, 16] / scales [E, 2I, in / 32] ([gate; up]
    rows), bias [E, 2I] or None, addend [M, 2I] ([gate; up]) in x's dtype or None -> the clamped SwiGLU
    [M, I] of x W[e]^T (+ addend) + bias[e] in x's dtype (module doc). Forward only: refused where autograd
    would record it (the learner composes `grouped_linear_mxfp4` and `fused_moe.swiglu_bias`). `byte_format`:
    `grouped_linear_mxfp4`'s."""
    if blocks.shape[1] % 2:
        raise ValueError(f"fc1 blocks {tuple(blocks.shape)}: the output width must be even ([gate; up])")
    return _forward_only(
        "fc1_swiglu_mxfp4", "fused_moe.swiglu_bias", x, blocks, scales, bias, bounds, (limit, alpha), path,
        config, addend, byte_format,
    )  # fmt: skip


def fc2_bias_mxfp4(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, bounds: Tensor, path: str | None = None,
    config: Mxfp4Config | None = None, addend: Tensor | None = None, byte_format: str = "checkpoint",
) -> Tensor:  # fmt: skip
    """x [M, in] sorted by expert, blocks [E, out, in / 32, 16] / scales [E, out, in / 32], bias [E, out] or
    None, addend [M, out] in x's dtype or None -> x W[e]^T (+ addend) + bias[e] [M, out] in x's dtype:
    `grouped_linear_mxfp4` then `fused_moe.expert_bias`, the bias added in the kernel's epilogue (fp32 on the
    rounded product, one rounding: the same bits). Forward only, as `fc1_swiglu_mxfp4`."""
    return _forward_only(
        "fc2_bias_mxfp4", "fused_moe.expert_bias", x, blocks, scales, bias, bounds, None, path, config,
        addend, byte_format,
    )  # fmt: skip


def _forward_only(
    name: str, composed: str, x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, bounds: Tensor,
    swiglu: tuple[float, float] | None, path: str | None, config: Mxfp4Config | None, addend: Tensor | None,
    byte_format: str,
) -> Tensor:  # fmt: skip
    """`fc1_swiglu_mxfp4` (`swiglu` = (limit, alpha)) or `fc2_bias_mxfp4` (None) on the path `kernel_for`
    picks; refused where autograd would record it (the learner composes `grouped_linear_mxfp4` and
    `composed`)."""
    _check(x, blocks, scales, bounds, bias, addend, byte_format)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, bias, addend)):
        raise RuntimeError(
            f"{name} is forward only and autograd would record it (x, bias or addend requires grad): "
            f"compose grouped_linear_mxfp4 and {composed}, or call it under torch.no_grad()"
        )
    kernel = kernel_for(x, path, byte_format)
    with torch.no_grad():
        if kernel == "reference":
            swiglu_f = None if swiglu is None else (float(swiglu[0]), float(swiglu[1]))
            return reference_dequantized(x, blocks, scales, bounds, bias, swiglu_f, addend, byte_format)
        if kernel == "dequantized":
            y = _dequantized_product(_contiguous_rows(x), blocks, scales, bounds, False, byte_format)
            y = y if addend is None else y + addend
            if swiglu is not None:
                return fused_moe.swiglu_bias(y, bias, bounds, *swiglu)
            return y if bias is None else fused_moe.expert_bias(y, bias, bounds)
        limit, alpha = (0.0, 0.0) if swiglu is None else swiglu
        args = (x, blocks, scales, bias, addend, bounds, swiglu is not None, limit, alpha, kernel, config)
        return _forward_any(*args, byte_format)
