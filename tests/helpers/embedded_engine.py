"""Shared set-up of the embedded-engine tests: a tiny learner with non-trivial weights, and an engine fed its
weights through the HF-named stream (as the bridge feeds it)."""

import torch

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model
from megatron_gptoss.rollout import EmbeddedEngine

CONFIG = gpt_oss_tiny()  # window 8, sliding / full layers


def perturbed_learner(seed: int):
    """The tiny model of `seed` with every parameter moved by 0.05 N(0, 1) (noise seeded by seed + 1)."""
    model = build_model(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def engine_of(learner, **options) -> EmbeddedEngine:
    """An fp32 engine of CONFIG with `options` (EmbeddedEngineConfig fields), holding `learner`'s weights."""
    engine = EmbeddedEngine(CONFIG, seed=0, options=EmbeddedEngineConfig(**options))
    engine.update_weights(iter_hf_tensors(learner, CONFIG))
    return engine
