"""The transfer plan: a pure function from (learner layout, engine layout, parameter metadata) to the list
of transfers that turn the learner's shards into full HF-named tensors on one rank, in buckets.

    ParamInfo per rank and parameter (name, local shape, dtype, ShardSpec) --+
    Layout of the learner (world, tp, pp, ep)                                +--> plan_transfers -> [Transfer]
    EngineLayout (workers, ep, takes expert slices?)                       --+

One transfer = one of our parameters (or one expert range of it) becoming its HF tensor(s):
    sources   the learner ranks whose local tensors form it, in concatenation order: the tp group (tp
              shards) or ep group (whole expert tensor) of the first replica (dp / edp rank 0) of the
              pipeline stage that holds it; one rank for a replicated parameter or an expert slice
    root      the source that gathers the shards (`gather`) and converts our layout to HF
              (`hf.names`): `dst` when it is a source, else the first source
    dst       the rank that feeds the engine; the root sends the HF tensors there when it is another rank
Order: a dense pass (embedding, each layer's attention, norms and router, final norm, output layer), then
an experts pass per layer. Buckets: consecutive transfers of one pass up to `bucket_bytes` (256-byte
aligned, as `engine_api.buckets` packs them); a transfer larger than the bucket travels alone. Where the
engine takes expert slices, each expert-parallel owner sends its own experts as ranges cut at the
learner's and the engine's expert-parallel boundaries and to at most `bucket_bytes` (one expert at least),
so the experts are never gathered over ep.

MXFP4 engine experts (`EngineLayout.expert_format` "mxfp4"): each expert weight transfer (fc1 / fc2, whole or
a slice) sends `<name>_blocks` and `<name>_scales` (uint8, their packed shapes) in place of `<name>`; the
root quantizes (`bridge.export.packed_experts`).

Fan-out (`plan_fanout`): the engine's workers are the learner's ranks (engine worker w runs on learner rank
w, a colocated engine of its own layout). There is no dst: each transfer's root sends its HF tensors to the
transfer's `receivers` directly. Dense tensors go from their root to every worker (a broadcast); an expert
slice goes to the workers whose engine ep part holds it, each from a learner rank that holds those experts:
the worker itself where it does (a local conversion, no communication), else the slice's first-replica
owner. A receiver gets each name it needs exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.engine_api.buckets import ALIGN
from megatron_gptoss.engine_api.protocol import expert_slice_name
from megatron_gptoss.hf.mxfp4 import packed_shapes
from megatron_gptoss.hf.names import hf_shapes, match_ours, our_names
from megatron_gptoss.parallel.dims import Layout
from megatron_gptoss.parallel.sharding import ShardSpec

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1}


@dataclass(frozen=True)
class ParamInfo:
    """One of our parameters as one rank holds it."""

    name: str
    local_shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."
    shard: ShardSpec | None


@dataclass(frozen=True)
class EngineLayout:
    """The receiving engine: `workers` processes (vLLM: its tensor x data parallel ranks), experts split over
    `ep` of them (worker w holds ep part w % ep), and whether it takes expert-range slices."""

    workers: int = 1
    ep: int = 1
    expert_slices: bool = False
    # How the engine holds the expert weights (fc1 / fc2, not their biases): "bf16" takes them as float HF
    # tensors; "mxfp4" as the released checkpoints store them, `<name>_blocks` and `<name>_scales` (uint8,
    # HF's row order), quantized by the bridge (`hf.mxfp4.quantize_mxfp4`) from the learner's weights.
    expert_format: str = "bf16"


@dataclass(frozen=True)
class Transfer:
    ours: str  # our parameter name
    names: tuple[str, ...]  # names sent: HF names, or expert-slice names
    shapes: tuple[tuple[int, ...], ...]  # their shapes (vocabulary padding removed)
    dtype: str  # dtype sent ("uint8" for MXFP4 blocks and scales, quantized from the parameter's dtype)
    layer: int | None
    phase: str  # "dense" or "experts"
    sources: tuple[int, ...]  # learner ranks holding the pieces, in concatenation order
    gather: ShardSpec | None  # how the pieces join (None: sources[0] holds the whole tensor or slice)
    experts: tuple[int, int] | None  # global expert range of a slice
    receivers: tuple[int, ...]  # engine workers that need it
    root: int = -1  # the source that assembles the HF tensors and sends them to dst
    bucket: int = -1

    @property
    def nbytes(self) -> int:
        size = _DTYPE_BYTES[self.dtype]
        return sum(_aligned(_numel(s) * size) for s in self.shapes)


def plan_transfers(
    layout: Layout,
    engine: EngineLayout,
    holdings: Mapping[int, Sequence[ParamInfo]],
    config: ModelConfig,
    bucket_bytes: int,
    dst: int = 0,
    dtype: str | None = None,
) -> list[Transfer]:
    """Every transfer of one full weight sync, roots and bucket indices assigned. `holdings[rank]` lists
    the parameters rank holds (all ranks of the learner); `dst` receives the HF tensors; `dtype` overrides
    the parameters' dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if engine.expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"engine expert_format={engine.expert_format!r} not in ('bf16', 'mxfp4')")
    holders: dict[str, list[tuple[int, ParamInfo]]] = {}
    for rank in sorted(holdings):
        for info in holdings[rank]:
            holders.setdefault(info.name, []).append((rank, info))
    expected = our_names(config)
    missing = [n for n in expected if n not in holders]
    unknown = sorted(set(holders) - set(expected))
    if missing or unknown:
        raise ValueError(f"parameters held by no rank: {missing}; parameters outside the model: {unknown}")
    dense: list[Transfer] = []
    experts: list[Transfer] = []
    for name in expected:
        ranks = holders[name]
        spec = ranks[0][1].shard
        if any(info.shard != spec for _, info in ranks):
            raise ValueError(f"{name}: ranks disagree on its ShardSpec")
        common = _Common(name, layout, engine, config, dtype or ranks[0][1].dtype, dst)
        if ".mlp.experts." in name:
            experts.extend(_expert_transfers(common, [r for r, _ in ranks], spec, bucket_bytes))
        else:
            dense.append(_dense_transfer(common, [r for r, _ in ranks], spec))
    planned = _assign_buckets(dense, 0, bucket_bytes)
    first = planned[-1].bucket + 1 if planned else 0
    return planned + _assign_buckets(experts, first, bucket_bytes)


