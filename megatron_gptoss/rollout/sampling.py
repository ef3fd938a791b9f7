"""Sampling from the engine's logits: the tempered log-prob of the sampled token, top-k / top-p truncation.

Two sources of randomness:
    seeded     `SamplingParams.seed` set: row i of a request is sampled with its own counter-based stream,
               seeded by seed + i and indexed by the token's position in the response: one uniform number
               per row and token (a hash of (row seed, position)) picks the token by inverse CDF (one
               cumulative sum over the vocabulary). A row's tokens depend only on its own seed, never
               on which rows share its batch or how the rows are split over engine replicas, so a run
               samples the same trajectories at any engine layout (and a tensor-parallel group agrees
               without communication).
    unseeded   the engine's running `torch.Generator` (multinomial over the batch).
"""

from __future__ import annotations

import torch

from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.model.logprobs import normaliser
from megatron_gptoss.ops import batch_invariant, fused_moe, fused_sampling

# splitmix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps around)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def counter_uniform(row_seeds: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64 [B]: a pure function of (row seed, position); `position` is one
    counter for every row or a tensor [B] of per-row counters."""
    seeds = row_seeds.to(torch.int64)
    if isinstance(position, torch.Tensor):
        where = position.to(device=seeds.device, dtype=torch.int64)
    else:
        where = torch.full_like(seeds, position)
    bits = _mix(_mix(seeds * _GOLDEN) ^ (where * _MIX1))
    return (_shr(bits, 11).double() + 0.5) * 2.0**-53


def sample_from_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    row_seeds: torch.Tensor | None = None,
    position: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (tokens [B], log-probs [B]). The log-prob is that of the tempered, untruncated
    distribution; top-k then top-p only restrict what can be sampled. With `row_seeds` [B] the draw is the
    seeded, counter-based one at counter `position` (an int, or int64 [B] per row); otherwise `generator`'s
    multinomial. Seeded and untruncated on CUDA (the batch-invariant mode off), one Triton kernel draws
    (`ops.fused_sampling`)."""
    truncated = bool(params.top_k and params.top_k < logits.shape[-1]) or params.top_p < 1.0
    fused = logits.is_cuda and fused_moe.triton_available() and not batch_invariant.active()
    if row_seeds is not None and fused and not truncated:
        uniforms = counter_uniform(row_seeds, position).float()
        return fused_sampling.seeded_sample(logits.float(), uniforms, params.temperature)
    if batch_invariant.active():  # the learner's log-probs to the bit (`model.logprobs`)
        logp = logits.float() * (1.0 / params.temperature)
        logp = logp - normaliser(logp)
    else:
        logp = torch.log_softmax(logits.float() * (1.0 / params.temperature), dim=-1)
    filtered = logp  # truncation below is out of place: logp stays the untruncated distribution
    if params.top_k and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_lp, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = before >= params.top_p
        filtered = filtered.scatter(-1, order, sorted_lp.masked_fill(drop, float("-inf")))
    probs = torch.softmax(filtered, dim=-1)
    if (
        row_seeds is not None
    ):  # inverse CDF at the row's uniform: the first token whose cumulative mass reaches it
        cdf = probs.cumsum(dim=-1)
        target = counter_uniform(row_seeds, position).to(cdf.dtype) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp_max(cdf.shape[-1] - 1)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
