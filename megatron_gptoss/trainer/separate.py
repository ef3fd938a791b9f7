"""The separate placement (`rollout.placement: separate`): engine ranks and learner ranks.

    ranks      `rollout.engine_ranks` (default: the last rank) host only the embedded engine; the other ranks
               host only the learner. Each side runs with its own group as the default process group
               (`world_of`), so the learner's layout (data parallel size, every process group), checkpoints
               and metrics span the learner ranks alone, numbered from 0, and the engine's replicas
               (`rollout.tensor_parallel_size` x `rollout.expert_parallel_size` ranks each) the engine ranks.
    commands   the learner calls the engines through `EngineClient` (the interface of
               `trainer.engines.EmbeddedHost`): a call is a broadcast over the whole world from learner
               rank 0, answered by a broadcast from the first engine rank, so every learner rank gets the
               rows (token ids, engine log-probs, per-token policy versions, recorded routing) without a
               learner collective.
    weights    after every update learner rank 0 gathers the full HF tensors bucket by bucket
               (`bridge.export.WeightExporter`) and sends them over a group of learner rank 0 and the engine
               ranks: what every engine rank takes in one broadcast a bucket, and (engine expert parallel
               > 1) each expert slice only to the engine ranks whose expert part holds it; every engine rank
               keeps the shard its layout holds.
    decoding   rows queued by `start` (partial rollouts) go on decoding on the engine ranks between commands
               (`trainer.engine_process`: a thread steps them one engine step at a time under a lock, where
               each engine rank is a whole replica; the engine in the rank's process or in a child process):
               the batch ahead is sampled while the learner computes. A weight sync is received meanwhile and
               loaded between two engine steps; the engine then waits for the new version's number before it
               steps again, so every token records the policy that sampled it.

               learner ranks                                   engine ranks
      take(s)  start(batch s + 1) ---------------------------> queued: its rows take the slots that
               finish(batch s) ------------------------------> batch s's rows free, until these end
               <---------- rows, log-probs, per-token versions
                                                               batch s + 1 decoding under version s - 1 ...
      prepare, update                                          ... while the learner computes
      sync     weight buckets (learner rank 0) --------------> loaded between two engine steps
               version s ------------------------------------> the rows in flight continue under it

`rollout.max_staleness` and the rollout buffer (`trainer.rollout_buffer`) bound the versions as in the
colocated placement; with k = 0 the engine generates each batch when the learner asks for it, and the run
equals the colocated one at the learner's world size (the same prompts, seeds, weights and engine calls).
"""

from __future__ import annotations

import itertools
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import ParallelConfig, RolloutConfig, TrainConfig
from megatron_gptoss.engine_api.buckets import pack, unpack
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams, parse_expert_slice
from megatron_gptoss.errors import ConfigError, EngineError, LayoutError
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.parallel.dims import ParallelDims, validate_layout
from megatron_gptoss.trainer.engine_process import ChildEngine, EngineCore
from megatron_gptoss.trainer.engines import DTYPES, engine_model_config
from megatron_gptoss.trainer.session import Session

Pairs = list[tuple[str, torch.Tensor]]


def placement_ranks(cfg: TrainConfig, world: int) -> tuple[list[int], list[int]]:
    """(engine ranks, learner ranks) of a world of `world` ranks under `rollout.placement: separate`; a
    ConfigError naming the setting when the world, the ranks or a layout does not fit."""
    rollout: RolloutConfig = cfg.rollout
    if world < 2:
        raise ConfigError(
            f"rollout.placement='separate' needs a world of at least 2 ranks (an engine rank and a learner "
            f"rank), got {world}"
        )
    engines = list(rollout.engine_ranks) or [world - 1]
    outside = [r for r in engines if not 0 <= r < world]
    if outside:
        raise ConfigError(f"rollout.engine_ranks={engines}: ranks {outside} are not in a world of {world}")
    if len(set(engines)) != len(engines):
        raise ConfigError(f"rollout.engine_ranks={engines} names a rank twice")
    learners = [r for r in range(world) if r not in engines]
    if not learners:
        raise ConfigError(f"rollout.engine_ranks={engines} leaves no learner rank in a world of {world}")
    engine_layout = ParallelConfig(
        tensor_model_parallel_size=rollout.tensor_parallel_size,
        expert_model_parallel_size=rollout.expert_parallel_size,
    )
    for side, parallel, ranks in (("learner", cfg.parallel, learners), ("engine", engine_layout, engines)):
        try:
            validate_layout(parallel, cfg.model, len(ranks))
        except LayoutError as err:
            raise ConfigError(
                f"rollout.placement='separate': the {side}'s {len(ranks)} ranks {ranks} do not fit its "
                f"layout: {err}"
            ) from err
    return sorted(engines), learners


