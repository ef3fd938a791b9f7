"""RMSNorm computed in fp32 (weight applied in fp32, result cast back), as in GPT-OSS. On CUDA (with
Triton) one fused kernel forward and one backward (`megatron_gptoss.ops.rms_norm`); eager elsewhere."""

from __future__ import annotations

import torch

from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.ops.fused_moe import triton_available
from megatron_gptoss.ops.rms_norm import fused_rms_norm, rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (x.is_cuda and triton_available()) or batch_invariant.active():  # the kernel: one program per row
        return fused_rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
