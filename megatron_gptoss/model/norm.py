"""RMSNorm computed in fp32 (weight applied in fp32, result cast back), as in GPT-OSS. On CUDA (with
Triton) one fused kernel forward and one backward (`megatron_gptoss.ops.rms_norm`); eager elsewhere."""

from __future__ import annotations

import torch

from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.ops.fused_moe import triton_available
from megatron_gptoss.ops.rms_norm import fused_add_rms_norm, fused_rms_norm, rms_norm_reference


def _kernel(x: torch.Tensor) -> bool:
    return (x.is_cuda and triton_available()) or batch_invariant.active()  # one program per row


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _kernel(x):
        return fused_rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it): one kernel forward and one backward where `rms_norm` runs the kernel
    (the sum bitwise PyTorch's add, the norm bitwise `rms_norm` of it)."""
    if _kernel(x):
        return fused_add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return total, rms_norm_reference(total, weight, eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it) (`add_rms_norm`)."""
        return add_rms_norm(x, residual, self.weight, self.eps)
