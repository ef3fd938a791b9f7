"""Export: execute the plan, yielding full HF-named tensors in size-bounded buckets on the `dst` rank.

    every learner rank:  for bucket in exporter.buckets():    # collective over the learner's world
                             for transfer in bucket:
                                 sources --gather over tp or ep--> root --to_hf (hf.names)-->
                                 root --send--> dst            (when the root is not dst)
                             dst: yield [(hf name, tensor), ...]; every other rank: yield []

Works for any tp / ep / pp (and vpp) layout and for a single process (`dims=None`): a rank passes the
model chunks it holds; each parameter's ShardSpec tag says how its full tensor is cut (`parallel.sharding`),
pipeline stages contribute the layers they hold, and the vocabulary padding is dropped by `to_hf`.

LoRA: an adapted layer's weight is sent merged, W + scale * B A (each rank merges its own shards before the
gather), so the engine runs the trained policy as a plain GPT-OSS; adapters are never sent on their own.

Memory: the yielded tensors are fresh (never the learner's parameters, never views of them) and the
exporter keeps nothing between buckets. Peak extra memory per rank: on `dst`, one bucket plus the transfer
in flight; on a root, the transfer in flight: its gathered pieces or full tensor and its HF copy, at most
2 x (one parameter, or one expert slice where the engine takes slices) and 3 x for a gather along dim 1
(the output projection). `tests/bridge` measures it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_gptoss.bridge.plan import EngineLayout, ParamInfo, Transfer, buckets_of, plan_transfers
from megatron_gptoss.config import ModelConfig
from megatron_gptoss.hf.names import match_ours, to_hf
from megatron_gptoss.model.lora import adapter_of, is_adapter_param, merged_weight
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.sharding import get_shard

Pairs = list[tuple[str, torch.Tensor]]


def param_infos(chunks: Sequence[nn.Module]) -> list[ParamInfo]:
    """This rank's parameters (every model chunk it holds) as plan metadata; LoRA adapters are not sent
    on their own: they are merged into their layer's weight (`local_weight`)."""
    return [
        ParamInfo(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), get_shard(p))
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if not is_adapter_param(name)
    ]


def local_weight(params: dict[str, nn.Parameter], name: str, scale: float) -> torch.Tensor:
    """This rank's shard of parameter `name` as the engine must see it: with a LoRA adapter on its layer,
    W + scale * B A (fresh memory, the adapter shards cut to match the weight's), else the parameter."""
    local = params[name].detach()
    prefix = adapter_of(name)
    if prefix is None or f"{prefix}.a" not in params:
        return local
    return merged_weight(local, params[f"{prefix}.a"].detach(), params[f"{prefix}.b"].detach(), scale)


