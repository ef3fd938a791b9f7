"""Weight sync of a LoRA learner: the bridge sends each adapted weight merged, W + scale * B A, and no
adapter tensor, so the engine (built without adapters) runs the trained policy. Compared with the export
of a plain model holding the float64-merged weights, from one process and from tp2 / ep2 / pp2 layouts."""

import dataclasses

import pytest
import torch
from helpers.bridge_layouts import export_layout

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.model import build_model
from megatron_gptoss.model.lora import base_config

CONFIG = gpt_oss_tiny(lora=LoRAConfig(rank=2, alpha=3.0, targets=list(LORA_TARGETS)))
BUCKET = 32 * 1024


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def learner():
    model = build_model(CONFIG, seed=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))  # B non-zero: the merge matters
    return model


@pytest.fixture(scope="module")
def merged_export(learner):
    """The export of a model without adapters whose weights are W + scale * B A (float64)."""
    plain = build_model(base_config(CONFIG))
    params = dict(learner.named_parameters())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            w = params[name].double()
            prefix = name.removesuffix(".weight") + ".lora"
            if name.endswith(".weight") and f"{prefix}.a" in params:
                w = w + CONFIG.lora.scale * params[f"{prefix}.b"].double() @ params[f"{prefix}.a"].double()
            p.copy_(w)
    return dict(WeightExporter([plain], plain.config, None, EngineLayout(), BUCKET).pairs())


def check(pairs, reference) -> float:
    names = [n for n, _ in pairs]
    assert sorted(names) == sorted(reference) and not any("lora" in n for n in names)
    return max(rel_err(t, reference[n]) for n, t in pairs)


def test_single_process_sync_sends_merged_weights(learner, merged_export):
    pairs = list(WeightExporter([learner], CONFIG, None, EngineLayout(), BUCKET).pairs())
    assert check(pairs, merged_export) < 1e-6
    kinds = ("q_proj.weight", "o_proj.weight", "gate_up_proj", "down_proj", "router.weight")
    adapted = [n for n in merged_export if n.endswith(kinds)]
    # scale 0 exports the base weights alone: the adapters moved every adapted tensor
    plain = dict(WeightExporter([learner], base_config(CONFIG), None, EngineLayout(), BUCKET).pairs())
    assert adapted and all(rel_err(plain[n], merged_export[n]) > 1e-3 for n in adapted)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_layout_sync_sends_merged_weights(learner, merged_export, layout):
    pairs = export_layout(layout, CONFIG, learner, EngineLayout(), BUCKET)
    assert check(pairs, merged_export) < 1e-6


def test_the_engine_config_has_no_adapters():
    assert not base_config(CONFIG).lora.enabled
    assert dataclasses.replace(base_config(CONFIG), lora=CONFIG.lora) == CONFIG
