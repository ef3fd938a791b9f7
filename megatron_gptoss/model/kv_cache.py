"""Key/value cache of the embedded rollout engine: one [B, S, Hkv, D] pair per layer, slot = position."""

from __future__ import annotations

import torch

from megatron_gptoss.config import ModelConfig


class KVCache:
    """Per-layer keys and values for `batch` rows of at most `max_tokens` positions.

    Sliding-window layers keep every slot too (visibility, not storage, enforces the window), so a
    row's cache holds exactly the keys the training forward would compute for the same positions.
    """

    def __init__(
        self, config: ModelConfig, batch: int, max_tokens: int, dtype, device, kv_heads: int | None = None
    ):
        # kv_heads: the KV heads this instance computes (a tensor-parallel rank holds num_query_groups / tp)
        heads = config.num_query_groups if kv_heads is None else kv_heads
        shape = (batch, max_tokens, heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.max_tokens = max_tokens

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Store k/v [B, Tq, Hkv, D] at slots `positions` [B, Tq]; returns the layer's full cache."""
        if int(positions.max()) >= self.max_tokens:
            raise ValueError(f"position {int(positions.max())} exceeds the cache's {self.max_tokens} slots")
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
        self.keys[layer][rows, positions] = k.to(self.keys[layer].dtype)
        self.values[layer][rows, positions] = v.to(self.values[layer].dtype)
        return self.keys[layer], self.values[layer]

    def slot_target(self, layer: int) -> None:
        """None: this cache's writes are its own (the paged cache lets the rotary kernel write its slots)."""
        return None

    def attend(
        self, layer: int, q, k, v, positions: torch.Tensor, attention_fn, paged_fn=None, written=False
    ) -> torch.Tensor:
        """Store this layer's new k/v, then `attention_fn(q, keys, values, positions, None)` on the cache
        (`paged_fn`, the paged cache's block-table decode, has no use here: the cache is contiguous;
        `written` is never true here, as `slot_target` gives no slots)."""
        k_all, v_all = self.write(layer, k, v, positions)
        return attention_fn(q, k_all, v_all, positions, None)
