"""The rollout engine as the trainer sees it, at any world size: every call is collective over the world and
returns the same result on every rank; `sync` feeds the learner's weights through the bridge.

    EmbeddedHost   every rank hosts a shard of the embedded engine (`rollout.tensor_parallel_size` x
                   `rollout.expert_parallel_size`, replicas over the rest); replica r generates its block of
                   rows and the generations are gathered. Sync: the fan-out bridge, each rank receiving only
                   what its shard holds. At world 1 this is one engine with one shard.
                   LoRA (`shares_base`: the engine's layout is the learner's, pipeline parallel 1, one
                   dtype): the engine uses the learner's frozen base shards themselves (never writing,
                   moving or freeing them) and holds its own copy of the adapters; the sync copies this
                   rank's adapter shards, no communication. Otherwise the bridge sends merged weights.
                   `sync` returns `sync/bytes`, what this rank's engine shard received.
    VLLMHost       rank 0 hosts a vLLM engine (its own `rollout.tensor_parallel_size` workers); the bridge's
                   export gathers full HF tensors (expert ranges as slices) on rank 0 in size-bounded buckets;
                   rank 0 generates every row and broadcasts the generations.

Seeded sampling gives row i of a request the stream seed + i (`rollout.sampling`) on either engine, so the
rollouts of a step do not depend on the engine layout, and a resumed run samples what an uninterrupted one
would.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.fanout import FanoutExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.bridge.transport import sync_in_process
from megatron_gptoss.config import ModelConfig, ParallelConfig, TrainConfig
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.lora import base_config, is_adapter_param
from megatron_gptoss.model.mxfp4_weight import frozen_base
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine
from megatron_gptoss.trainer.session import from_rank0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shares_base(cfg: TrainConfig) -> bool:
    """Whether the embedded engine of a LoRA run can use the learner's frozen base shards as they are: same
    tensor and expert parallel sizes, no pipeline stages, the same parameter dtype."""
    p, r = cfg.parallel, cfg.rollout
    return (
        cfg.model.lora.enabled
        and r.engine == "embedded"
        and p.pipeline_model_parallel_size == 1
        and p.virtual_pipeline_model_parallel_size == 1
        and p.tensor_model_parallel_size == r.tensor_parallel_size
        and p.expert_model_parallel_size == r.expert_parallel_size
        and cfg.run.dtype == r.dtype
        and (r.expert_format == "bf16" or cfg.model.expert_format == "mxfp4")
    )


def engine_model_config(cfg: TrainConfig, shared: bool) -> ModelConfig:
    """The embedded engine's model config: the learner's (a shared LoRA base), or without adapters (merged
    weights); MXFP4 experts with `rollout.expert_format: mxfp4` (the bridge quantizes them at every sync)."""
    config = cfg.model if shared else base_config(cfg.model)
    if cfg.rollout.expert_format == "mxfp4":
        config = dataclasses.replace(config, expert_format="mxfp4")
    return config


class EmbeddedHost:
    """This rank's shard of the embedded engine and the fan-out from the learner's stage models. With no
    `models` (an engine rank of `rollout.placement: separate`, `trainer.separate`) it hosts the engine
    alone, over the ranks of the current default group, and the weights arrive from elsewhere."""

    decodes_ahead = False  # rows queued by `start` advance only in `finish` (and other engine calls)

    def __init__(self, cfg: TrainConfig, models: Sequence[GPTOSSModel], dims: ParallelDims | None, device):
        self.dims, self.models, self.device = dims, models, device
        self.engine_dims = edims = ParallelDims.build(
            ParallelConfig(
                tensor_model_parallel_size=cfg.rollout.tensor_parallel_size,
                expert_model_parallel_size=cfg.rollout.expert_parallel_size,
            ),
            cfg.model,
        )
        self.replica = edims.coord("dp")
        options = cfg.embedded
        if cfg.moe.router_replay == "r3":  # the learner replays the experts the engine chose
            options = dataclasses.replace(options, record_routing=True)
        self.shared = shares_base(cfg) and bool(models)
        # the parameters but the adapters, and any MXFP4 experts' buffers
        base = frozen_base(models[0]) if self.shared else None
        engine_model = engine_model_config(cfg, self.shared)
        self.engine = ParallelEmbeddedEngine(  # LoRA: the shared base and adapters, or the merged weights
            engine_model,
            edims,
            DTYPES[cfg.rollout.dtype],
            device,
            cfg.run.seed,
            options,
            shared=base,
        )
        self.exporter = None
        if not self.shared and dims is not None:
            self.exporter = FanoutExporter(
                models,
                cfg.model,
                dims,
                EngineLayout(dims.layout.world, edims.ep, True, expert_format=engine_model.expert_format),
                cfg.rollout.bucket_size_mb << 20,
                dtype=DTYPES[cfg.rollout.dtype],
            )

    def sync(self) -> dict[str, float]:
        """The learner's weights into every engine shard (collective); `sync/bytes` this rank's shard got."""
        if self.exporter is None:  # the shared base stays; this rank's adapter shards are copied
            adapters = {n: p.detach() for n, p in self.models[0].named_parameters() if is_adapter_param(n)}
            return {"sync/bytes": float(self.engine.update_adapters(adapters))}
        received = [0]

        def counted(buckets):
            for bucket in buckets:
                received[0] += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        sync_in_process(counted(self.exporter.buckets()), self.engine, is_dst=True)
        return {"sync/bytes": float(received[0])}

    def sleep(self, level: int) -> dict[str, float]:
        """Free this rank's engine memory (`rollout.sleep_level`); the bytes released (local)."""
        released = self.engine.sleep(level)
        return {
            "engine/kv_cache_gib": released["kv_cache_bytes"] / 2**30,
            "engine/weights_gib": released["weight_bytes"] / 2**30,
            "engine/device_freed_gib": released["device_bytes_freed"] / 2**30,
        }

    def wake(self) -> dict[str, float]:
        """Take the weights' memory back before the sync (the KV cache returns with the next request)."""
        return {"engine/device_taken_gib": self.engine.wake_up()["device_bytes_taken"] / 2**30}

    def step_stats(self) -> dict[str, float]:
        """This rank's engine steps since the last call (`EmbeddedEngine.take_stats`: the mean decode step,
        rows per decode step, graph replays, prefill seconds); local."""
        return self.engine.take_stats()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Every row's generation on every rank: replica r generates its block of rows."""
        return self.by_replica(prompts, params, self.engine.generate)

    def by_replica(self, prompts: list[list[int]], params: SamplingParams, generate: Callable) -> list:
        """`generate(rows, params)` of replica r on its block of rows (row i keeps the seed stream
        `params.seed + i`), every replica's results gathered on every rank in row order (collective)."""
        rows, params, wanted = self._split(prompts, params)
        return self._gather(generate(rows, params) if rows else [], wanted)

    def _split(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], SamplingParams, int]:
        """This replica's block of rows, their sampling parameters (the block's first row's seed stream) and
        the number of rows asked for."""
        replicas, wanted = self.engine_dims.dp, len(prompts)
        tp, ep = self.engine_dims.tp, self.engine_dims.ep
        if 0 < wanted < replicas and math.lcm(tp, ep) > tp:
            # the tp groups of an expert-parallel block step together: each gets a row, extras dropped
            prompts = prompts + [prompts[0]] * (replicas - wanted)
        rows = torch.tensor_split(torch.arange(len(prompts)), replicas)[self.replica].tolist()
        if params.seed is not None and rows:  # row i keeps its stream (seed + i) whatever the split
            params = dataclasses.replace(params, seed=params.seed + rows[0])
        return [prompts[i] for i in rows], params, wanted

    def _gather(self, mine: list, wanted: int) -> list:
        """Every replica's results on every rank, in row order, the first `wanted` (collective)."""
        if self.engine_dims.layout.world == 1:
            return mine
        gathered: list = [None] * self.engine_dims.layout.world
        dist.all_gather_object(gathered, (self.replica, self.engine_dims.coord("tp"), mine))
        by_replica = {r: gens for r, tp_rank, gens in gathered if tp_rank == 0}
        return [g for r in range(self.engine_dims.dp) for g in by_replica[r]][:wanted]

    # ------------------------------------------------------------------------- partial rollouts
    def start(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
        """Queue the rows (replica r its block) without waiting for them; a handle for `finish`
        (collective)."""
        rows, params, wanted = self._split(prompts, params)
        return (self.engine.start(rows, params) if rows else []), wanted

    def finish(self, handle: tuple[list, int]) -> list[Generation]:
        """Step the engines until every row of `handle` has stopped (rows of other handles advance
        alongside); the rows' generations on every rank, in row order (collective)."""
        seqs, wanted = handle
        return self._gather(self.engine.finish(seqs), wanted)

    def weights_changed(self, version: int, recompute: bool) -> None:
        """The engine now holds the policy of `version` (recorded with every token it samples from now on);
        with `recompute` the rows in flight prefill their prefix again under it."""
        self.engine.policy_version = version
        if recompute:
            self.engine.recompute_in_flight()

    def shutdown(self) -> None:
        self.engine.shutdown()


class VLLMHost:
    """A vLLM engine on rank 0 fed by the bridge's export to rank 0 (every rank takes part in the export)."""

    def __init__(self, cfg: TrainConfig, models: Sequence[GPTOSSModel], dims: ParallelDims, device):
        self.dims, self.rank = dims, dims.rank
        self.engine = None
        if self.rank == 0:  # vLLM is an optional dependency: imported where it is used
            from megatron_gptoss.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(
                base_config(cfg.model),
                sleep_level=max(cfg.rollout.sleep_level, 1),
                tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                dtype=cfg.rollout.dtype,
                seed=cfg.run.seed + 1,
                max_model_len=cfg.model.max_position_embeddings,
                bucket_bytes=cfg.rollout.bucket_size_mb << 20,
            )
        self.exporter = WeightExporter(
            models,
            cfg.model,
            dims,
            EngineLayout(workers=cfg.rollout.tensor_parallel_size, expert_slices=True),
            cfg.rollout.bucket_size_mb << 20,
            dst=0,
            dtype=DTYPES[cfg.rollout.dtype],
        )

    def sync(self) -> dict[str, float]:
        """The learner's weights, gathered on rank 0 bucket by bucket, into the vLLM engine (collective)."""
        buckets = self.exporter.buckets()
        if self.engine is None:
            for _ in buckets:  # every rank of the learner takes part in each bucket's gather
                pass
            return {}
        self.engine.update_weights(pair for bucket in buckets for pair in bucket)
        return {}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return from_rank0(self.engine.generate(prompts, params) if self.engine is not None else None)

    def sleep(self, level: int) -> dict[str, float]:
        """vLLM's sleep mode on rank 0 where its platform has one (its own accounting: nothing logged)."""
        if self.engine is not None:
            self.engine.sleep()
        return {}

    def wake(self) -> dict[str, float]:
        if self.engine is not None:
            self.engine.wake_up()
        return {}

    def step_stats(self) -> dict[str, float]:
        return {}  # vLLM keeps its own statistics

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def make_engine_host(cfg: TrainConfig, models: Sequence[GPTOSSModel], dims: ParallelDims, device):
    """The host of `rollout.engine` ("embedded" or "vllm") over the learner's `models` (collective)."""
    if cfg.rollout.engine == "vllm":
        return VLLMHost(cfg, models, dims, device)
    return EmbeddedHost(cfg, models, dims, device)
