"""Triton kernels of the batch-invariant mode (`megatron_gptoss.ops.batch_invariant`): one fixed tiling per
kernel, whatever the number of rows, and every reduction in a fixed order inside one program (no split-K,
no atomics), so each output row is a function of its own input row only."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_matmul_kernel(
    A, W, Bias, C, bounds, tile_start,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_cm, stride_cn,
    M, N, K, E,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """C[r] = A[r] @ W[e]^T (+ Bias[e]) for the rows r of expert e, [bounds[e], bounds[e + 1]).
    Program (t, n): row tile t of the tiles laid out expert after expert (`tile_start` [E + 1], exclusive
    prefix sums of each expert's tile count), columns [n BLOCK_N, (n + 1) BLOCK_N). Not GROUPED: one
    expert owning all M rows (bounds and tile_start unused). fp32 accumulation over K in BLOCK_K steps from
    0 up, bias added in fp32, one rounding to C's dtype."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        offs_e = tl.arange(0, E_POW2)
        starts = tl.load(tile_start + 1 + offs_e, mask=offs_e < E, other=2147483647)
        e = tl.sum((starts <= pid_t).to(tl.int32), 0)  # tiles of experts before e end at or before pid_t
        if e >= E:
            return
        row_hi = tl.load(bounds + e + 1)
        first = tl.load(bounds + e) + (pid_t - tl.load(tile_start + e)) * BLOCK_M
    else:
        e = 0
        row_hi = M
        first = pid_t * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < row_hi
    col_ok = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = W + tl.cast(e, tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k + k < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(Bias + tl.cast(e, tl.int64) * stride_be + offs_n, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def logsumexp_kernel(X, Out, N, stride_x, BLOCK: tl.constexpr):
    """Out[r] = log sum_j exp(X[r, j]) in fp32: one program per row, columns in BLOCK steps from 0 up,
    an online maximum and rescaled sum."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = X + row.to(tl.int64) * stride_x
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that has seen only -inf shifts by 0 instead (its terms are exp(-inf) = 0, never NaN)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    tl.store(Out + row, top + tl.log(tl.sum(s * tl.exp(m - top), 0)))
