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

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_gptoss.bridge.plan import EngineLayout, ParamInfo, Transfer, buckets_of, plan_transfers
from megatron_gptoss.config import ModelConfig
from megatron_gptoss.hf.mxfp4 import quantize_mxfp4
from megatron_gptoss.hf.names import fc1_rows_to_hf, match_ours, to_hf
from megatron_gptoss.model.lora import adapter_of, is_adapter_param, merged_weight
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight, mxfp4_weights
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.sharding import ShardSpec, get_shard

Pairs = list[tuple[str, torch.Tensor]]


def weights(chunks: Sequence[nn.Module]) -> dict[str, nn.Parameter | MXFP4Weight]:
    """Every weight this rank holds by our parameter name: the parameters, and the MXFP4 expert weights
    (`model.expert_format: mxfp4`, buffers rather than parameters) under the name their parameter has."""
    out: dict[str, nn.Parameter | MXFP4Weight] = {}
    for chunk in chunks:
        out.update(chunk.named_parameters())
        out.update(mxfp4_weights(chunk))
    return out


def param_infos(chunks: Sequence[nn.Module], config: ModelConfig) -> list[ParamInfo]:
    """This rank's parameters (every model chunk it holds) as plan metadata; LoRA adapters are not sent
    on their own: they are merged into their layer's weight (`local_weight`). An MXFP4 expert weight counts
    as its logical [E, out, in] weight in its dtype, cut over ep (dim 0) when it holds fewer than every
    expert."""
    out = []
    for name, w in weights(chunks).items():
        if is_adapter_param(name):
            continue
        if isinstance(w, MXFP4Weight):
            spec = ShardSpec(0, "ep") if w.shape[0] < config.num_experts else None
        else:
            spec = get_shard(w)
        out.append(ParamInfo(name, tuple(w.shape), str(w.dtype).removeprefix("torch."), spec))
    return out


def local_weight(params: Mapping[str, nn.Parameter | MXFP4Weight], name: str, scale: float) -> torch.Tensor:
    """This rank's shard of parameter `name` as the engine must see it: with a LoRA adapter on its layer,
    W + scale * B A (fresh memory, the adapter shards cut to match the weight's), else the parameter. An
    MXFP4 weight is dequantized (exactly) in its dtype first."""
    weight = params[name]
    local = weight.dequantize() if isinstance(weight, MXFP4Weight) else weight.detach()
    prefix = adapter_of(name)
    if prefix is None or f"{prefix}.a" not in params:
        return local
    a, b = params[f"{prefix}.a"], params[f"{prefix}.b"]
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)  # adapters are parameters
    return merged_weight(local, a.detach(), b.detach(), scale)


def packed_experts(t: Transfer, full: torch.Tensor) -> Pairs:
    """An expert transfer sent as MXFP4 (`t.dtype` "uint8"): our full fc1 [E, 2I, H] ([gate; up] rows) or
    fc2 [E, H, I] weight -> [(blocks name, [E, out, in / 32, 16]), (scales name, [E, out, in / 32])], rows in
    HF's order (fc1's gate and up interleaved), quantized along the input dimension by `quantize_mxfp4`:
    `hf.mxfp4.pack_expert_weight` of the HF tensor `to_hf` would give, bit for bit."""
    weight = fc1_rows_to_hf(full) if match_ours(t.ours).rule.kind == "fc1" else full
    blocks, scales = quantize_mxfp4(weight)
    return [(t.names[0], blocks), (t.names[1], scales)]


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
        mine = param_infos(self.chunks, config)
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
        params = weights(self.chunks)
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
    def _assemble(self, t: Transfer, params: Mapping[str, nn.Parameter | MXFP4Weight]) -> Pairs:
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
        if t.dtype == "uint8":  # MXFP4: quantized from the weight's own dtype
            return packed_experts(t, full)
        return self._to_hf(t, full.to(getattr(torch, t.dtype)), local)

    @torch.no_grad()
    def _run(self, t: Transfer, params: Mapping[str, nn.Parameter | MXFP4Weight]) -> Pairs:
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
