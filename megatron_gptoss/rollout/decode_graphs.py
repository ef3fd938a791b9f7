"""Decode steps replayed from CUDA graphs, one per bucket of batch size and attention-view widths.

    a decode-only step of B rows (one new token each)
      -> its bucket: batch Bb = the smallest power of two >= B (up to `max_batch`), and per KV pool a view
         width = the smallest power of two >= the step's widest block table
      -> the step's token ids, positions, KV slots, block tables and query positions copied into the
         bucket's static buffers; padding rows: token 0 at position 0, writing into the null block, query
         position -1 (they see no key and their outputs are dropped)
      -> replay the bucket's graph (captured on first use) -> final hidden states [1, Bb, H] -> rows [:B]

Capture needs a forward without host synchronisation and without copies from the host: every input is
in the bucket's device buffers (filled before the replay), every module buffer lives on the device (the
rotary frequencies too), and the ops are the paged cache's `attend` (index copies and gathers), the
Triton decode kernel or the eager attention with a fixed view width, and the fused expert kernels
(`Experts.fused`; torch._grouped_mm reads its offsets on the host for float32 weights, so a float32 engine
is not captured). A capture that fails (an op that syncs or copies from the host) turns graphs off for the
engine (`failure` says why) and the step runs eagerly. Graphs hold the cache's storage and the weights'
addresses: they live as long as the cache (a grown pool, sleep or reconfigure drops them; `update_weights`
copies in place and keeps them).

`mode` "padded" runs the same bucketed buffers eagerly, without capture: on the CPU, where no graph can be
captured, it checks the bucketing and padding against the unpadded step.
"""

from __future__ import annotations

import logging

import torch

from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.paged_kv_cache import AttentionGroup, PagedKVCache, StepLayout

log = logging.getLogger(__name__)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Buffers:
    """Static inputs of one bucket (and, once captured, its graph and output)."""

    def __init__(self, batch: int, widths: tuple[int, ...], block_size: int, device: torch.device):
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = zeros(1, batch), zeros(1, batch)
        self.slots = [zeros(batch) for _ in widths]
        self.q_positions = [zeros(batch, 1) - 1 for _ in widths]
        self.tables = [zeros(batch, w) for w in widths]
        index = torch.arange(batch, device=device)
        views = [w * block_size for w in widths]
        group = AttentionGroup(index.view(batch, 1), self.q_positions, self.tables, views)
        self.layout = StepLayout(self.slots, [group], index)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None


class DecodeGraphs:
    """Bucketed decode forwards of `model` over `cache`. `mode`: "capture" (CUDA graphs) or "padded"."""

    def __init__(self, model: GPTOSSModel, cache: PagedKVCache, max_batch: int, mode: str):
        self.model, self.cache, self.max_batch, self.mode = model, cache, max_batch, mode
        self.device = next(model.parameters()).device
        self.enabled = True
        # why capture failed (graphs are then off), None while it has not
        self.failure: str | None = None
        self._buffers: dict[tuple[int, tuple[int, ...]], _Buffers] = {}
        self._sizes = self._pool_sizes()
        self._pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        dtype = next(model.parameters()).dtype
        if mode == "capture" and dtype == torch.float32:
            self.enabled = False
            self.failure = (
                "float32 weights: torch._grouped_mm (the fused experts) reads its group offsets on the host "
                "for float32, so the decode step runs eagerly"
            )

    def _pool_sizes(self) -> tuple[int, ...]:
        return tuple(pool.num_blocks for pool in self.cache.pools)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout
    ) -> torch.Tensor | None:
        """Final hidden states [1, B, H] of a decode-only step, or None where the step is not one (prefill
        rows, more rows than `max_batch`, graphs off): the caller runs it eagerly."""
        if not self.enabled or len(layout.groups) != 1 or layout.groups[0].token_index.shape[1] != 1:
            return None
        group = layout.groups[0]
        rows = group.token_index.shape[0]
        if rows > self.max_batch:
            return None
        if self._pool_sizes() != self._sizes:  # a pool grew: its storage moved, the graphs are stale
            self._buffers.clear()
            self._sizes = self._pool_sizes()
        widths = tuple(_bucket(t.shape[1]) for t in group.tables)
        key = (_bucket(rows), widths)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = _Buffers(key[0], widths, self.cache.block_size, self.device)
        self._fill(buffers, input_ids, positions, layout)
        if self.mode == "padded":
            return self._forward(buffers)[:, :rows]
        if buffers.graph is None and not self._capture(buffers):
            return None
        assert buffers.graph is not None and buffers.hidden is not None
        buffers.graph.replay()
        return buffers.hidden[:, :rows]

    def _fill(
        self, b: _Buffers, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout
    ) -> None:
        rows = input_ids.shape[1]
        group = layout.groups[0]
        for static, real in ((b.input_ids, input_ids), (b.positions, positions)):
            static.zero_()
            static[:, :rows].copy_(real)
        for i in range(len(b.tables)):
            b.slots[i].zero_()  # padding writes slot 0: the null block
            b.slots[i][:rows].copy_(layout.slots[i])
            b.q_positions[i].fill_(-1)
            b.q_positions[i][:rows].copy_(group.q_positions[i])
            b.tables[i].zero_()
            b.tables[i][:rows, : group.tables[i].shape[1]].copy_(group.tables[i])

    def _forward(self, b: _Buffers) -> torch.Tensor:
        self.cache.layout = b.layout
        try:
            return self.model.hidden_states(b.input_ids, position_ids=b.positions, cache=self.cache)
        finally:
            self.cache.layout = None

    def _capture(self, b: _Buffers) -> bool:
        """Warm up on a side stream, then capture; on failure turn graphs off (False)."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                b.hidden = self._forward(b)
            b.graph = graph
            return True
        except RuntimeError as err:  # an op that needs the host (e.g. the experts' loop backend)
            log.warning(
                "CUDA graph capture of the decode step failed, running eagerly: %s", err, exc_info=True
            )
            self.failure = f"{type(err).__name__}: {err}"
            self.enabled = False
            self._buffers.clear()
            return False
