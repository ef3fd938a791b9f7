"""MXFP4 experts on a CUDA GPU in bf16: the engine's decode path (`fc1_swiglu_mxfp4` + `grouped_linear_mxfp4`
inside `moe_decode.decode_scope`) captured in a CUDA graph replays what it computes eagerly, bit for bit, and
agrees with the learner's fused path on the same rows; LoRA over the 4-bit base (fused path, bf16) is as
close to the float64 reference over the dequantized base as the eager loop path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.hf import quantize_mxfp4
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.moe import MoE
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.ops import moe_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LORA = LoRAConfig(rank=8, alpha=16.0, targets=list(LORA_TARGETS))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


@torch.no_grad()
def _fill(model: torch.nn.Module, seed: int) -> None:
    """Random parameters (0.05 std, biases too) and MXFP4 experts quantized from random float weights."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    for weight in mxfp4_weights(model).values():
        weight.copy_packed_(*quantize_mxfp4(0.05 * torch.randn(weight.shape, generator=gen)))


def test_decode_path_replays_in_a_cuda_graph_and_matches_the_fused_path():
    config = gpt_oss_tiny(hidden_size=256, intermediate_size=256, num_experts=8, expert_format="mxfp4")
    moe = MoE(config)
    _fill(moe, 0)
    moe = moe.to("cuda", torch.bfloat16)
    experts = moe.experts
    x = torch.randn(48, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, probs, indices = moe.router(x)
        fused = experts(x, probs, indices)  # outside the decode scope: the learner's fused path
        with moe_decode.decode_scope():
            assert experts.decode_kernels(x)
            eager = experts(x, probs, indices)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                experts(x, probs, indices)  # warm-up (compiles the kernels) off the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = experts(x, probs, indices)
            graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert rel_err(eager, fused) <= 1e-2, rel_err(eager, fused)


def test_lora_over_mxfp4_in_bf16_is_as_close_to_float64_as_the_loop_path():
    config = gpt_oss_tiny(hidden_size=128, intermediate_size=128, lora=LORA, expert_format="mxfp4")
    cpu = GPTOSSModel(config)
    _fill(cpu, 1)
    reference = GPTOSSModel(dataclasses.replace(config, expert_format="bf16"), dtype=torch.float64)
    with torch.no_grad():
        weights = mxfp4_weights(cpu)
        for name, p in reference.named_parameters():
            p.copy_(
                weights[name].dequantize(torch.float64)
                if name in weights
                else dict(cpu.named_parameters())[name]
            )
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=gen)
    probe = torch.randn(4, 64, config.vocab_size, generator=gen)
    ref_logits = reference(ids)
    (ref_logits * probe.double()).sum().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if is_adapter_param(n)}
    errors = {}
    for backend in ("grouped_mm", "loop"):
        model = GPTOSSModel(dataclasses.replace(config, expert_backend=backend))
        model.load_state_dict(cpu.state_dict())
        model = model.to("cuda", torch.bfloat16)
        logits = model(ids.cuda())
        (logits.float() * probe.cuda()).sum().backward()
        errors[backend] = {"logits": rel_err(logits, ref_logits)}
        errors[backend].update(
            {n: rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters() if is_adapter_param(n)}
        )
    for name, err in errors["grouped_mm"].items():
        assert err <= 2 * errors["loop"][name] + 1e-3, (name, err, errors["loop"][name])
    print({k: max(v.values()) for k, v in errors.items()})
