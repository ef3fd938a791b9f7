"""Rollout engines behind one protocol: the embedded engine (our model + KV cache) and vLLM."""

from megatron_gptoss.rollout.base import Generation, RolloutEngine, SamplingParams, sample_from_logits
from megatron_gptoss.rollout.embedded import EmbeddedEngine

__all__ = ["EmbeddedEngine", "Generation", "RolloutEngine", "SamplingParams", "sample_from_logits"]
