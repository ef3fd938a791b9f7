"""A sampled softmax for supervised steps over a large vocabulary: the output layer scores only the step's
target tokens and `drawn` other rows, drawn uniformly without replacement from the rest of the vocabulary.
The drawn rows' logits carry + log(rest / drawn) (rest: the vocabulary rows that are not targets), so the
sampled normaliser estimates the full one: E[rest / drawn * sum_drawn exp(z)] = sum_rest exp(z).

    full softmax     log p_t = z_t - log sum_{v < V} exp(z_v)                       [rows, V] logits
    sampled softmax  log q_t = z_t - log (sum_{v in T} exp(z_v) + sum_{v in D} exp(z_v + log(rest / |D|)))
                     T: the step's target tokens, D: the drawn rows              [rows, |T| + |D|] logits

The loss and its gradient reach only the sampled rows; a row outside the sample keeps its weight that step.
This is for supervised training only (`sft.sampled_vocab`): every log-prob of RL, the learner's and the
engines', is over the full vocabulary (the module `logprobs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_gptoss.model.logprobs import token_logprobs


@dataclass(frozen=True)
class VocabSample:
    """The output-layer rows one step scores: `ids` [K] int64 ascending (the targets' and the drawn rows),
    `log_weight` [K] fp32 (0 on a target row, log(rest / drawn) on a drawn row), on the host."""

    ids: torch.Tensor
    log_weight: torch.Tensor


def draw_vocab_sample(
    targets: torch.Tensor, vocab_size: int, drawn: int, generator: torch.Generator
) -> VocabSample:
    """The sample of one step: every target token (`targets`, any shape; negative entries are positions
    nobody reads and are ignored) and min(`drawn`, rest) other rows of the vocabulary [0, vocab_size),
    drawn uniformly without replacement with `generator` (a host generator). ValueError on a target outside
    the vocabulary or `drawn` < 1."""
    if drawn < 1:
        raise ValueError(f"drawn={drawn}: a sampled softmax draws at least one row")
    kept = targets[targets >= 0].reshape(-1).cpu().unique()
    if kept.numel() and int(kept.max()) >= vocab_size:
        raise ValueError(f"target {int(kept.max())} outside the vocabulary [0, {vocab_size})")
    rest = vocab_size - kept.numel()
    count = min(drawn, rest)
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[kept] = False
    picked = outside.nonzero().squeeze(1)[torch.randperm(rest, generator=generator)[:count]]
    log_weight = torch.cat([torch.zeros(kept.numel()), torch.full((count,), math.log(rest / max(count, 1)))])
    ids, order = torch.cat([kept, picked]).sort()
    return VocabSample(ids, log_weight[order])


def sampled_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sample: VocabSample,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., H], weight [V, H] (the output layer's real rows), targets [...] int64 -> (log q [...],
    entropy of q [...]) fp32, q the sampled softmax of the module docstring at `temperature` (log_weight
    added after the division by it). A negative target is a position nobody reads: it reads 0. Every other
    target must be one of `sample.ids` (ValueError otherwise). Differentiable in hidden and weight; the
    weight's gradient is zero outside the sample's rows. Synchronises with the host (supervised steps
    only)."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but targets has {t.shape[0]}")
    ids = sample.ids.to(t.device)
    keep = t >= 0
    pos = torch.searchsorted(ids, t.clamp_min(0)).clamp_max_(ids.numel() - 1)
    if bool((ids[pos] != t)[keep].any()):
        raise ValueError("a target is not in the vocabulary sample (draw it from this step's targets)")
    # [W_sample, log_weight * T] against [h, 1]: the GEMM adds log_weight to the tempered logits
    bias = (sample.log_weight.to(weight.device) * temperature).to(weight.dtype)
    rows = torch.cat([weight.index_select(0, ids.to(weight.device)), bias[:, None]], 1)
    h1 = torch.cat([h[keep], h.new_ones(int(keep.sum()), 1)], 1)
    lp, ent = token_logprobs(
        h1, rows, pos[keep], temperature=temperature, chunk_size=chunk_size, with_entropy=True
    )
    zeros = torch.zeros(t.shape, dtype=lp.dtype, device=lp.device)
    return zeros.masked_scatter(keep, lp).view(lead), zeros.masked_scatter(keep, ent).view(lead)
