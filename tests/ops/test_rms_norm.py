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


def add_norm_errors(shape, dtype, device, seed=3):
    """fused_add_rms_norm against x + r then the reference norm: outputs, and the gradients of x, r, w for a
    loss that reads both the sum and its norm."""
    from megatron_gptoss.ops.rms_norm import fused_add_rms_norm

    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype).requires_grad_()
    g_total, g_out = (torch.randn(*shape, generator=g).to(device, dtype) for _ in range(2))
    total, out = fused_add_rms_norm(x, r, w, 1e-5)
    ref_total = x + r
    ref_out = rms_norm_reference(ref_total, w, 1e-5)
    ours = torch.autograd.grad((total, out), (x, r, w), (g_total, g_out))
    theirs = torch.autograd.grad((ref_total, ref_out), (x, r, w), (g_total, g_out))
    assert torch.equal(total, ref_total)  # the sum is PyTorch's add, bit for bit
    return [rel_err(out, ref_out)] + [rel_err(a, b) for a, b in zip(ours, theirs)]


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)
def test_add_rms_norm_matches_add_then_reference_fp32():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errs = add_norm_errors((3, 7, 40), torch.float32, device)
    assert max(errs) <= 1e-6, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_rms_norm_bf16_gpu():
    errs = add_norm_errors((4, 512, 2880), torch.bfloat16, "cuda")
    assert max(errs) <= 1e-2, errs
