"""Triton kernels of the MoE block: token permutation, router-weighted combine, bias + clamped SwiGLU,
per-expert bias. Launched only from `megatron_gptoss.ops.fused_moe`, which states the contracts.

Shared indexing. N tokens each routed to K experts give N * K slots (slot t * K + j is token t's j-th
choice); `slot_rows` [N * K] maps each slot to its row in the expert-sorted layout [N * K, H]. Sorted
rows of expert e are [bounds[e], bounds[e + 1]) (`bounds` int32 [E + 1], bounds[0] = 0). Per-token
kernels take the K rows of a token as one [K_PAD, BLOCK] tile (K_PAD: K rounded up to a power of two,
padding rows masked). Per-expert kernels run one program per (expert, column block) and loop over that
expert's rows, so per-expert sums (bias gradients) need no atomics: every result is written by one
program in a fixed order, and the gradients are bitwise identical across runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------------
# Routing sort of few slots: one program sorts (expert, slot) keys, then counts the rows below each expert
@triton.jit
def sort_small_kernel(
    indices, slot_rows, order, bounds, n, E, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr, BLOCK_E: tl.constexpr
):  # fmt: skip
    slots = tl.arange(0, BLOCK_N)
    valid = slots < n
    expert = tl.load(indices + slots, mask=valid, other=E).to(tl.int32)  # padding sorts after every expert
    keys = tl.sort((expert << LOG_N) | slots)  # distinct keys: by expert, then by slot (stable)
    slot = keys & (BLOCK_N - 1)
    tl.store(order + slots, slot.to(tl.int64), mask=valid)
    tl.store(slot_rows + slot, slots.to(tl.int64), mask=valid)
    for first in range(0, E + 1, BLOCK_E):
        edge = first + tl.arange(0, BLOCK_E)
        below = tl.sum((expert[None, :] < edge[:, None]).to(tl.int32), axis=1)  # rows of experts < edge
        tl.store(bounds + edge, below, mask=edge <= E)


# ------------------------------------------------------------------------------------------------
# Permutation: token rows -> expert-sorted rows, and its backward (sum of a token's K rows)
@triton.jit
def permute_fwd_kernel(
    x, out, slot_rows, H, stride_x, stride_out, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    j = tl.arange(0, K_PAD)
    rows = tl.load(slot_rows + t * K + j, mask=j < K, other=0).to(tl.int64)
    v = tl.load(x + t * stride_x + cols, mask=col_ok)
    tile = tl.broadcast_to(v[None, :], (K_PAD, BLOCK))
    tl.store(out + rows[:, None] * stride_out + cols[None, :], tile, mask=(j < K)[:, None] & col_ok[None, :])


@triton.jit
def permute_bwd_kernel(
    grad_rows, grad_x, slot_rows, H, stride_g, stride_gx, K: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    j = tl.arange(0, K_PAD)
    rows = tl.load(slot_rows + t * K + j, mask=j < K, other=0).to(tl.int64)
    mask = (j < K)[:, None] & col_ok[None, :]
    g = tl.load(grad_rows + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_x + t * stride_gx + cols, tl.sum(g, axis=0).to(grad_x.dtype.element_ty), mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Combine: out[t] = sum_j probs[t, j] * y[slot_rows[t K + j]] in fp32
@triton.jit
def unpermute_fwd_kernel(
    y, probs, out, slot_rows, H, stride_y, stride_out, K: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    j = tl.arange(0, K_PAD)
    rows = tl.load(slot_rows + t * K + j, mask=j < K, other=0).to(tl.int64)
    p = tl.load(probs + t * K + j, mask=j < K, other=0.0).to(tl.float32)
    mask = (j < K)[:, None] & col_ok[None, :]
    v = tl.load(y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = tl.sum(p[:, None] * v, axis=0)
    tl.store(out + t * stride_out + cols, acc.to(out.dtype.element_ty), mask=col_ok)


@triton.jit
def unpermute_bwd_kernel(
    grad_out, y, probs, grad_y, grad_probs, slot_rows, H, stride_g, stride_y, stride_gy,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per token: grad_y rows = probs * grad_out[t]; grad_probs[t, j] = <grad_out[t], y row>."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    rows = tl.load(slot_rows + t * K + j, mask=j < K, other=0).to(tl.int64)
    p = tl.load(probs + t * K + j, mask=j < K, other=0.0).to(tl.float32)
    dot = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        col_ok = cols < H
        mask = (j < K)[:, None] & col_ok[None, :]
        g = tl.load(grad_out + t * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
        v = tl.load(y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(v * g[None, :], axis=1)
        gy = p[:, None] * g[None, :]
        tl.store(
            grad_y + rows[:, None] * stride_gy + cols[None, :], gy.to(grad_y.dtype.element_ty), mask=mask
        )
    tl.store(grad_probs + t * K + j, dot, mask=j < K)


# ------------------------------------------------------------------------------------------------
# Bias + clamped SwiGLU over expert-sorted rows h [M, 2I] ([gate; up]) -> [M, I]
@triton.jit
def _swiglu_parts(g, u, limit, alpha):
    gate = tl.minimum(g, limit)
    up = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(alpha * gate)
    return gate, up, s


@triton.jit
def swiglu_fwd_kernel(
    h, bias, out, bounds, I, stride_h, stride_out, stride_b, limit, alpha,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < I
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    if HAS_BIAS:
        bg = tl.load(bias + e * stride_b + cols, mask=col_ok, other=0.0).to(tl.float32)
        bu = tl.load(bias + e * stride_b + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < end)[:, None] & col_ok[None, :]
        ptrs = h + rows[:, None] * stride_h + cols[None, :]
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + I, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += bg[None, :]
            u += bu[None, :]
        gate, up, s = _swiglu_parts(g, u, limit, alpha)
        res = (up + 1.0) * (gate * s)
        tl.store(out + rows[:, None] * stride_out + cols[None, :], res.to(out.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    h, bias, grad_out, grad_h, grad_bias, bounds, I, stride_h, stride_go, stride_gh, stride_b, limit, alpha,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """grad_h [M, 2I] and, with a bias, grad_bias [E, 2I] fp32: the expert's rows summed per row slot of the
    tile (rows r0 + i, in row order) and the slots summed once at the end (a fixed order)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < I
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    if HAS_BIAS:
        bg = tl.load(bias + e * stride_b + cols, mask=col_ok, other=0.0).to(tl.float32)
        bu = tl.load(bias + e * stride_b + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < end)[:, None] & col_ok[None, :]
        ptrs = h + rows[:, None] * stride_h + cols[None, :]
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + I, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += bg[None, :]
            u += bu[None, :]
        go = tl.load(grad_out + rows[:, None] * stride_go + cols[None, :], mask=mask, other=0.0)
        go = go.to(tl.float32)
        gate, up, s = _swiglu_parts(g, u, limit, alpha)
        d_gate = go * (up + 1.0) * (s + alpha * gate * s * (1.0 - s))
        d_gate = tl.where(mask & (g <= limit), d_gate, 0.0)
        d_up = tl.where(mask & (u >= -limit) & (u <= limit), go * gate * s, 0.0)
        out_ptrs = grad_h + rows[:, None] * stride_gh + cols[None, :]
        tl.store(out_ptrs, d_gate.to(grad_h.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + I, d_up.to(grad_h.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc_g += d_gate
            acc_u += d_up
    if HAS_BIAS:
        tl.store(grad_bias + e * 2 * I + cols, tl.sum(acc_g, axis=0), mask=col_ok)
        tl.store(grad_bias + e * 2 * I + I + cols, tl.sum(acc_u, axis=0), mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Per-expert bias over expert-sorted rows: out = y + bias[e]; its gradient is the expert's row sum
@triton.jit
def expert_bias_fwd_kernel(
    y, bias, out, bounds, C, stride_y, stride_out, stride_b, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr
):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    b = tl.load(bias + e * stride_b + cols, mask=col_ok, other=0.0).to(tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < end)[:, None] & col_ok[None, :]
        v = tl.load(y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        res = v + b[None, :]
        tl.store(out + rows[:, None] * stride_out + cols[None, :], res.to(out.dtype.element_ty), mask=mask)


@triton.jit
def expert_row_sum_kernel(
    g, out, bounds, C, stride_g, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """out [E, C] fp32: the sum of each expert's rows of g, per row slot of the tile (in row order), the slots
    summed once at the end (a fixed order)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < end)[:, None] & col_ok[None, :]
        acc += tl.load(g + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + e * C + cols, tl.sum(acc, axis=0), mask=col_ok)
