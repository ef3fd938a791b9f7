"""Shared pieces of the tests that feed a vLLM engine: the tiny GPT-OSS-shaped model vLLM's CPU kernels take,
a learner trained a few optimizer steps, learner log-probs of fixed token sequences, and deliberately wrong
exports (each must be caught by a log-prob mismatch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from helpers.reference_learner import MasterWeightAdamW
from megatron_gptoss.config import ModelConfig, OptimConfig, gpt_oss_tiny
from megatron_gptoss.model import GPTOSSModel, build_model

# vLLM's logprobs of the same weights must match the learner's this closely (float32 on both sides).
TOLERANCE = 1e-4

Pairs = Iterable[tuple[str, torch.Tensor]]


def vllm_tiny_config(**overrides) -> ModelConfig:
    """gpt_oss_tiny with head_dim 64 (vLLM's CPU attention rejects 16) and intermediate == hidden == 64 (as in
    GPT-OSS, so a transposed down_proj keeps its shape); 4 experts top-2, window 8, vocabulary 96."""
    return gpt_oss_tiny(
        head_dim=64, hidden_size=64, intermediate_size=64, attention_backend="eager", **overrides
    )


def seeded_learner(config: ModelConfig, seed: int = 0) -> GPTOSSModel:
    """A seeded model whose biases, sinks and norms are moved away from their 0 / 1 init."""
    model = build_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def train_steps(model: GPTOSSModel, steps: int = 2, seed: int = 0, lr: float = 1e-2) -> None:
    """`steps` AdamW steps of next-token cross-entropy on random tokens (every parameter moves)."""
    optim = MasterWeightAdamW(list(model.parameters()), OptimConfig(lr=lr, clip_grad=0.0), steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen)
        hidden = model.hidden_states(ids[:, :-1])
        logprobs, _ = model.token_logprobs(hidden, ids[:, 1:])
        (-logprobs.mean()).backward()
        optim.step()


def fixed_sequences(config: ModelConfig, count: int = 4, length: int = 24, seed: int = 5) -> list[list[int]]:
    """Random token sequences longer than the sliding window."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


@torch.no_grad()
def learner_sequence_logprobs(model: GPTOSSModel, sequences: list[list[int]]) -> list[list[float]]:
    """log p(token_t | tokens_<t), t >= 1, at temperature 1 (what `VLLMEngine.sequence_logprobs` returns)."""
    out = []
    for seq in sequences:
        ids = torch.tensor(seq)[None]
        logprobs, _ = model.token_logprobs(model.hidden_states(ids[:, :-1]), ids[:, 1:])
        out.append(logprobs[0].tolist())
    return out


def max_delta(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


# -------------------------------------------------------------------------------------------------
# Deliberately wrong exports: a correct stream in, the same names and shapes with a layout error out.
def _down_proj_transposed(pairs: Pairs) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in pairs:
        yield name, (t.transpose(1, 2).contiguous() if name.endswith("experts.down_proj") else t)


def _k_v_swapped(pairs: Pairs) -> Iterator[tuple[str, torch.Tensor]]:
    swap = {"k_proj": "v_proj", "v_proj": "k_proj"}
    for name, t in pairs:
        parts = name.split(".")
        if len(parts) > 1 and parts[-2] in swap:
            parts[-2] = swap[parts[-2]]
        yield ".".join(parts), t


def _gate_up_concatenated(pairs: Pairs) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in pairs:
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)  # [gate | up] instead of interleaved
        yield name, t


CORRUPTIONS: dict[str, Callable[[Pairs], Iterator[tuple[str, torch.Tensor]]]] = {
    "down_proj_transposed": _down_proj_transposed,
    "k_v_swapped": _k_v_swapped,
    "gate_up_concatenated": _gate_up_concatenated,
}


def layout_sync_delta(engine, layout: str, seed: int, bucket_bytes: int = 32 * 1024) -> tuple[float, float]:
    """Train a fresh learner (seed), export it from `layout` on gloo ranks, update `engine` with rank 0's
    stream; returns (max |delta| against the learner, max change of the engine's log-probs)."""
    from helpers.bridge_layouts import export_layout
    from megatron_gptoss.bridge.plan import EngineLayout

    config = engine.config
    model = seeded_learner(config, seed)
    train_steps(model, steps=2, seed=seed)
    seqs = fixed_sequences(config, seed=seed)
    before = engine.sequence_logprobs(seqs)
    target = EngineLayout(workers=engine.tensor_parallel_size, expert_slices=engine.accepts_expert_slices)
    engine.update_weights(export_layout(layout, config, model, target, bucket_bytes))
    after = engine.sequence_logprobs(seqs)
    return max_delta(after, learner_sequence_logprobs(model, seqs)), max_delta(after, before)
