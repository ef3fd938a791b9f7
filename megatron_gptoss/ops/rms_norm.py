"""RMSNorm as one Triton kernel forward and one backward, with its PyTorch reference.

    y = (weight * x * rsqrt(mean(x^2) + eps)) in fp32, rounded once to x's dtype     x [..., H], weight [H]

The forward keeps rstd [rows] fp32 for the backward. Backward per row, xhat = x * rstd:
    dx = rstd * (weight * dy - xhat * mean(xhat * weight * dy)),   dweight = sum_rows dy * xhat
dweight is summed per program over a fixed set of rows, then over programs in a fixed order (no
atomics): bitwise repeatable. On the CPU the kernels run under TRITON_INTERPRET=1.

    fused_add_rms_norm(x, residual, weight, eps) -> (x + residual, RMSNorm of it)

adds first (rounded to x's dtype as PyTorch's add rounds: the sum is bitwise `x + residual`) in the same
launch; its backward adds the gradient reaching the sum from its other uses into dx before dx's one
rounding, and returns that one tensor for x and residual alike (no separate add of the two gradients).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

_PROGRAMS = 512  # backward programs (rows are split among them; each keeps a dweight partial)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def _kernels():
    return importlib.import_module("megatron_gptoss.ops.rms_norm_kernels")


def _block(width: int) -> int:
    return 1 << max(width - 1, 0).bit_length()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows, width = x2.shape
        out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _launch_forward(x2, None, None, weight, out, rstd, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = _launch_backward(x2, weight, rstd, grad, None)
        return grad_x.view(grad.shape), grad_w.to(weight.dtype), None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        shape = x.shape
        if residual.shape != shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(shape)} "
                             f"{x.dtype}")  # fmt: skip
        x2 = x.reshape(-1, shape[-1]).contiguous()
        r2 = residual.reshape(-1, shape[-1]).contiguous()
        rows, width = x2.shape
        total = torch.empty_like(x2)
        out = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _launch_forward(x2, r2, total, weight, out, rstd, eps)
        ctx.save_for_backward(total, weight, rstd)
        return total.view(shape), out.view(shape)

    @staticmethod
    def backward(ctx, grad_total, grad):
        total, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = _launch_backward(total, weight, rstd, grad, grad_total)
        grad_x = grad_x.view(grad.shape)
        return grad_x, grad_x, grad_w.to(weight.dtype), None


def _launch_forward(x2, residual, total, weight, out, rstd, eps) -> None:
    block = _block(x2.shape[1])
    add = residual is not None
    _kernels().rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, residual if add else x2, total if add else x2, weight, out, rstd, x2.shape[1], x2.stride(0),
        out.stride(0), eps, BLOCK=block, ADD=add, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip


def _launch_backward(x2, weight, rstd, grad, grad_total):
    """(dx [rows, H] in x2's dtype, dweight fp32 [H]); dx includes grad_total where given."""
    g2 = grad.reshape(-1, grad.shape[-1])
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    add = grad_total is not None
    gt = grad_total.reshape(-1, grad_total.shape[-1]).contiguous() if add else g2
    rows, width = x2.shape
    grad_x = torch.empty_like(x2)
    if not rows:
        return grad_x, torch.zeros(width, dtype=torch.float32, device=x2.device)
    programs = max(1, min(_PROGRAMS, rows))
    partial = torch.empty((programs, width), dtype=torch.float32, device=x2.device)
    block = _block(width)
    _kernels().rms_norm_bwd_kernel[(programs,)](
        x2, weight, g2, gt, rstd, grad_x, partial, rows, width, x2.stride(0), g2.stride(0), grad_x.stride(0),
        -(-rows // programs), BLOCK=block, ADD=add, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return grad_x, partial.sum(0)


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., H] with weight [H] (module doc); differentiable in x and weight."""
    return _RMSNorm.apply(x, weight, float(eps))


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, its RMSNorm) in one launch (module doc); differentiable in x, residual and weight."""
    return _AddRMSNorm.apply(x, residual, weight, float(eps))
