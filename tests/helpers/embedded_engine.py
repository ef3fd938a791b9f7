"""Shared set-up of the embedded-engine tests: a tiny learner with non-trivial weights, and an engine fed its
weights through the HF-named stream (as the bridge feeds it)."""

import torch

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model
from megatron_gptoss.model.kv_cache import KVCache
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


@torch.no_grad()
def kept_prefix_logprobs(old, new, tokens: list[int], switch: int) -> list[float]:
    """Log-probs of tokens[1:] as a row continued over a kept cache: positions < switch computed by `old`
    into a contiguous cache, the rest by `new` over it (partial rollouts' `keep`)."""
    cache = KVCache(CONFIG, 1, len(tokens), torch.float32, "cpu")
    ids, positions = torch.tensor([tokens[:-1]]), torch.arange(len(tokens) - 1)[None]
    first = old.hidden_states(ids[:, :switch], position_ids=positions[:, :switch], cache=cache)
    rest = new.hidden_states(ids[:, switch:], position_ids=positions[:, switch:], cache=cache)
    head = torch.cat([old.token_logprobs(first, torch.tensor([tokens[1 : switch + 1]]))[0],
                      new.token_logprobs(rest, torch.tensor([tokens[switch + 1 :]]))[0]], dim=1)  # fmt: skip
    return head[0].tolist()


def spy_on_steps_ahead(monkeypatch) -> tuple[list, list]:
    """Lists that fill as the engine runs: each plan taken ahead (`_take_ahead`, None where none held) and
    each step launched ahead (`_launch_ahead`, None where none could be)."""
    taken: list = []
    launched: list = []
    take, launch = EmbeddedEngine._take_ahead, EmbeddedEngine._launch_ahead

    def taking(self):
        taken.append(take(self))
        return taken[-1]

    def launching(self, *args):
        launched.append(launch(self, *args))
        return launched[-1]

    monkeypatch.setattr(EmbeddedEngine, "_take_ahead", taking)
    monkeypatch.setattr(EmbeddedEngine, "_launch_ahead", launching)
    return taken, launched
