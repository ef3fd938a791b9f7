"""Triton kernel of the decode expert GEMMs: few rows per expert, each expert's weight streamed once.
Launched only from `megatron_gptoss.ops.moe_decode`, which states the contracts.

Rows are sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), `bounds` int32 [E + 1]). The grid
is static, (output column blocks, E): program (n, e) owns columns [n BLOCK_N, (n + 1) BLOCK_N) of expert
e's rows, loops over those rows in BLOCK_M tiles and, per tile, over K in BLOCK_K steps from 0 up with
fp32 accumulation. An expert without rows returns at once, so its weight is never read. With one row tile
per expert (rows <= BLOCK_M) every weight element is loaded once. The column blocks of one expert are
neighbours in the launch order, so they run together and share its rows in L2; weights are loaded to be
evicted first, rows to be kept.

SWAP puts the weight tile on the left of the product (acc [BLOCK_N, BLOCK_M] = W x^T): the weight's
columns fill the matrix unit's wide dimension and the few rows its narrow one. The result is the same sum
in the same K order, transposed before the epilogue. TMA reads the tiles through tensor descriptors
(Hopper's bulk copies: no per-element addresses in registers) instead of pointers; a tile then also covers
rows of the neighbouring expert, whose products are computed and not stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_gptoss.ops.moe_kernels import _swiglu_parts


@triton.jit
def _rows_products(
    x_base, w_base, rows, row_ok, cols, col_ok, N, K, stride_x, stride_wn,
    GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """(lo, hi) fp32 [BLOCK_M, BLOCK_N]: x[rows] @ w[cols]^T and, GATED, x[rows] @ w[N + cols]^T (both
    from the same x tile); masked rows and columns read as zero."""
    if SWAP:
        lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        lo = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    hi = lo
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        if SWAP:
            x_mask = row_ok[None, :] & k_ok[:, None]
            xt = tl.load(
                x_base + rows[None, :] * stride_x + ks[:, None],
                mask=x_mask,
                other=0.0,
                eviction_policy="evict_last",
            )
            w_ptrs = w_base + cols[:, None] * stride_wn + ks[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_lo = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            lo = tl.dot(w_lo, xt, lo, input_precision=DOT_PRECISION)
            if GATED:
                w_hi = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0, eviction_policy="evict_first")
                hi = tl.dot(w_hi, xt, hi, input_precision=DOT_PRECISION)
        else:
            x_mask = row_ok[:, None] & k_ok[None, :]
            x = tl.load(
                x_base + rows[:, None] * stride_x + ks[None, :],
                mask=x_mask,
                other=0.0,
                eviction_policy="evict_last",
            )
            w_ptrs = w_base + cols[None, :] * stride_wn + ks[:, None]
            w_mask = col_ok[None, :] & k_ok[:, None]
            w_lo = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            lo = tl.dot(x, w_lo, lo, input_precision=DOT_PRECISION)
            if GATED:
                w_hi = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0, eviction_policy="evict_first")
                hi = tl.dot(x, w_hi, hi, input_precision=DOT_PRECISION)
    if SWAP:
        lo = tl.trans(lo)
        hi = tl.trans(hi)
    return lo, hi


@triton.jit
def _rows_products_tma(
    x_desc, w_desc, r0, w_row, N, K,
    GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_rows_products` through tensor descriptors (TMA on sm_90+): x_desc over X [M, K] with blocks
    [BLOCK_M, BLOCK_K], w_desc over W as [E * rows, K] with blocks [BLOCK_N, BLOCK_K]; the tiles start at
    row r0 of X and row w_row of W. Reads past a tensor's end are zero; rows of the neighbouring expert
    (or the up half) that a tile covers give products the caller does not store."""
    if SWAP:
        lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        lo = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    hi = lo
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([r0, k0])
        w_lo = w_desc.load([w_row, k0])
        if SWAP:
            lo = tl.dot(w_lo, tl.trans(x), lo, input_precision=DOT_PRECISION)
        else:
            lo = tl.dot(x, tl.trans(w_lo), lo, input_precision=DOT_PRECISION)
        if GATED:
            w_hi = w_desc.load([w_row + N, k0])
            if SWAP:
                hi = tl.dot(w_hi, tl.trans(x), hi, input_precision=DOT_PRECISION)
            else:
                hi = tl.dot(x, tl.trans(w_hi), hi, input_precision=DOT_PRECISION)
    if SWAP:
        lo = tl.trans(lo)
        hi = tl.trans(hi)
    return lo, hi