@contextmanager
def world_of(group: dist.ProcessGroup) -> Iterator[None]:
    """`group` is the default process group inside (its ranks numbered from 0: `dist.get_rank()`, new
    groups, collectives without a group); the whole world again after. Groups made inside are valid only
    inside; groups of the whole world are used inside with group ranks (`group_src`), never global ones."""
    saved = c10d._world.default_pg
    c10d._world.default_pg = group
    try:
        yield
    finally:
        c10d._world.default_pg = saved


@dataclass
class Placement:
    """This rank's side and the groups between the sides (made over the whole world, before the split)."""

    engines: list[int]
    learners: list[int]
    rank: int  # this rank in the whole world
    is_engine: bool
    world: dist.ProcessGroup  # every rank: commands and rollouts (group ranks are global ranks)
    own: dist.ProcessGroup  # this side's ranks: its default group inside `world_of`
    weights: dist.ProcessGroup | None  # learner rank 0 and the engine ranks (None on other learner ranks)
    weights_members: list[int]  # the global ranks of `weights`, in its rank order
    engine_ep: int  # rollout.expert_parallel_size: engine rank i holds expert part i % engine_ep
    num_experts: int

    @classmethod
    def split(cls, cfg: TrainConfig) -> Placement:
        """The placement of the default group's ranks (collective over it)."""
        rank = dist.get_rank()
        engines, learners = placement_ranks(cfg, dist.get_world_size())
        world = dist.group.WORLD
        assert world is not None
        learner_group, engine_group = dist.new_group(learners), dist.new_group(engines)
        members = sorted([learners[0], *engines])
        weights = dist.new_group(members)
        is_engine = rank in engines
        return cls(
            engines,
            learners,
            rank,
            is_engine,
            world,
            engine_group if is_engine else learner_group,
            weights if rank in members else None,
            members,
            cfg.rollout.expert_parallel_size,
            cfg.model.num_experts,
        )

    @property
    def weights_src(self) -> int:
        """Learner rank 0's rank in `weights`."""
        return self.weights_members.index(self.learners[0])

    # ------------------------------------------------------------------ commands over the whole world
    def send(self, command: tuple) -> None:
        """Learner ranks: learner rank 0's `command` to every rank."""
        dist.broadcast_object_list([command], group=self.world, group_src=self.learners[0])

    def receive(self) -> tuple:
        """Engine ranks: the next command of learner rank 0."""
        box: list = [None]
        dist.broadcast_object_list(box, group=self.world, group_src=self.learners[0])
        return box[0]

    def answer(self, ok: bool, value: Any) -> None:
        """Engine ranks: the first engine rank's answer to every rank."""
        dist.broadcast_object_list([(ok, value)], group=self.world, group_src=self.engines[0])

    def reply(self) -> Any:
        """Learner ranks: the engines' answer; an EngineError when the engine failed."""
        box: list = [None]
        dist.broadcast_object_list(box, group=self.world, group_src=self.engines[0])
        ok, value = box[0]
        if not ok:
            raise EngineError(f"the engine ranks {self.engines} failed:\n{value}")
        return value

    def call(self, *command: Any) -> Any:
        self.send(command)
        return self.reply()

    # ------------------------------------------------------------------ weight buckets
    def send_buckets(self, buckets: Iterator[Pairs], device: torch.device) -> None:
        """Learner ranks: every rank iterates the (collective) export; learner rank 0 sends each bucket to
        the engine ranks, then an end mark: the tensors every engine rank needs packed in one broadcast, and
        an expert slice (`engine_ep` > 1) only to the engine ranks whose expert part holds it (one packed
        send each)."""
        for pairs in buckets:
            if self.weights is None or not pairs:
                continue
            common: Pairs = []
            own: dict[int, Pairs] = {}
            for name, tensor in pairs:
                holders = self._holders(name)
                if holders is None:
                    common.append((name, tensor.to(device)))
                for i in holders or ():
                    own.setdefault(i, []).append((name, tensor.to(device)))
            packed = {i: pack(p) for i, p in own.items()}
            buffer, metas = pack(common) if common else (None, None)
            sizes = {i: (m, b.numel()) for i, (b, m) in packed.items()}
            self._header([metas, 0 if buffer is None else buffer.numel(), sizes])
            if buffer is not None:
                dist.broadcast(buffer, group=self.weights, group_src=self.weights_src)
            for i, (b, _) in packed.items():
                dist.send(b, group=self.weights, group_dst=self.weights_members.index(self.engines[i]))
        if self.weights is not None:
            self._header([None, 0, None])

    def receive_buckets(self, device: torch.device) -> Iterator[Pairs]:
        """Engine ranks: learner rank 0's buckets (what this rank's engine needs of each, in buffers of its
        own), until the end mark."""
        me = self.engines.index(self.rank)
        while True:
            header: list = [None, 0, None]
            self._header(header)
            metas, size, sizes = header
            if sizes is None:
                return
            pairs: Pairs = []
            if metas is not None:
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
                dist.broadcast(buffer, group=self.weights, group_src=self.weights_src)
                pairs += unpack(buffer, metas)
            if me in sizes:
                own_metas, own_size = sizes[me]
                buffer = torch.empty(own_size, dtype=torch.uint8, device=device)
                dist.recv(buffer, group=self.weights, group_src=self.weights_src)
                pairs += unpack(buffer, own_metas)
            yield pairs

    def _holders(self, name: str) -> list[int] | None:
        """The engine ranks (indices into `engines`) whose expert part holds an expert slice `name`; None for
        a tensor every engine rank takes."""
        sliced = parse_expert_slice(name)
        if sliced is None or self.engine_ep == 1:
            return None
        _, start, stop = sliced
        total, ep = self.num_experts, self.engine_ep
        parts = {p for p in range(ep) if start < total * (p + 1) // ep and stop > total * p // ep}
        return [i for i in range(len(self.engines)) if i % ep in parts]

    def _header(self, header: list) -> None:
        assert self.weights is not None
        dist.broadcast_object_list(header, group=self.weights, group_src=self.weights_src)


class EngineClient:
    """The learner's view of the engine ranks, with `EmbeddedHost`'s interface; every call is collective over
    the learner ranks (all of them call it, in the same order) and answered by the engine ranks. `sync`
    returns `sync/bytes` (what the first engine rank received), `engine/sync_bytes_total` (what all engine
    ranks received) and `engine/restarts` (engine processes started again so far, over all engine ranks)."""

    decodes_ahead = True  # rows queued by `start` advance on the engine ranks without `finish`

    def __init__(
        self,
        cfg: TrainConfig,
        models: Sequence[GPTOSSModel],
        dims: ParallelDims,
        device: torch.device,
        placement: Placement,
    ):
        self.placement, self.device = placement, device
        # one command at a time: a thread generating trajectories ahead (`trainer.rollout_buffer`) calls
        # beside the learner's sync; `lock` held across a sync and its version keeps every turn under one
        self.lock = threading.RLock()
        engines, ep = len(placement.engines), cfg.rollout.expert_parallel_size
        layout = EngineLayout(engines, ep, True, expert_format=engine_model_config(cfg, False).expert_format)
        self.exporter = WeightExporter(  # full HF tensors on learner rank 0, bucket by bucket
            models, cfg.model, dims, layout, cfg.rollout.bucket_size_mb << 20, 0, DTYPES[cfg.rollout.dtype]
        )

    def sync(self) -> dict[str, float]:
        with self.lock:
            self.placement.send(("sync",))
            self.placement.send_buckets(self.exporter.buckets(), self.device)
            received, restarts, total = self.placement.reply()
        return {
            "sync/bytes": float(received),
            "engine/restarts": float(restarts),
            "engine/sync_bytes_total": float(total),
        }

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._call("generate", prompts, params)

    def start(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Queue the rows on the engine ranks (they decode from now on); a handle for `finish`."""
        return self._call("start", prompts, params)

    def finish(self, handle: int) -> list[Generation]:
        return self._call("finish", handle)

    def weights_changed(self, version: int, recompute: bool) -> None:
        self._call("version", version, recompute)

    def busy_s(self) -> float:
        """Seconds the engine ranks generated since the last call (the first engine rank's clock)."""
        return float(self._call("busy"))

    def _call(self, op: str, *args: Any) -> Any:
        with self.lock:
            return self.placement.call(op, *args)

    def sleep(self, level: int) -> dict[str, float]:
        return {}  # the engine ranks hold no learner to make room for

    def wake(self) -> dict[str, float]:
        return {}

    def step_stats(self) -> dict[str, float]:
        return {}  # the engine ranks keep their steps (`idle/engine_frac` counts their time)

    def shutdown(self) -> None:
        """Nothing here: the engine ranks stop with the run's result (`run_separate`)."""


class EngineServer:
    """An engine rank: answers the learner's commands with its engine (`trainer.engine_process`: in this
    process, or in a child process it supervises with `rollout.engine_child`). Built inside
    `world_of(placement.own)`."""

    def __init__(self, cfg: TrainConfig, run_session: Session, placement: Placement):
        self.placement, self.session = placement, run_session
        device = run_session.device
        self.core: EngineCore | ChildEngine = (
            ChildEngine(cfg, device) if cfg.rollout.engine_child else EngineCore(cfg, device)
        )
        self.ids = itertools.count()

    def serve(self) -> Any:
        """Answer commands until the learner's stop; the run's result it carries."""
        core = self.core
        handlers: dict[str, Callable[..., Any]] = {
            "generate": core.generate,
            "start": self._start,
            "finish": core.finish,
            "sync": self._sync,
            "version": core.version,
            "busy": core.busy,
        }
        count = 0
        try:
            while True:
                op, *args = self.placement.receive()
                count += 1
                self.session.beat(count)
                if op == "stop":
                    return args[0]
                try:
                    value, ok = handlers[op](*args), True
                except Exception:  # the learner raises it as an EngineError
                    value, ok = traceback.format_exc(), False
                self.placement.answer(ok, value)
        finally:
            core.close()

    def _start(self, prompts: list[list[int]], params: SamplingParams) -> int:
        handle = next(self.ids)
        self.core.start(handle, prompts, params)
        return handle

    def _sync(self) -> tuple[int, int, int]:
        """The learner's buckets, received while the rows in flight go on decoding under the old weights,
        then loaded between two engine steps; (bytes this rank received, engine restarts so far and bytes
        received, over all engine ranks)."""
        device = self.session.device
        buckets = list(self.placement.receive_buckets(device))
        self.core.load(buckets)
        received = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        totals = torch.tensor([getattr(self.core, "restarts", 0), received], device=device)
        dist.all_reduce(totals)  # over the engine ranks
        return received, int(totals[0]), int(totals[1])


def run_separate(cfg: TrainConfig, run_session: Session, train: Callable[[Placement], Any]) -> Any:
    """The run under `rollout.placement: separate` (collective over the whole world): learner ranks run
    `train(placement)` with the learner ranks as their world, engine ranks serve it; every rank returns the
    learner's result. A learner error stops the engine ranks with an EngineError."""
    placement = Placement.split(cfg)
    if placement.is_engine:
        with world_of(placement.own):
            result = EngineServer(cfg, run_session, placement).serve()
        if result is None:
            raise EngineError(f"the learner ranks {placement.learners} ended with an error")
    else:
        try:
            with world_of(placement.own):
                result = train(placement)
        except BaseException:
            placement.send(("stop", None))
            raise
        placement.send(("stop", result))
    align_group_names(placement.world)
    return result


def align_group_names(world: dist.ProcessGroup) -> None:
    """Groups are named by a per-process count of the groups made; each side made its own, so the counts
    are set to their largest (collective over `world`), and groups made over the whole world later (another
    run in the same processes) have the same name on every rank."""
    counts: list = [None] * world.size()
    dist.all_gather_object(counts, c10d._world.group_count, group=world)
    c10d._world.group_count = max(counts)
