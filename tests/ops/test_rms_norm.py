"""Fused RMSNorm (megatron_gptoss.ops.rms_norm) against its PyTorch reference, forward and backward:
fp32 on the CPU under the Triton interpreter (a width that is no power of two), bf16 on a CUDA GPU."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gptoss.ops.rms_norm import fused_rms_norm, rms_norm_reference


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def errors(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype).requires_grad_()
    grad = torch.randn(*shape, generator=g).to(device, dtype)
    out = fused_rms_norm(x, w, 1e-5)
    ref = rms_norm_reference(x, w, 1e-5)
    ours = torch.autograd.grad(out, (x, w), grad)
    theirs = torch.autograd.grad(ref, (x, w), grad)
    return [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(ours, theirs)], (out, ours, x, w, grad)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)
def test_rms_norm_matches_reference_fp32():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errs, _ = errors((2, 5, 24), torch.float32, device)
    assert max(errs) <= 1e-6, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rms_norm_bf16_gpu():
    errs, (_, grads, x, w, grad) = errors((4096, 2880), torch.bfloat16, "cuda")
    assert max(errs) <= 5e-3, errs
    again = torch.autograd.grad(fused_rms_norm(x, w, 1e-5), (x, w), grad)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
