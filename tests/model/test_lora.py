"""LoRA in the model: forward and backward against a float64 reference that runs the base model on
W + scale * B A (built from the adapters with autograd, so the reference's adapter gradients come from the
formula); zero-initialised B leaves logits bitwise unchanged; only adapters receive gradients; the
adapters can be switched off in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.hf_reference import hf_twin
from helpers.triton_cpu import interpreted
from torch.func import functional_call

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.model import build_model
from megatron_gptoss.model.lora import adapters, adapters_disabled, is_adapter_param

VOCAB = 96


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def lora_config(backend: str = "loop", targets=LORA_TARGETS, rank: int = 3):
    return gpt_oss_tiny(expert_backend=backend, lora=LoRAConfig(rank=rank, alpha=5.0, targets=list(targets)))


def perturbed(config, seed: int = 0):
    """A model whose every parameter (B included) is moved off its initial value."""
    model = build_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def merged_reference(model, ids):
    """Logits of the base model (float64) on weights W + scale * B A, and d(loss)/d(A, B) through them."""
    cfg = model.config
    base = build_model(dataclasses.replace(cfg, lora=LoRAConfig()), dtype=torch.float64)
    params = {n: p.detach().double() for n, p in model.named_parameters() if not is_adapter_param(n)}
    leaves = {
        n: p.detach().double().requires_grad_() for n, p in model.named_parameters() if is_adapter_param(n)
    }
    scale = cfg.lora.scale
    for name in list(params):
        owner = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{owner}.lora.a" in leaves:
            a, b = leaves[f"{owner}.lora.a"], leaves[f"{owner}.lora.b"]
            params[name] = params[name] + scale * torch.matmul(b, a)
    logits = functional_call(base, params, (ids,))
    return logits, leaves


@pytest.mark.parametrize("backend", ["loop", pytest.param("grouped_mm", marks=interpreted)])
def test_forward_backward_equal_the_merged_float64_reference(backend):
    model = perturbed(lora_config(backend))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    weights = torch.randn(2, 13, VOCAB, generator=gen)
    logits = model(ids)
    (logits * weights).sum().backward()
    ref_logits, leaves = merged_reference(model, ids)
    (ref_logits * weights.double()).sum().backward()
    errs = {"logits": rel_err(logits, ref_logits)}
    grads = {n: p.grad for n, p in model.named_parameters() if is_adapter_param(n)}
    assert set(grads) == set(leaves) and len(grads) == 2 * len(LORA_TARGETS) * 2  # 5 targets, 2 layers
    for name, grad in grads.items():
        assert grad is not None, name
        errs[name] = rel_err(grad, leaves[name].grad)
    worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst
    # the adapters matter: the base alone is far from these logits
    with adapters_disabled(model), torch.no_grad():
        assert rel_err(model(ids), ref_logits) > 1e-2


def test_zero_initialised_b_leaves_logits_bitwise_unchanged():
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    base = build_model(gpt_oss_tiny(), seed=4)
    model = build_model(lora_config(), seed=4)
    assert all(bool(m.a.abs().sum() > 0) and not bool(m.b.any()) for m in adapters(model))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))


def test_only_adapters_train_and_disabling_them_gives_the_base():
    model = perturbed(lora_config(targets=["linear_qkv", "linear_fc1"]))
    base = build_model(gpt_oss_tiny(expert_backend="loop"))
    base.load_state_dict({n: p for n, p in model.state_dict().items() if not is_adapter_param(n)})
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    model(ids).square().mean().backward()
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            assert p.requires_grad and p.grad is not None and bool(p.grad.abs().sum() > 0), name
        else:
            assert not p.requires_grad and p.grad is None, name
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"decoder.layers.{i}.{m}.lora.{w}"
        for i in range(2)
        for w in "ab"
        for m in ("self_attention.linear_qkv", "mlp.experts.linear_fc1")
    }
    with torch.no_grad():
        with adapters_disabled(model):
            assert torch.equal(model(ids), base(ids))
        assert not torch.equal(model(ids), base(ids))  # restored on exit


def test_dropout_acts_in_training_only():
    config = gpt_oss_tiny(lora=LoRAConfig(rank=2, dropout=0.5))
    model = perturbed(config)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model.eval()
        first, second = model(ids), model(ids)
        model.train()
        torch.manual_seed(0)
        dropped = model(ids)
    assert torch.equal(first, second) and not torch.equal(first, dropped)


def test_hf_conversion_merges_the_adapters_and_transformers_gives_our_logits():
    """`iter_hf_tensors` (behind `save_hf`) writes W + scale * B A: transformers' GptOssForCausalLM on those
    tensors computes the logits of our model running its adapters."""
    model = perturbed(lora_config())
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ours, theirs = model(ids), hf_twin(model)(ids).logits
        with adapters_disabled(model):
            base = model(ids)
    assert rel_err(theirs, ours) < 1e-5 and rel_err(base, ours) > 1e-2
