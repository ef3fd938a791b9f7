"""Sink attention of new queries against a KV cache (the rollout engine's prefill and decode).

Slot j of the cache holds the key/value of position j, so query positions decide visibility:
query at position p sees slot j when j <= p and, with window W, p - W < j. Slots beyond a row's
written length are never visible to it. Same contract and precision as `eager_sink_attention`.
"""

from __future__ import annotations

import torch


def cached_sink_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sinks: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    kv_slots: int | None = None,
) -> torch.Tensor:
    """q [B, Tq, Hq, D]; k_cache/v_cache [B, S, Hkv, D]; q_positions int64 [B, Tq]. Returns [B, Tq, Hq, D].

    `kv_slots`: how many leading slots to read (every later one must be invisible to every query); None reads
    up to the largest query position, found on the host."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[2], k_cache.shape[2]
    group = hq // hkv
    used = int(q_positions.max()) + 1 if kv_slots is None else kv_slots
    k = k_cache[:, :used].to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    v = v_cache[:, :used].to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    qf = q.to(compute).transpose(1, 2)
    scores = (qf @ k.transpose(-1, -2)) * scale
    slots = torch.arange(used, device=q.device)
    pos = q_positions[:, :, None]
    allowed = slots[None, None, :] <= pos
    if window is not None:
        allowed &= slots[None, None, :] > pos - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    sink = sinks.to(compute).view(1, hq, 1, 1)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(scores - row_max)
    z = p.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max)
    return ((p / z) @ v).transpose(1, 2).to(q.dtype)
