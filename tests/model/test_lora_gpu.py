"""LoRA on a CUDA GPU in bf16: the fused expert path (`grouped_mm`: torch._grouped_mm and the fused Triton
kernels, the adapters in the same grouped GEMMs) against the float64 merged-weight reference; its error in
the logits and in every adapter gradient is at most 2x (plus 1e-3) the error of the eager `loop` path in
bf16 on the same GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_lora import VOCAB, lora_config, merged_reference, perturbed, rel_err

from megatron_gptoss.model.lora import is_adapter_param

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(model, ids, weights):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if is_adapter_param(n)}
    return logits.float().cpu(), grads


def test_fused_lora_bf16_is_as_close_to_float64_as_the_eager_path():
    cpu = perturbed(lora_config("loop"))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (4, 64), generator=gen)
    weights = torch.randn(4, 64, VOCAB, generator=gen)
    ref_logits, leaves = merged_reference(cpu, ids)
    (ref_logits * weights.double()).sum().backward()
    errors = {}
    for backend in ("grouped_mm", "loop"):
        config = dataclasses.replace(cpu.config, expert_backend=backend, attention_backend="triton")
        model = perturbed(config).to("cuda", torch.bfloat16)
        logits, grads = run(model, ids.cuda(), weights.cuda())
        errors[backend] = {"logits": rel_err(logits, ref_logits)}
        errors[backend].update({n: rel_err(g, leaves[n].grad) for n, g in grads.items()})
    for name, err in errors["grouped_mm"].items():
        assert err <= 2 * errors["loop"][name] + 1e-3, (name, err, errors["loop"][name])
    print({k: max(v.values()) for k, v in errors.items()})
