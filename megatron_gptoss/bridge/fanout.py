"""Fan-out: the learner's weights straight into a colocated, sharded engine. Every learner rank also hosts
one engine worker (engine world = learner world, engine layout its own, e.g. `ParallelEmbeddedEngine`) and
receives only what its engine shard needs; there is no single dst.

    every rank, per bucket of `plan_fanout` (collective over the learner's world, in step):
      dense transfer   sources --gather over tp--> root --to_hf--> broadcast over the world: every rank gets
                       the full HF tensors in a buffer of its own; its engine narrows them to its shard
      expert slice     a rank holding those experts --to_hf--> itself where its engine shard takes them (a
                       local conversion, no communication); other workers that take them: isend from the
                       slice's owner, irecv on the worker (a bucket's point-to-point transfers posted at once)
      yield            this rank's (name, tensor) pairs, for its own engine worker:

    sync_in_process(FanoutExporter(...).buckets(), engine, is_dst=True)       # on every rank

Memory per rank (the bound `tests/bridge` checks): what this rank receives in one bucket (at most
`bucket_bytes`, or one transfer larger than it) plus what it roots in that bucket (its HF tensors, kept
until the bucket's sends complete: at most `bucket_bytes` or one transfer) plus the transfer in flight (a
tp gather and its HF copy). Expert transfers are slices of at most `bucket_bytes` (one expert at least), so
with slices the peak is about 2 x bucket + 2 x the largest dense tensor rooted (3 x for the output
projection's dim-1 gather). Every pair yielded is in memory of its own (never the learner's parameters).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_gptoss.bridge.export import Pairs, WeightExporter, weights
from megatron_gptoss.bridge.plan import EngineLayout, Transfer, buckets_of, plan_fanout
from megatron_gptoss.config import ModelConfig
from megatron_gptoss.parallel.dims import ParallelDims


class FanoutExporter(WeightExporter):
    """Plans once (`plan_fanout`; collective) and, on every call of `buckets`, feeds each rank's engine
    worker. `engine` must have `workers` == the learner's world and take expert slices; `engine.ep` is the
    engine's expert-parallel size (engine worker w holds ep part w % ep)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        config: ModelConfig,
        dims: ParallelDims,
        engine: EngineLayout,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(chunks, config, dims, engine, bucket_bytes, dst=-1, dtype=dtype)

    def _make_plan(self, layout, engine, holdings, bucket_bytes: int, dtype: str | None) -> list[Transfer]:
        return plan_fanout(layout, engine, holdings, self.config, bucket_bytes, dtype)

    def buckets(self) -> Iterator[Pairs]:
        """One list of (HF name or expert-slice name, tensor) per bucket: what this rank's engine worker
        needs from it. Every rank must iterate to the end, in step."""
        params = weights(self.chunks)
        for bucket in buckets_of(self.plan):
            mine: Pairs = []
            ops: list[dist.P2POp] = []
            for transfer in bucket:
                pairs = self._assemble(transfer, params)
                if transfer.phase == "dense":
                    mine.extend(self._broadcast(transfer, pairs))
                else:
                    mine.extend(self._point_to_point(transfer, pairs, ops))
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            yield mine

    # ----------------------------------------------------------------------------------------------
    def _broadcast(self, t: Transfer, pairs: Pairs) -> Pairs:
        """Every rank ends with the root's HF tensors (the root keeps its own fresh ones)."""
        if self.rank == t.root:
            out = pairs
        else:
            dtype = getattr(torch, t.dtype)
            out = [(n, torch.empty(s, dtype=dtype, device=self._device())) for n, s in zip(t.names, t.shapes)]
        assert self.dims is not None
        if self.dims.layout.world > 1:
            for _, tensor in out:
                dist.broadcast(tensor, src=t.root)
        return out

    def _point_to_point(self, t: Transfer, pairs: Pairs, ops: list[dist.P2POp]) -> Pairs:
        """Sends of the root, receives of the other receivers, appended to `ops`; returns this rank's pairs
        (received ones are filled when the bucket's `ops` complete)."""
        if self.rank == t.root:
            for worker in t.receivers:
                if worker != self.rank:
                    ops.extend(dist.P2POp(dist.isend, tensor, worker) for _, tensor in pairs)
            return pairs if self.rank in t.receivers else []
        if self.rank not in t.receivers:
            return []
        dtype = getattr(torch, t.dtype)
        out = [(n, torch.empty(s, dtype=dtype, device=self._device())) for n, s in zip(t.names, t.shapes)]
        ops.extend(dist.P2POp(dist.irecv, tensor, t.root) for _, tensor in out)
        return out
