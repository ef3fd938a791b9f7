"""Fused MoE elementwise work with PyTorch references: routing sort (on the device, no host sync), token
permutation, router-weighted combine, bias + clamped SwiGLU, per-expert bias. Each op is an autograd
function over the Triton kernels of `megatron_gptoss.ops.moe_kernels` (CPU: TRITON_INTERPRET=1).

Layout. N tokens, each routed to K experts (`indices` [N, K]): slot t * K + j is token t's j-th choice.
`sort_by_expert` orders the N * K slots by expert (stable: by slot within an expert) and returns
`slot_rows` [N * K] int64 (the sorted row of each slot) and `bounds` int32 [E + 1] (expert e owns the
sorted rows [bounds[e], bounds[e + 1])), both on the device.

    permute(x [N, H], slot_rows, K)          -> rows [N * K, H]: rows[slot_rows[t K + j]] = x[t]
    unpermute(rows [N * K, H], probs, slot_rows) -> [N, H]: sum_j probs[t, j] * rows[slot_rows[t K + j]]
                                                 (probs fp32 [N, K]; fp32 accumulation, one rounding)
    swiglu_bias(h [M, 2I], bias [E, 2I] | None, bounds) -> [M, I]: clamped SwiGLU of h + bias[e]
    expert_bias(y [M, C], bias [E, C], bounds)   -> y + bias[e]

Precision: inputs are read in their dtype and computed in fp32, each output rounded once to its dtype;
bias gradients are fp32 sums over the expert's rows (each row slot of a tile in row order, then the slots)
cast to the bias dtype. Gradients are bitwise identical across runs (no atomics).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
from torch import Tensor

_TOKEN_BLOCK = 1024  # columns per program of the per-token kernels
_UNPERMUTE_BWD_BLOCK = 512  # columns per step of the combine's backward (one program per token)
# (rows, columns, warps) of the per-expert kernels: SwiGLU forward and backward, and bias / row sums (measured
# on an H100 at gpt-oss-120b widths, 64k rows over 128 experts: SwiGLU forward 0.47 -> 0.43 ms at 32 x 256,
# backward 0.75 ms at 16 x 128, its bias sums kept per row slot until the end)
_SWIGLU_TILE = (32, 256, 8)
_SWIGLU_BWD_TILE = (16, 128, 4)
_BIAS_TILE = (64, 128, 4)
# The routing sort's one-program path: slots at most, and the [experts, slots] tile its bounds count over
_SMALL_SORT_SLOTS = 4096
_SMALL_SORT_TILE = 32768


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cols(width: int, cap: int) -> int:
    return min(cap, _pow2(width))


def _k_pad(k: int) -> int:
    return max(2, _pow2(k))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels():
    """The Triton kernels, imported on first use (TRITON_INTERPRET must be set before, on the CPU)."""
    return importlib.import_module("megatron_gptoss.ops.moe_kernels")


# ------------------------------------------------------------------------------------------------
# Routing sort
def sort_by_expert(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """indices [N, K] -> (slot_rows [N * K] int64, bounds int32 [E + 1], order [N * K] int64: the slot
    of each sorted row). Device work only: no host sync. On CUDA, up to `_SMALL_SORT_SLOTS` slots (decode
    steps) are sorted by one Triton program (`sort_small`); more by torch.sort and searchsorted."""
    if indices.is_cuda and indices.numel() <= _SMALL_SORT_SLOTS and triton_available():
        return sort_small(indices, num_experts)
    flat = indices.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    slot_rows = torch.empty_like(order)
    slot_rows[order] = torch.arange(order.numel(), device=order.device)
    edges = torch.arange(num_experts + 1, device=flat.device, dtype=experts.dtype)
    bounds = torch.searchsorted(experts, edges, out_int32=True)
    return slot_rows, bounds, order


def sort_small(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """`sort_by_expert` as one Triton program (a bitonic sort of distinct (expert, slot) keys, so stable;
    the same three tensors as the torch path's): at most `_SMALL_SORT_SLOTS` slots. CUDA, or the CPU under
    TRITON_INTERPRET=1."""
    flat = indices.reshape(-1).contiguous()
    n = flat.numel()
    if n > _SMALL_SORT_SLOTS:
        raise ValueError(f"sort_small sorts at most {_SMALL_SORT_SLOTS} slots, got {n}")
    slot_rows = torch.empty(n, dtype=torch.int64, device=flat.device)
    order = torch.empty_like(slot_rows)
    bounds = torch.empty(num_experts + 1, dtype=torch.int32, device=flat.device)
    block_n = max(16, _pow2(n))
    block_e = max(1, min(_pow2(num_experts + 1), _SMALL_SORT_TILE // block_n))
    _kernels().sort_small_kernel[(1,)](
        flat, slot_rows, order, bounds, n, num_experts, BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1,
        BLOCK_E=block_e, num_warps=8,
    )  # fmt: skip
    return slot_rows, bounds, order


def expert_of_rows(bounds: Tensor, rows: int) -> Tensor:
    """Expert id [rows] int64 of each sorted row (the references' per-row bias gather)."""
    counts = (bounds[1:] - bounds[:-1]).long()
    return torch.repeat_interleave(
        torch.arange(counts.numel(), device=bounds.device), counts, output_size=rows
    )


# ------------------------------------------------------------------------------------------------
# References (PyTorch, the contracts above; computed in fp32, float64 for float64 inputs)
def permute_reference(x: Tensor, slot_rows: Tensor, k: int) -> Tensor:
    out = x.new_empty(slot_rows.numel(), x.shape[1])
    out[slot_rows] = x.repeat_interleave(k, dim=0)
    return out


def unpermute_reference(rows: Tensor, probs: Tensor, slot_rows: Tensor) -> Tensor:
    n, k = probs.shape
    picked = rows[slot_rows].float().view(n, k, -1)
    return (picked * probs.float()[..., None]).sum(1).to(rows.dtype)


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32, or float64 for float64 inputs (the references' compute dtype)."""
    return torch.promote_types(t.dtype, torch.float32)


def swiglu_reference(h: Tensor, bias: Tensor | None, bounds: Tensor, limit: float, alpha: float) -> Tensor:
    hf = h.to(_acc_dtype(h))
    if bias is not None:
        hf = hf + bias.to(hf.dtype)[expert_of_rows(bounds, h.shape[0])]
    gate, up = hf.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(h.dtype)


def expert_bias_reference(y: Tensor, bias: Tensor, bounds: Tensor) -> Tensor:
    yf = y.to(_acc_dtype(y))
    return (yf + bias.to(yf.dtype)[expert_of_rows(bounds, y.shape[0])]).to(y.dtype)


# ------------------------------------------------------------------------------------------------
# Autograd functions
def _rows_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_rows, k):
        x = _rows_contiguous(x)
        n, width = x.shape
        out = x.new_empty(n * k, width)
        block = _cols(width, _TOKEN_BLOCK)
        if n:
            _kernels().permute_fwd_kernel[(n, _cdiv(width, block))](
                x, out, slot_rows, width, x.stride(0), out.stride(0), K=k, K_PAD=_k_pad(k), BLOCK=block
            )
        ctx.save_for_backward(slot_rows)
        ctx.k, ctx.n = k, n
        return out

    @staticmethod
    def backward(ctx, grad):
        (slot_rows,) = ctx.saved_tensors
        grad = _rows_contiguous(grad)
        width = grad.shape[1]
        grad_x = grad.new_empty(ctx.n, width)
        block = _cols(width, _TOKEN_BLOCK)
        if ctx.n:
            _kernels().permute_bwd_kernel[(ctx.n, _cdiv(width, block))](
                grad, grad_x, slot_rows, width, grad.stride(0), grad_x.stride(0),
                K=ctx.k, K_PAD=_k_pad(ctx.k), BLOCK=block,
            )  # fmt: skip
        return grad_x, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, slot_rows):
        rows, probs = _rows_contiguous(rows), probs.contiguous()
        n, k = probs.shape
        width = rows.shape[1]
        out = rows.new_empty(n, width)
        block = _cols(width, _TOKEN_BLOCK)
        if n:
            _kernels().unpermute_fwd_kernel[(n, _cdiv(width, block))](
                rows, probs, out, slot_rows, width, rows.stride(0), out.stride(0),
                K=k, K_PAD=_k_pad(k), BLOCK=block,
            )  # fmt: skip
        ctx.save_for_backward(rows, probs, slot_rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, probs, slot_rows = ctx.saved_tensors
        grad = _rows_contiguous(grad)
        n, k = probs.shape
        width = rows.shape[1]
        grad_rows = torch.empty_like(rows)
        grad_probs = torch.empty(n, k, dtype=torch.float32, device=probs.device)
        if n:
            _kernels().unpermute_bwd_kernel[(n,)](
                grad, rows, probs, grad_rows, grad_probs, slot_rows, width,
                grad.stride(0), rows.stride(0), grad_rows.stride(0),
                K=k, K_PAD=_k_pad(k), BLOCK=_cols(width, _UNPERMUTE_BWD_BLOCK),
            )  # fmt: skip
        return grad_rows, grad_probs.to(probs.dtype), None


def _expert_grid(bounds: Tensor, width: int, block: int) -> tuple[int, int]:
    return bounds.numel() - 1, _cdiv(width, block)


class _SwigluBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, bounds, limit, alpha):
        h = _rows_contiguous(h)
        inter = h.shape[1] // 2
        out = h.new_empty(h.shape[0], inter)
        rows, cols, warps = _SWIGLU_TILE
        block = _cols(inter, cols)
        has_bias = bias is not None
        _kernels().swiglu_fwd_kernel[_expert_grid(bounds, inter, block)](
            h, bias if has_bias else h, out, bounds, inter, h.stride(0), out.stride(0),
            bias.stride(0) if has_bias else 0, limit, alpha,
            HAS_BIAS=has_bias, BLOCK_M=rows, BLOCK_I=block, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(h, bias, bounds)
        ctx.args = (limit, alpha)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, bias, bounds = ctx.saved_tensors
        limit, alpha = ctx.args
        grad = _rows_contiguous(grad)
        inter = h.shape[1] // 2
        grad_h = torch.empty_like(h)
        has_bias = bias is not None
        grad_bias = torch.empty(bias.shape, dtype=torch.float32, device=h.device) if has_bias else grad_h
        rows, cols, warps = _SWIGLU_BWD_TILE
        block = _cols(inter, cols)
        _kernels().swiglu_bwd_kernel[_expert_grid(bounds, inter, block)](
            h, bias if has_bias else h, grad, grad_h, grad_bias, bounds, inter,
            h.stride(0), grad.stride(0), grad_h.stride(0), bias.stride(0) if has_bias else 0, limit, alpha,
            HAS_BIAS=has_bias, BLOCK_M=rows, BLOCK_I=block, num_warps=warps,
        )  # fmt: skip
        return grad_h, grad_bias.to(bias.dtype) if has_bias else None, None, None, None


def _expert_row_sum(g: Tensor, bounds: Tensor, dtype: torch.dtype) -> Tensor:
    width = g.shape[1]
    out = torch.empty(bounds.numel() - 1, width, dtype=torch.float32, device=g.device)
    rows, cols, warps = _BIAS_TILE
    block = _cols(width, cols)
    _kernels().expert_row_sum_kernel[_expert_grid(bounds, width, block)](
        g, out, bounds, width, g.stride(0), BLOCK_M=rows, BLOCK_C=block, num_warps=warps
    )
    return out.to(dtype)


class _ExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, bounds):
        y = _rows_contiguous(y)
        width = y.shape[1]
        out = torch.empty_like(y)
        rows, cols, warps = _BIAS_TILE
        block = _cols(width, cols)
        _kernels().expert_bias_fwd_kernel[_expert_grid(bounds, width, block)](
            y, bias, out, bounds, width, y.stride(0), out.stride(0), bias.stride(0),
            BLOCK_M=rows, BLOCK_C=block, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(bounds)
        ctx.bias_dtype = bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (bounds,) = ctx.saved_tensors
        grad = _rows_contiguous(grad)
        grad_bias = _expert_row_sum(grad, bounds, ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return grad, grad_bias, None


# ------------------------------------------------------------------------------------------------
# Public API
def permute(x: Tensor, slot_rows: Tensor, k: int) -> Tensor:
    """x [N, H] -> expert-sorted rows [N * K, H] (module doc); differentiable in x."""
    return _Permute.apply(x, slot_rows, k)


def unpermute(rows: Tensor, probs: Tensor, slot_rows: Tensor) -> Tensor:
    """Expert-sorted rows [N * K, H] weighted by probs [N, K] (fp32) and summed per token -> [N, H] in
    rows' dtype; differentiable in rows and probs."""
    return _Unpermute.apply(rows, probs, slot_rows)


def swiglu_bias(h: Tensor, bias: Tensor | None, bounds: Tensor, limit: float, alpha: float) -> Tensor:
    """h [M, 2I] ([gate; up]) of expert-sorted rows, bias [E, 2I] -> (up + 1) * gate * sigmoid(alpha
    gate) with gate = min(g, limit), up = clamp(u, -limit, limit) of g, u = h + bias[e] -> [M, I]."""
    return _SwigluBias.apply(h, bias, bounds, float(limit), float(alpha))


def expert_bias(y: Tensor, bias: Tensor, bounds: Tensor) -> Tensor:
    """y [M, C] of expert-sorted rows plus bias[e] [E, C] of each row's expert."""
    return _ExpertBias.apply(y, bias, bounds)