class WeightExporter:
    """Plans the sync once (layouts do not change during a run) and exports on every call of `buckets`.

    `chunks`: the model chunks this rank holds (one, or vpp of them); `dims`: the learner's ParallelDims,
    None for a single process; `dst`: the global rank that receives the HF tensors; `dtype`: the dtype
    sent (default: the parameters'). Building it is collective (one all_gather_object of the metadata)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        config: ModelConfig,
        dims: ParallelDims | None,
        engine: EngineLayout,
        bucket_bytes: int,
        dst: int = 0,
        dtype: torch.dtype | None = None,
    ):
        self.chunks, self.config, self.dims, self.dst = list(chunks), config, dims, dst
        mine = param_infos(self.chunks)
        if dims is None:
            layout, holdings = Layout(world=1, tp=1, pp=1, ep=1), {0: mine}
        else:
            gathered: list[list[ParamInfo] | None] = [None] * dims.layout.world
            dist.all_gather_object(gathered, mine)
            layout, holdings = dims.layout, {r: infos or [] for r, infos in enumerate(gathered)}
        sent = None if dtype is None else str(dtype).removeprefix("torch.")
        self.plan = self._make_plan(layout, engine, holdings, bucket_bytes, sent)
        self.rank = 0 if dims is None else dims.rank

    def _make_plan(self, layout, engine, holdings, bucket_bytes: int, dtype: str | None) -> list[Transfer]:
        return plan_transfers(layout, engine, holdings, self.config, bucket_bytes, self.dst, dtype)

    def buckets(self) -> Iterator[Pairs]:
        """One list of (HF name or expert-slice name, tensor) per bucket on `dst` (empty lists elsewhere);
        every rank of the learner must iterate it to the end, in step."""
        params = {name: p for chunk in self.chunks for name, p in chunk.named_parameters()}
        for bucket in buckets_of(self.plan):
            out: Pairs = []
            for transfer in bucket:
                out.extend(self._run(transfer, params))
            yield out

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The buckets flattened: the (name, tensor) stream an engine's `update_weights` takes."""
        for bucket in self.buckets():
            yield from bucket

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _assemble(self, t: Transfer, params: dict[str, nn.Parameter]) -> Pairs:
        """The transfer's HF tensors on its root (fresh memory); [] on every other rank. Collective over the
        transfer's sources."""
        if self.rank not in t.sources:
            return []
        local = local_weight(params, t.ours, self.config.lora.scale)
        if t.experts is not None:
            offset = self._first_local_expert(local)
            local = local[t.experts[0] - offset : t.experts[1] - offset]
        full = self._gather(t, local)
        if self.rank != t.root:
            return []
        assert full is not None
        return self._to_hf(t, full.to(getattr(torch, t.dtype)), local)

    @torch.no_grad()
    def _run(self, t: Transfer, params: dict[str, nn.Parameter]) -> Pairs:
        rank, dst = self.rank, self.dst
        if rank not in t.sources and rank != dst:
            return []
        dtype = getattr(torch, t.dtype)
        pairs = self._assemble(t, params)
        if t.root == dst:
            return pairs
        if rank == t.root:
            for _, tensor in pairs:
                dist.send(tensor, dst, group=dist.group.WORLD)
            return []
        if rank == dst:
            received = []
            for name, shape in zip(t.names, t.shapes):
                tensor = torch.empty(shape, dtype=dtype, device=self._device())
                dist.recv(tensor, t.root, group=dist.group.WORLD)
                received.append((name, tensor))
            return received
        return []

    def _gather(self, t: Transfer, local: torch.Tensor) -> torch.Tensor | None:
        """The full tensor on the root (our layout, vocabulary padding kept); None on the other sources."""
        if t.gather is None:
            return local
        assert self.dims is not None
        group = self.dims.group(t.gather.group)
        local = local.contiguous()
        if self.rank != t.root:
            dist.gather(local, None, dst=t.root, group=group)
            return None
        shape = list(local.shape)
        shape[t.gather.dim] *= len(t.sources)
        if t.gather.dim == 0:  # the pieces land in their rows of the full tensor: no concatenation copy
            full = local.new_empty(shape)
            dist.gather(local, list(full.chunk(len(t.sources))), dst=t.root, group=group)
            return full
        pieces = [torch.empty_like(local) for _ in t.sources]
        dist.gather(local, pieces, dst=t.root, group=group)
        return torch.cat(pieces, dim=t.gather.dim)

    def _to_hf(self, t: Transfer, full: torch.Tensor, local: torch.Tensor) -> Pairs:
        out = []
        for name, (_, tensor) in zip(t.names, to_hf(match_ours(t.ours), full, self.config)):
            if tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                tensor = tensor.clone()  # never hand out the learner's own memory
            out.append((name, tensor))
        return out

    def _first_local_expert(self, local: torch.Tensor) -> int:
        """Global id of this rank's first expert (experts are split evenly over ep, in ep-rank order)."""
        if self.dims is None or self.dims.ep == 1:
            return 0
        return self.dims.coord("ep") * local.shape[0]

    def _device(self) -> torch.device:
        return next(p.device for chunk in self.chunks for p in chunk.parameters())
