"""The MoE block's fused backend (`grouped_mm`: device-side routing sort, fused Triton kernels) against
the eager reference (`loop`) on the same weights and tokens: output and every gradient, fp32 on the CPU
under the Triton interpreter, bf16 on a CUDA GPU (`gpu`; the same routing, the eager block rounding its
intermediates to bf16 where the fused one rounds once)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.triton_cpu import interpreted

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.model.moe import MoE


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def moe_pair(config, dtype, device, seed=0):
    """Two MoE blocks with the same random weights (biases included): fused and eager."""
    blocks = {}
    for backend in ("grouped_mm", "loop"):
        cfg = dataclasses.replace(config, expert_backend=backend)
        torch.manual_seed(seed)
        block = MoE(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.3 * torch.randn(p.shape))
        blocks[backend] = block.to(device, dtype)
    return blocks["grouped_mm"], blocks["loop"]


def run(block, x, grad):
    x = x.detach().clone().requires_grad_()
    out = block(x)
    out.backward(grad.to(out.dtype))
    grads = {name: p.grad for name, p in block.named_parameters()}
    return out, x.grad, grads


def errors(fused, ref, x, grad):
    out, gx, grads = run(fused, x, grad)
    ref_out, ref_gx, ref_grads = run(ref, x, grad)
    result = {"out": rel_err(out, ref_out), "x": rel_err(gx, ref_gx)}
    result.update({name: rel_err(g, ref_grads[name]) for name, g in grads.items()})
    return result


@interpreted  # CPU tensors
def test_fused_backend_equals_eager_fp32():
    config = gpt_oss_tiny()
    fused, ref = moe_pair(config, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, config.hidden_size, generator=g)
    worst = errors(fused, ref, x, torch.randn(x.shape, generator=g))
    assert max(worst.values()) <= 1e-5, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_backend_bf16_near_fp32_gpu():
    """gpt-oss-120b widths, 2048 tokens, bf16: fused against eager (both in bf16, so both route alike)."""
    config = gpt_oss_tiny(hidden_size=2880, intermediate_size=2880, num_experts=128, moe_router_topk=4)
    fused, ref = moe_pair(config, torch.bfloat16, "cuda")
    with torch.no_grad():
        for block in (fused, ref):
            block.experts.linear_fc1.weight.mul_(0.05)
            block.experts.linear_fc2.weight.mul_(0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, config.hidden_size, generator=g).cuda().bfloat16()
    worst = errors(fused, ref, x, torch.randn(x.shape, generator=g).cuda())
    assert max(worst.values()) <= 2e-2, worst
