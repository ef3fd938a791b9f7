"""The engine's fused rotary embedding (`ops.fused_rope.rotary_qkv`) is bitwise equal to the PyTorch path
(`Attention.split_qkv` then `apply_rotary`): fp32 on the CPU under the Triton interpreter, bf16 and fp32 on
a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.triton_cpu import needs_triton

from megatron_gptoss.config import gpt_oss_20b
from megatron_gptoss.model.rope import RotaryEmbedding, apply_rotary
from megatron_gptoss.ops.fused_rope import rotary_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(qkv, cos, sin, groups, r, d):
    lead = qkv.shape[:-1]
    grouped = qkv.view(*lead, groups, r + 2, d)
    q = grouped[..., :r, :].reshape(*lead, groups * r, d)
    k, v = grouped[..., r, :], grouped[..., r + 1, :]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("groups,r,d,tokens", [(2, 4, 16, 7), (8, 8, 64, 5), (1, 1, 8, 1), (3, 2, 32, 130)])
def test_rotary_qkv_is_bitwise_the_torch_path(dtype, groups, r, d, tokens):
    config = gpt_oss_20b(head_dim=d)
    rotary = RotaryEmbedding(config, DEVICE)
    positions = torch.randint(0, 100_000, (1, tokens), device=DEVICE)
    cos, sin = rotary(positions, dtype)
    qkv = torch.randn(1, tokens, groups * (r + 2) * d, device=DEVICE).mul(4).to(dtype)
    ours = rotary_qkv(qkv, cos, sin, groups, r, d)
    for name, a, b in zip("qkv", ours, reference(qkv, cos, sin, groups, r, d), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
def test_rotary_qkv_writes_the_cache_slots(dtype):
    """With `kv_cache`, each token's rotated key and its value land in its slot of the pools (the paged
    cache's index_copy_ of the PyTorch path), the other slots untouched; q, k, v as without it."""
    groups, r, d, tokens, pool_slots = 3, 2, 16, 9, 40
    rotary = RotaryEmbedding(gpt_oss_20b(head_dim=d), DEVICE)
    cos, sin = rotary(torch.randint(0, 5000, (1, tokens), device=DEVICE), dtype)
    qkv = torch.randn(1, tokens, groups * (r + 2) * d, device=DEVICE).mul(4).to(dtype)
    slots = torch.randperm(pool_slots, device=DEVICE)[:tokens]
    k_pool = torch.full((pool_slots, groups, d), 7.0, device=DEVICE, dtype=dtype)
    v_pool = k_pool.clone()
    q, k, v = rotary_qkv(qkv, cos, sin, groups, r, d, kv_cache=(k_pool, v_pool, slots))
    ref_q, ref_k, ref_v = reference(qkv, cos, sin, groups, r, d)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, ref_v)
    want_k = torch.full_like(k_pool, 7.0).index_copy_(0, slots, ref_k.reshape(tokens, groups, d))
    want_v = torch.full_like(v_pool, 7.0).index_copy_(0, slots, ref_v.reshape(tokens, groups, d))
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(ValueError, match="slots must be"):
        rotary_qkv(qkv, cos, sin, groups, r, d, kv_cache=(k_pool, v_pool, slots[:-1]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("groups,r,d,tokens", [(2, 4, 16, 7), (8, 8, 64, 33)])
def test_rotary_qkv_backward_matches_autograd_of_the_torch_path(dtype, groups, r, d, tokens):
    """Where autograd records: the same forward bits, and the QKV gradient (queries, keys and the value's
    view together) within rounding of autograd through `apply_rotary` (fp32: 1e-6; bf16, whose every
    PyTorch op rounds: 1e-2), on fresh random inputs and output gradients."""
    rotary = RotaryEmbedding(gpt_oss_20b(head_dim=d), DEVICE)
    cos, sin = rotary(torch.randint(0, 100_000, (1, tokens), device=DEVICE), dtype)
    qkv = torch.randn(1, tokens, groups * (r + 2) * d, device=DEVICE).mul(4).to(dtype)
    ours_in, ref_in = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    ours = rotary_qkv(ours_in, cos, sin, groups, r, d)
    ref = reference(ref_in, cos, sin, groups, r, d)
    grads = [torch.randn_like(t) for t in ref]
    (ours_grad,) = torch.autograd.grad(ours, ours_in, grads)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, grads)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.detach(), b.detach())
    err = float((ours_grad.double() - ref_grad.double()).norm() / ref_grad.double().norm())
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match=r"G \* \(R \+ 2\) \* D"):
        rotary_qkv(torch.zeros(1, 3, 100), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), 2, 4, 16)
    with pytest.raises(ValueError, match="activations' dtype"):
        qkv = torch.zeros(1, 3, 2 * 6 * 16)
        rotary_qkv(qkv, torch.zeros(1, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 3, 8), 2, 4, 16)