@triton.jit
def _round_add(acc, add_ptrs, mask, DTYPE: tl.constexpr, HAS_ADD: tl.constexpr):
    """fp32 products `acc` rounded to DTYPE (the output's); HAS_ADD: plus the values at add_ptrs (masked: 0)
    in fp32, the sum rounded to DTYPE again. Returned in fp32."""
    acc = acc.to(DTYPE).to(tl.float32)
    if HAS_ADD:
        addend = tl.load(add_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc = (acc + addend).to(DTYPE).to(tl.float32)
    return acc


@triton.jit
def _bias_rows(Bias, e, stride_be, cols, col_ok, N, GATED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(lo, hi) fp32: expert e's bias at the program's columns cols (hi: the up half's, N columns on); zeros
    without a bias (or, not GATED, for hi)."""
    b_lo = tl.zeros(cols.shape, dtype=tl.float32)
    b_hi = b_lo
    if HAS_BIAS:
        b_lo = tl.load(Bias + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            b_hi = tl.load(Bias + e * stride_be + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return b_lo, b_hi


@triton.jit
def _store_rows(
    lo, hi, b_lo, b_hi, Add, Out, rows, row_ok, cols, col_ok, N, stride_add, stride_out, limit, alpha,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
):  # fmt: skip
    """The grouped kernels' epilogue: Out[rows, cols] of the fp32 products lo (and, GATED, hi: the up half, N
    columns on). Each product rounded to Out's dtype, as the library's GEMM writes it, the addend's sum
    rounded again, as a tensor addition writes it; bias and SwiGLU in fp32 on the rounded values."""
    mask = row_ok[:, None] & col_ok[None, :]
    add_ptrs = Add + rows[:, None] * stride_add + cols[None, :]
    lo = _round_add(lo, add_ptrs, mask, Out.dtype.element_ty, HAS_ADD)
    if HAS_BIAS:
        lo += b_lo[None, :]
    if GATED:
        hi = _round_add(hi, add_ptrs + N, mask, Out.dtype.element_ty, HAS_ADD)
        if HAS_BIAS:
            hi += b_hi[None, :]
        gate, up, s = _swiglu_parts(lo, hi, limit, alpha)
        res = (up + 1.0) * (gate * s)
    else:
        res = lo
    out_ptrs = Out + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, res.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def decode_grouped_kernel(
    X, W, Bias, Add, Out, bounds, x_desc, w_desc, N, K, W_ROWS, stride_x, stride_we, stride_wn, stride_be,
    stride_add, stride_out, limit, alpha, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
    SWAP: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Out[r, c] for the rows r of expert e and the program's columns c < N, X [M, K], W [E, *, K] with
    unit stride along K. GATED: W [E, 2N, K] as [gate; up], Bias [E, 2N], Add [M, 2N]; Out = (up + 1) *
    gate * sigmoid(alpha gate) with gate = min(g, limit), up = clamp(u, -limit, limit) of g, u = the rows'
    products with W[e, c] and W[e, N + c] (plus Add[r, c] and Add[r, N + c]) plus the bias. Not GATED:
    W [E, N, K], Bias [E, N], Add [M, N]; Out = product (+ Add[r, c]) + bias. Products accumulated in fp32
    and rounded to Out's dtype (the library GEMM's output); HAS_ADD: Add added in fp32 and the sum rounded
    to Out's dtype again; the epilogue in fp32 on them, one more rounding to Out's dtype. TMA: the tiles are
    read through x_desc and w_desc (`_rows_products_tma`; W_ROWS = W.shape[1]), else through pointers (the
    descriptors unused)."""
    e = tl.program_id(1)
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    if start >= end:
        return
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = W + e.to(tl.int64) * stride_we
    b_lo, b_hi = _bias_rows(Bias, e, stride_be, cols, col_ok, N, GATED, HAS_BIAS)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        if TMA:
            lo, hi = _rows_products_tma(
                x_desc, w_desc, r0, e * W_ROWS + tl.program_id(0) * BLOCK_N, N, K,
                GATED, SWAP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
            )  # fmt: skip
        else:
            lo, hi = _rows_products(
                X, w_base, rows, row_ok, cols, col_ok, N, K, stride_x, stride_wn,
                GATED, SWAP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
            )  # fmt: skip
        _store_rows(
            lo, hi, b_lo, b_hi, Add, Out, rows, row_ok, cols, col_ok, N, stride_add, stride_out, limit, alpha,
            GATED, HAS_BIAS, HAS_ADD,
        )  # fmt: skip
