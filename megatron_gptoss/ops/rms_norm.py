"""RMSNorm as one Triton kernel forward and one backward, with its PyTorch reference.

    y = (weight * x * rsqrt(mean(x^2) + eps)) in fp32, rounded once to x's dtype     x [..., H], weight [H]

The forward keeps rstd [rows] fp32 for the backward. Backward per row, xhat = x * rstd:
    dx = rstd * (weight * dy - xhat * mean(xhat * weight * dy)),   dweight = sum_rows dy * xhat
dweight is summed per program over a fixed set of rows, then over programs in a fixed order (no
atomics): bitwise repeatable. On the CPU the kernels run under TRITON_INTERPRET=1.
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
        block = _block(width)
        if rows:
            _kernels().rms_norm_fwd_kernel[(rows,)](
                x2, weight, out, rstd, width, x2.stride(0), out.stride(0), eps,
                BLOCK=block, num_warps=8 if block >= 2048 else 4,
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        shape = grad.shape
        g2 = grad.reshape(-1, shape[-1])
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        rows, width = x2.shape
        grad_x = torch.empty_like(x2)
        programs = max(1, min(_PROGRAMS, rows))
        partial = torch.empty((programs, width), dtype=torch.float32, device=x2.device)
        block = _block(width)
        if rows:
            _kernels().rms_norm_bwd_kernel[(programs,)](
                x2, weight, g2, rstd, grad_x, partial, rows, width,
                x2.stride(0), g2.stride(0), grad_x.stride(0), -(-rows // programs),
                BLOCK=block, num_warps=8 if block >= 2048 else 4,
            )  # fmt: skip
            grad_w = partial.sum(0)
        else:
            grad_w = torch.zeros(width, dtype=torch.float32, device=x2.device)
        return grad_x.view(shape), grad_w.to(weight.dtype), None


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., H] with weight [H] (module doc); differentiable in x and weight."""
    return _RMSNorm.apply(x, weight, float(eps))
