"""Paged key/value cache: fixed-size blocks handed out from a free list, one block table per sequence.

    layer group (layers of one window: full attention, or a sliding window W)
        BlockPool   keys / values [num_blocks, block_size, Hkv, D] per layer of the group, a free list of
                    block ids; block 0 is the null block: never handed out, it absorbs the writes of padding
                    tokens and stands in for blocks a sliding window has released
    sequence        one block table per group: position p lives in block table[p // block_size] at offset
                    p % block_size (a sliding-window group's released entries read 0)

One forward of the engine computes a packed set of tokens [1, N] from many sequences (`StepLayout`, built on
the host by the scheduler and copied to the device once per step). In every layer `PagedKVCache.attend`
writes the new keys and values at their slots (one `index_copy_`), then per attention group (the decoding
rows, one new token each; the prefilling rows, their chunks left-padded to the longest) runs attention
with the queries' positions in the row's view: slot = position for full attention; a sliding-window group's
view starts at the row's first unreleased block f, so its slot = position - f x block_size. The decoding
rows go to the layer's paged kernel where it has one (the Triton backend: keys and values read through the
block table inside the kernel, at their absolute positions; a step laid out flat for the engine's graphs
makes every prefill token such a row too); otherwise, and for prefill chunks, each row's blocks are gathered
into a dense [b, blocks x block_size, Hkv, D] view for the layer's cached-attention kernel (keys carry their
rotary phase already, and visibility depends on position differences only). No value is read back on the
host inside a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# attention_fn(q [b, t, Hq, D], keys [b, S, Hkv, D], values, q_positions int64 [b, t], kv_slots)
#     -> [b, t, Hq, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# paged_fn(q [b, Hq, D], pool keys [blocks, block_size, Hkv, D], pool values, tables [b, blocks],
#     positions int64 [b], q_positions int64 [b]) -> [b, Hq, D], or None where the layer has no such kernel
PagedFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None
]


class BlockPool:
    """The blocks of one layer group. `window` None: full attention; else the group's sliding window."""

    def __init__(
        self,
        layers: list[int],
        window: int | None,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
    ):
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.layers, self.window, self.block_size = list(layers), window, block_size
        self.shape = (block_size, kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.num_blocks = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.free: list[int] = []
        self.grow(num_blocks)

    def grow(self, extra: int) -> None:
        """Add `extra` blocks (between steps: the storage is reallocated, block ids stay valid)."""
        start = self.num_blocks
        for layer in self.layers:
            for store in (self.keys, self.values):
                old = store.get(layer)
                new = torch.zeros((start + extra, *self.shape), dtype=self.dtype, device=self.device)
                if old is not None:
                    new[:start].copy_(old)
                store[layer] = new
        self.num_blocks = start + extra
        # block 0 is the null block; the free list pops the lowest ids first
        self.free.extend(reversed(range(max(start, 1), self.num_blocks)))
        self.free.sort(reverse=True)

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("block pool exhausted (the scheduler reserves blocks before it allocates)")
        return self.free.pop()

    def release(self, block: int) -> None:
        if block != 0:
            self.free.append(block)

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store.values())

    def drop_storage(self) -> None:
        """Free the keys and values (sleep); `retake_storage` allocates them again, empty."""
        self.keys, self.values = {}, {}

    def retake_storage(self) -> None:
        for layer in self.layers:
            for store in (self.keys, self.values):
                store[layer] = torch.zeros(
                    (self.num_blocks, *self.shape), dtype=self.dtype, device=self.device
                )


@dataclass
class AttentionGroup:
    """Rows of one attention call. `token_index` [b, t] int64: each padded query's index in the packed
    tokens (padding repeats a real index, its output is dropped). Per pool: `tables` [b, blocks] int64, the
    blocks of each row's view (a sliding-window pool's view starts at the row's first unreleased block
    `f`); `q_positions` [b, t] the queries' positions within that view (position - f x block_size;
    padding: -1, it sees no key); `kv_slots`: blocks x block_size."""

    token_index: torch.Tensor
    q_positions: list[torch.Tensor]
    tables: list[torch.Tensor]
    kv_slots: list[int]


