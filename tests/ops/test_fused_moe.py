"""Fused MoE kernels (megatron_gptoss.ops.fused_moe) against their PyTorch references, forward and
backward: fp32 on the CPU under the Triton interpreter (tiny shapes; partial column blocks, experts
without tokens), bf16 on a CUDA GPU (`gpu`). Errors per tensor are ||ours - ref|| / ||ref||."""

from __future__ import annotations

import pytest
import torch
from helpers.triton_cpu import needs_triton

from megatron_gptoss.ops import fused_moe

LIMIT, ALPHA = 7.0, 1.702


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def routing(tokens: int, k: int, experts: int, seed: int, device="cpu"):
    """Distinct top-k experts per token; the last expert never chosen (an empty segment)."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])
    probs = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return indices.to(device), probs.to(device)


def compare(fn, ref, inputs, grads_of):
    """(output error, [gradient errors]) of fn against ref on the same inputs and output gradient."""
    out, expected = fn(*inputs), ref(*inputs)
    grad = torch.randn_like(expected)
    leaves = [inputs[i] for i in grads_of]
    ours = torch.autograd.grad(out, leaves, grad)
    theirs = torch.autograd.grad(expected, leaves, grad)
    return rel_err(out, expected), [rel_err(a, b) for a, b in zip(ours, theirs)]


def cases(device, dtype, tokens, k, experts, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed + 1)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype).requires_grad_()

    indices, probs = routing(tokens, k, experts, seed, device)
    slot_rows, bounds, _ = fused_moe.sort_by_expert(indices, experts)
    rows = tokens * k
    x, y = rand(tokens, hidden), rand(rows, hidden)
    probs = probs.float().requires_grad_()
    h, b1, b2 = rand(rows, 2 * inter, scale=4.0), rand(experts, 2 * inter), rand(experts, hidden)
    return {
        "permute": (fused_moe.permute, fused_moe.permute_reference, (x, slot_rows, k), [0]),
        "unpermute": (fused_moe.unpermute, fused_moe.unpermute_reference, (y, probs, slot_rows), [0, 1]),
        "swiglu_bias": (
            lambda *a: fused_moe.swiglu_bias(*a, LIMIT, ALPHA),
            lambda *a: fused_moe.swiglu_reference(*a, LIMIT, ALPHA),
            (h, b1, bounds),
            [0, 1],
        ),
        "swiglu": (
            lambda h, bo: fused_moe.swiglu_bias(h, None, bo, LIMIT, ALPHA),
            lambda h, bo: fused_moe.swiglu_reference(h, None, bo, LIMIT, ALPHA),
            (h, bounds),
            [0],
        ),
        "expert_bias": (fused_moe.expert_bias, fused_moe.expert_bias_reference, (y, b2, bounds), [0, 1]),
    }


def test_sort_by_expert():
    indices, _ = routing(9, 3, 6, seed=3)
    slot_rows, bounds, order = fused_moe.sort_by_expert(indices, 6)
    flat = indices.reshape(-1)
    assert torch.equal(
        bounds.long(), torch.cat([torch.zeros(1, dtype=torch.long), flat.bincount(minlength=6).cumsum(0)])
    )
    assert torch.equal(order[slot_rows], torch.arange(flat.numel()))
    assert torch.equal(flat[order], flat.sort(stable=True).values)
    assert bounds.dtype == torch.int32 and bounds[-2] == bounds[-1]  # the last expert has no rows


@needs_triton
@pytest.mark.parametrize(
    "tokens,k,experts", [(9, 3, 6), (1, 1, 1), (256, 4, 32), (64, 4, 128), (1000, 4, 128), (300, 4, 32)]
)
def test_sort_small_equals_the_torch_sort(tokens, k, experts):
    """The one-program sort gives the torch path's three tensors exactly, its bounds counted in one
    chunk of edges or several (33 or 129 edges over 1024 to 4096 slots), with an expert never chosen (the
    last) and experts chosen by many slots; on fresh random routings (repeats within a token included)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    indices = torch.randint(0, max(experts - 1, 1), (tokens, k), generator=g)
    indices[: tokens // 3] = indices[: tokens // 3] % 3  # a few experts take most slots
    want = fused_moe.sort_by_expert(indices, experts)  # CPU: torch.sort
    got = fused_moe.sort_small(indices.to(device), experts)
    for name, ours, ref in zip(("slot_rows", "bounds", "order"), got, want, strict=True):
        assert ours.dtype == ref.dtype, name
        assert torch.equal(ours.cpu(), ref), name


def test_sort_small_refuses_too_many_slots():
    with pytest.raises(ValueError, match="at most 4096 slots"):
        fused_moe.sort_small(torch.zeros(1025, 4, dtype=torch.long), 8)


@needs_triton
@pytest.mark.parametrize("k,hidden,inter", [(3, 40, 24), (1, 16, 8)])
def test_kernels_match_reference_fp32(k, hidden, inter):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, (fn, ref, inputs, grads_of) in cases(device, torch.float32, 7, k, 5, hidden, inter).items():
        out_err, grad_errs = compare(fn, ref, inputs, grads_of)
        assert out_err <= 1e-6 and max(grad_errs) <= 1e-6, (name, out_err, grad_errs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_match_reference_bf16_gpu():
    """gpt-oss widths: errors against the fp32-computing references within bf16 rounding; bitwise
    repeatable gradients."""
    for name, (fn, ref, inputs, grads_of) in cases("cuda", torch.bfloat16, 1000, 4, 16, 2880, 2880).items():
        out_err, grad_errs = compare(fn, ref, inputs, grads_of)
        assert out_err <= 8e-3 and max(grad_errs) <= 8e-3, (name, out_err, grad_errs)
        out = fn(*inputs)
        grad = torch.randn_like(out)
        leaves = [inputs[i] for i in grads_of]
        first = torch.autograd.grad(fn(*inputs), leaves, grad)
        second = torch.autograd.grad(fn(*inputs), leaves, grad)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), name