def plan_fanout(
    layout: Layout,
    engine: EngineLayout,
    holdings: Mapping[int, Sequence[ParamInfo]],
    config: ModelConfig,
    bucket_bytes: int,
    dtype: str | None = None,
) -> list[Transfer]:
    """Every transfer of one weight sync into a colocated engine whose worker w is learner rank w
    (`engine.workers` == the learner's world, expert slices). Buckets as `plan_transfers`; an expert slice
    needed by several workers becomes one transfer per sending rank, in the same bucket."""
    if engine.workers != layout.world or not engine.expert_slices:
        raise ValueError(
            f"fan-out needs an engine of the learner's {layout.world} workers that takes expert slices, "
            f"got {engine}"
        )
    held = {rank: {info.name for info in infos} for rank, infos in holdings.items()}
    out = []
    for t in plan_transfers(layout, engine, holdings, config, bucket_bytes, dst=-1, dtype=dtype):
        if t.phase == "dense":
            out.append(t)
            continue
        (owner,) = t.sources
        part = layout.coords(owner)["ep"]
        senders: dict[int, list[int]] = {}
        for worker in t.receivers:
            local = t.ours in held.get(worker, ()) and layout.coords(worker)["ep"] == part
            senders.setdefault(worker if local else owner, []).append(worker)
        out.extend(
            replace(t, sources=(src,), root=src, receivers=tuple(workers)) for src, workers in senders.items()
        )
    return out


def buckets_of(plan: Sequence[Transfer]) -> list[list[Transfer]]:
    """The plan's transfers grouped by bucket, in order."""
    out: dict[int, list[Transfer]] = {}
    for t in plan:
        out.setdefault(t.bucket, []).append(t)
    return [out[b] for b in sorted(out)]


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Common:
    name: str
    layout: Layout
    engine: EngineLayout
    config: ModelConfig
    dtype: str
    dst: int

    def first_replica(self, ranks: list[int], coord: str | tuple[str, ...], order: str) -> tuple[int, ...]:
        """Holders with rank 0 in `coord` (one coordinate or several), sorted by their `order` coordinate."""
        kinds = (coord,) if isinstance(coord, str) else coord
        coords = self.layout.coords
        firsts = (r for r in ranks if all(coords(r)[kind] == 0 for kind in kinds))
        return tuple(sorted(firsts, key=lambda r: coords(r)[order]))

    def root(self, sources: tuple[int, ...]) -> int:
        return self.dst if self.dst in sources else sources[0]


