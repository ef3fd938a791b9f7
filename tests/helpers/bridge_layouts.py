"""Exports of one learner from several parallel layouts, run on pools of gloo ranks (`helpers.harness`).

The test process builds the learner (seeded, trained two steps) and hands its full weights to every rank;
each rank keeps its pipeline stages' shards (`parallelize`, `local_shard`), then all ranks run the
`WeightExporter` and rank 0 (the `dst`, the rank that feeds the engine) returns the HF tensors. Another
entry point measures each rank's peak extra memory during an export.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from helpers.harness import pool
from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import ModelConfig, ParallelConfig
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.pipeline import build_stage_model, stage_plans
from megatron_gptoss.parallel.sharding import get_shard, local_shard

# name -> (world size, Megatron-named layout)
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "ep2": (2, {"expert_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "tp2xep2xpp2": (
        8,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    ),
}
POOL_TIMEOUT = 600.0


def _stages(config: ModelConfig, state: dict[str, torch.Tensor], parallel: dict) -> tuple[list, ParallelDims]:
    cfg = ParallelConfig(**parallel)
    dims = ParallelDims.build(cfg, config)
    chunks = []
    with torch.no_grad():
        for plan in stage_plans(dims, config.num_layers):
            model = parallelize(build_stage_model(config, plan), dims, cfg)
            for name, p in model.named_parameters():
                p.copy_(local_shard(state[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
            chunks.append(model)
    return chunks, dims


def export_on_ranks(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    parallel: dict,
    engine: EngineLayout,
    bucket_bytes: int,
) -> list[tuple[str, torch.Tensor]]:
    """(Every rank) this rank's shards of `state`, exported; dst = rank 0 returns its (name, tensor) pairs."""
    chunks, dims = _stages(config, state, parallel)
    exporter = WeightExporter(chunks, config, dims, engine, bucket_bytes, dst=0)
    pairs = list(exporter.pairs())
    assert dims.rank == 0 or not pairs
    return pairs


def export_layout(
    name: str, config: ModelConfig, model: GPTOSSModel, engine: EngineLayout, bucket_bytes: int
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) stream dst receives when `model` is held in layout `name`."""
    world, parallel = LAYOUTS[name]
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    per_rank = pool(world).run(
        export_on_ranks, config, state, parallel, engine, bucket_bytes, timeout=POOL_TIMEOUT
    )
    return per_rank[0]


# ------------------------------------------------------------------------------------------------
# Memory
def _rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def measure_export_on_ranks(
    config: ModelConfig, parallel: dict, engine: EngineLayout, bucket_bytes: int
) -> dict[str, int]:
    """(Every rank) peak RSS growth of one export (buckets consumed and dropped on dst), after a first
    export that warms up lazily allocated state; allocations of 64 KiB and more are mmapped so that
    freed tensors leave the resident set at once. Also: the largest transfer this rank roots."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    state = {
        n: p.detach()
        for n, p in GPTOSSModel(config).init_weights(torch.Generator().manual_seed(0)).named_parameters()
    }
    chunks, dims = _stages(config, state, parallel)
    del state
    exporter = WeightExporter(chunks, config, dims, engine, bucket_bytes, dst=0)
    checksum = 0.0
    for bucket in exporter.buckets():  # warm-up
        checksum += sum(float(t.sum()) for _, t in bucket)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss()["VmRSS"]
    for bucket in exporter.buckets():
        checksum += sum(float(t.sum()) for _, t in bucket)
        del bucket
    peak = _rss()["VmHWM"] - before
    rooted = [t.nbytes for t in exporter.plan if t.root == dims.rank]
    return {"rank": dims.rank, "pid": os.getpid(), "peak": peak, "largest_rooted": max(rooted, default=0)}


def measure_layout(name: str, config: ModelConfig, engine: EngineLayout, bucket_bytes: int) -> list[dict]:
    world, parallel = LAYOUTS[name]
    return pool(world).run(
        measure_export_on_ranks, config, parallel, engine, bucket_bytes, timeout=POOL_TIMEOUT
    )