@dataclass
class StepLayout:
    """Device tensors of one packed forward. `slots` per pool: [N] flat slot (block x block_size + offset) of
    each packed token; `inverse` [N]: each token's row in the concatenated padded attention outputs.
    `in_order`: one group of one query per row whose rows are the packed tokens in order (`token_index` and
    `inverse` are the identity: a decode-only step), so attention gathers neither its queries nor its
    outputs."""

    slots: list[torch.Tensor]
    groups: list[AttentionGroup]
    inverse: torch.Tensor
    in_order: bool = False


class PagedKVCache:
    """Keys and values of every layer in block pools, grouped by attention window. The scheduler sets
    `layout` before each forward; the attention layers call `attend`."""

    def __init__(
        self,
        config,
        block_size: int,
        num_blocks: int,
        dtype,
        device,
        kv_heads: int | None = None,
        window_blocks: int | None = None,
    ):
        """`num_blocks` per pool of full-attention layers, `window_blocks` (default the same) per pool of
        sliding-window layers."""
        heads = config.num_query_groups if kv_heads is None else kv_heads
        by_window: dict[int | None, list[int]] = {}
        for layer in range(config.num_layers):
            by_window.setdefault(config.window_of(layer), []).append(layer)
        self.block_size = block_size
        self.pools = [
            BlockPool(
                layers,
                window,
                num_blocks if window is None or window_blocks is None else window_blocks,
                block_size,
                heads,
                config.head_dim,
                dtype,
                device,
            )
            for window, layers in by_window.items()
        ]
        self.pool_of = {layer: i for i, pool in enumerate(self.pools) for layer in pool.layers}
        self.layout: StepLayout | None = None

    def storage_bytes(self) -> int:
        return sum(pool.storage_bytes() for pool in self.pools)

    def drop_storage(self) -> None:
        """Free every pool's keys and values (the cache is not used again)."""
        for pool in self.pools:
            pool.drop_storage()
        self.layout = None

    def slot_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values [pool slots, Hkv, D], slots [N]): where this step's new keys and values of `layer`
        go, for a kernel that writes them itself (`attend(..., written=True)` then skips its write)."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("PagedKVCache.slot_target before the scheduler set the step layout")
        index = self.pool_of[layer]
        pool = self.pools[index]
        flat = (-1, *pool.shape[1:])
        return pool.keys[layer].view(flat), pool.values[layer].view(flat), layout.slots[index]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        attention_fn: AttentionFn,
        paged_fn: PagedFn | None = None,
        written: bool = False,
    ) -> torch.Tensor:
        """q [1, N, Hq, D], k / v [1, N, Hkv, D] of the packed tokens -> attention output [1, N, Hq, D].
        A group of one query per row goes to `paged_fn` (the blocks read through the table, no dense view)
        where it returns a result. `written`: k and v are in their slots already (`slot_target`)."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("PagedKVCache.attend before the scheduler set the step layout")
        index = self.pool_of[layer]
        pool = self.pools[index]
        keys, values = pool.keys[layer], pool.values[layer]
        flat = (-1, *pool.shape[1:])
        slots = layout.slots[index]
        if not written:
            keys.view(flat).index_copy_(0, slots, k.reshape(flat).to(keys.dtype))
            values.view(flat).index_copy_(0, slots, v.reshape(flat).to(values.dtype))
        q_flat = q.reshape(-1, *q.shape[2:])
        outs = []
        for group in layout.groups:
            b, t = group.token_index.shape
            table = group.tables[index]
            if layout.in_order:
                qg = q_flat.view(b, t, *q.shape[2:])
            else:
                qg = q_flat.index_select(0, group.token_index.reshape(-1)).view(b, t, *q.shape[2:])
            if t == 1 and paged_fn is not None:
                rows = group.token_index[:, 0]
                where = positions.reshape(-1).index_select(0, rows)
                out = paged_fn(qg[:, 0], keys, values, table, where, group.q_positions[index][:, 0])
                if out is not None:
                    outs.append(out)
                    continue
            slots_of_view = group.kv_slots[index]
            kg = keys[table].view(b, slots_of_view, *pool.shape[1:])
            vg = values[table].view(b, slots_of_view, *pool.shape[1:])
            outs.append(
                attention_fn(qg, kg, vg, group.q_positions[index], slots_of_view).reshape(b * t, *q.shape[2:])
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return (out if layout.in_order else out.index_select(0, layout.inverse)).view(q.shape)