def _dense_transfer(c: _Common, ranks: list[int], spec: ShardSpec | None) -> Transfer:
    match = match_ours(c.name)
    if spec is None:  # replicated: one holder sends it, dst itself when it holds it
        first = c.first_replica(ranks, ("dp", "cp"), "tp")  # the cp ranks of a replica hold the same weights
        sources: tuple[int, ...] = (c.dst,) if c.dst in ranks else first[:1]
    else:
        sources = c.first_replica(ranks, ("dp", "cp"), "tp")
        if len(sources) != c.layout.tp:
            raise ValueError(
                f"{c.name}: {len(sources)} tp shards in the first replica, expected {c.layout.tp}"
            )
    return Transfer(
        ours=c.name,
        names=match.hf,
        shapes=hf_shapes(match, c.config),
        dtype=c.dtype,
        layer=match.layer,
        phase="dense",
        sources=sources,
        gather=spec if spec is not None and len(sources) > 1 else None,
        experts=None,
        receivers=tuple(range(c.engine.workers)),
        root=c.root(sources),
    )


def _expert_transfers(
    c: _Common, ranks: list[int], spec: ShardSpec | None, bucket_bytes: int
) -> list[Transfer]:
    match = match_ours(c.name)
    (hf_name,), (shape,) = match.hf, hf_shapes(match, c.config)
    owners = c.first_replica(ranks, "edp", "ep")
    if len(owners) != c.layout.ep or (c.layout.ep > 1 and (spec is None or spec.group != "ep")):
        raise ValueError(f"{c.name}: {len(owners)} expert-parallel owners ({spec}), expected {c.layout.ep}")
    total, engine = c.config.num_experts, c.engine
    packed = engine.expert_format == "mxfp4" and match.rule.kind in ("fc1", "fc2")

    def sent(start: int, stop: int, whole: bool) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
        """Names and shapes sent for experts [start, stop): the HF tensor, or its MXFP4 blocks and scales."""
        part = (stop - start, *shape[1:])
        if not packed:
            return (hf_name if whole else expert_slice_name(hf_name, start, stop),), (part,)
        shapes = packed_shapes(part)
        if shapes is None:
            raise ValueError(f"{hf_name} {shape} cannot be MXFP4: its input width is not a multiple of 32")
        names = tuple(n if whole else expert_slice_name(n, start, stop) for n in _packed_names(hf_name))
        return names, shapes

    def transfer(names, shapes, sources, gather, experts, receivers) -> Transfer:
        return Transfer(
            c.name, names, shapes, "uint8" if packed else c.dtype, match.layer, "experts", sources, gather,
            experts, receivers, root=c.root(sources),
        )  # fmt: skip

    if not engine.expert_slices:
        everyone = tuple(range(engine.workers))
        names, shapes = sent(0, total, whole=True)
        return [transfer(names, shapes, owners, spec if len(owners) > 1 else None, None, everyone)]
    per_expert = sum(
        _aligned(_numel(s[1:]) * _DTYPE_BYTES["uint8" if packed else c.dtype]) for s in sent(0, 1, False)[1]
    )
    step = max(1, bucket_bytes // per_expert)
    edges = sorted(
        {0, total}
        | {total * i // c.layout.ep for i in range(c.layout.ep)}
        | {total * i // engine.ep for i in range(engine.ep)}
    )
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        owner = owners[lo * c.layout.ep // total]
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            names, shapes = sent(start, stop, whole=False)
            receivers = _expert_receivers(engine, start, stop, total)
            out.append(transfer(names, shapes, (owner,), None, (start, stop), receivers))
    return out


def _packed_names(hf_name: str) -> tuple[str, str]:
    """The MXFP4 blocks and scales names of an HF expert weight (as the released checkpoints name them)."""
    return hf_name + "_blocks", hf_name + "_scales"


def _expert_receivers(engine: EngineLayout, start: int, stop: int, total: int) -> tuple[int, ...]:
    parts = {
        p for p in range(engine.ep) if start < total * (p + 1) // engine.ep and stop > total * p // engine.ep
    }
    return tuple(w for w in range(engine.workers) if w % engine.ep in parts)


def _assign_buckets(transfers: list[Transfer], first: int, bucket_bytes: int) -> list[Transfer]:
    out, bucket, size = [], first, 0
    for t in transfers:
        if size and size + t.nbytes > bucket_bytes:
            bucket, size = bucket + 1, 0
        out.append(replace(t, bucket=bucket))
        size += t.nbytes
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN
