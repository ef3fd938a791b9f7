"""The rollout buffer of the RL loop: batches sampled ahead of the learner, with bounded staleness.

The policy version v is the learner's weights after v optimizer steps; at step s the learner holds version
s - 1 and so does the engine (synced after every update). With `rollout.max_staleness: k`:

    take(s)   batch s   (submitted at an earlier step, or now) with the prompts and sampling seeds the
                        synchronous loop gives step s (`rollouts.draw_round`); with `rollout.partial` the
                        engine steps until its rows have stopped
              check     a row whose oldest token is more than k versions behind the learner is dropped and
                        generated again now, with the same prompt and seed (`staleness/dropped_rows`)
              ahead     the batches of steps s + 1 .. s + k not yet submitted, under the engine's version
                        now: generated and scored whole, or (partial) queued; then the next partial batch is
                        stepped to its end, the rows of later batches advancing alongside and pausing where
                        they are, to continue under the next weights (`rollout.partial_kv`: their prefix's
                        cache kept, or recomputed)
              -> batch s, its rows' per-token versions

So batch s was first sampled at version >= s - 1 - k and every trained token is at most k versions old;
k = 0 is the synchronous loop, call for call (the same prompts, seeds and engine calls).

Overlap (`RolloutBuffer.overlaps`: k >= 1 at a learner world of 1 with the embedded engine awake): the work
ahead runs in a thread while the learner computes log-probs and updates; the loop joins it (`wait`) before
the weights change. The work and its order are those of the sequential schedule (elsewhere it runs before the
learner starts), so the results are too, up to the rounding of kernels that split their work over the
threads they find free.

Separate placement (`trainer.separate`): with k >= 1 every batch is queued on the engine ranks, which step
its rows on their own while the learner computes and take new weights between two engine steps (without
`partial` a row ends under the weights it started with, before the new ones are loaded); the world of the
rules above is the learner ranks'. There `take(s)` queues the batches ahead before it waits for batch s:
the rows of batch s + 1 take the slots that batch s's rows leave as they stop, so the longest rows of a
batch do not leave the engine idle (they were sampled at version s - 1 and are trained at step s + 1: one
version old). Agentic trajectories there are generated whole (the agent loop on the learner ranks, every
turn a generation on the engine ranks): the batches ahead in the overlap's thread while the learner
computes, their tool calls included (a learner world of one rank), else before the learner starts. With
`partial` (one learner rank) each batch's trajectories have a thread of their own (`_InThread`), queued
at `take(s)` before batch s is waited for and running across the weight sync (`exclusive` keeps a turn from
falling between the new weights and their version): a trajectory waiting on a tool goes on under the new
weights, each turn generated again over the whole trajectory, each token recording its version.

Agentic rollouts (`agent.enabled`, partial): the engine's `start` / `advance` / `finish` run trajectories in
parts (`trainer.agentic.AgentRollout`); ahead of the learner every batch submitted samples its trajectories
up to their tool calls, which run while the learner updates; the trajectories go on under the new weights
at `take`, each token recording its version.

Checkpoints: the buffer is the task the cadence saves: its prompt stream's position is the one before the
first batch not yet trained, so a resumed run draws the batches in flight again (generated with the
resumed weights): no prompt of the data order is skipped or trained twice.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_gptoss.config import ConfigError, TrainConfig
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.trainer.rollouts import (
    Rollouts,
    batch_metrics,
    collect_rollouts,
    draw_round,
    score_round,
    seed_base,
)


@dataclass
class Submitted:
    """One data step's batch on its way to the learner."""

    step: int
    version: int  # the engine's policy version when it was submitted
    task_state: dict[str, Any]  # the task's prompt stream before the batch was drawn
    rows: list = field(default_factory=list)  # the task's prompt of each row (partial rollouts)
    params: SamplingParams | None = None  # row i samples from params.seed + i (partial rollouts)
    handle: Any = None  # the engine's rows in flight (partial rollouts)
    rollouts: Rollouts | None = None  # once generated and scored
    metrics: dict[str, float] = field(default_factory=dict)


def row_versions(generations: list[Generation], submitted: int) -> list[list[int]]:
    """The policy version of every response token: the engine's record, or the version the row was
    submitted under (an engine that records none samples a row under one version)."""
    return [
        list(g.versions) if g.versions is not None else [submitted] * len(g.token_ids) for g in generations
    ]


def stale_rows(versions: list[list[int]], version: int, max_staleness: int) -> list[int]:
    """Rows whose oldest token is more than `max_staleness` versions behind `version`."""
    return [i for i, v in enumerate(versions) if v and version - min(v) > max_staleness]


class RolloutBuffer:
    """The batches submitted and not yet trained. `engine`: anything with the hosts' collective
    `generate(prompts, params)` (the colocated setup, agentic rollouts); `host`: the embedded engine's host
    (`trainer.engines.EmbeddedHost`: `weights_changed`, and `start` / `finish` for partial rollouts), None
    for vLLM; with agentic partial rollouts the engine's own `start` / `advance` / `finish` /
    `weights_changed` serve them. Collective: every rank calls the same methods in the same order."""

    def __init__(self, cfg: TrainConfig, engine, host, task, sampling: SamplingParams):
        self.cfg, self.engine, self.host, self.task, self.sampling = cfg, engine, host, task, sampling
        if cfg.rollout.partial and host is None:
            raise ValueError("partial rollouts need the embedded engine's host")
        self.k, self.partial = cfg.rollout.max_staleness, cfg.rollout.partial
        remote = host is not None and host.decodes_ahead  # engine ranks of the separate placement
        # agentic partial rollouts through engine ranks: each batch's trajectories in a thread of their own,
        # turn by turn, across the weight syncs (`exclusive`)
        self.threaded = cfg.agent.enabled and self.partial and remote
        if self.threaded and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "rollout.partial=true with agent.enabled under rollout.placement='separate' needs one "
                f"learner rank (got {dist.get_world_size()}): its trajectories are generated beside it"
            )
        self.agentic = cfg.agent.enabled and self.partial and not remote  # engine sessions, in parts
        self.rows = engine if self.agentic else host  # what queues rows and is told of new weights
        self.pending: dict[int, Submitted] = {}
        self.version: int | None = None  # the engine's policy version as this buffer knows it
        # engine ranks that decode on their own (the separate placement) take the batches ahead before this
        # step's batch is finished, so that its longest rows do not leave the engine's other slots idle
        self.queues_early = remote and (not cfg.agent.enabled or self.threaded)
        # (queued early, nothing is left for a thread to do while the learner computes)
        self.overlap = self.overlaps(cfg, host) and not self.queues_early
        self._thread: _InThread | None = None
        self._busy_s = 0.0  # the engine's generation time since `busy_s` was last read

    # ------------------------------------------------------------------------------- the task's state
    def state_dict(self) -> dict[str, Any]:
        """The task's prompt stream before the first batch not yet trained."""
        if self.pending:
            return self.pending[min(self.pending)].task_state
        return self.task.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task.load_state_dict(state)

    def close(self) -> None:
        """Join the background generation (its error dropped: the run is ending), close the task."""
        handles = [self._thread, *(batch.handle for batch in self.pending.values())]
        for thread in handles:
            if isinstance(thread, _InThread):
                thread.join()
        self._thread = None
        self.task.close()

    def exclusive(self) -> AbstractContextManager:
        """Held across the learner's weight sync and `weights_are`: no turn of a threaded batch runs between
        the new weights and their version number (a no-op elsewhere)."""
        return self.host.lock if self.threaded else nullcontext()

    # ------------------------------------------------------------------------------------------------
    def take(self, step: int, last_step: int) -> tuple[Rollouts, list[list[int]], dict[str, float]]:
        """Batch `step` (learner and engine at version step - 1), the per-token versions of its rows, and
        its metrics (the reward metrics, `staleness/dropped_rows`, `buffer/depth`: rows submitted and not
        yet trained after this one). Batches up to `last_step` are submitted ahead; with `overlap` the
        batches ahead are generated in the background until `wait`."""
        self.wait()
        if self.host is not None and self.host.decodes_ahead:
            self.host.busy_s()  # the engine ranks' clock from here (evaluations between steps not counted)
        start = time.perf_counter()
        version = step - 1
        self.weights_are(version)
        if step not in self.pending:
            self._submit(step, version)
        batch = self.pending.pop(step)
        later = [a for a in range(step + 1, min(step + self.k, last_step) + 1) if a not in self.pending]
        if self.queues_early:  # the engine fills the slots this batch's last rows leave free
            for ahead in later:
                self._submit(ahead, version)
            later = []
        self._complete(batch)
        assert batch.rollouts is not None
        rollouts, metrics = batch.rollouts, dict(batch.metrics)
        versions = row_versions(rollouts.generations, batch.version)
        dropped = stale_rows(versions, version, self.k)
        if dropped:
            rollouts, versions = self._resubmit(batch, dropped, versions, version)
            metrics.update(batch_metrics(self.cfg, rollouts))
        metrics["staleness/dropped_rows"] = float(len(dropped))
        rows = self.cfg.rollout.prompts_per_step * self.cfg.rollout.n_samples_per_prompt
        depth = sum(self._rows(b) for b in self.pending.values()) + rows * len(later)
        metrics["buffer/depth"] = float(depth)
        if self.overlap:
            self._busy_s += time.perf_counter() - start
            self._background(later, version)
        else:
            self._ahead(later, version)
            self._busy_s += time.perf_counter() - start
        return rollouts, versions, metrics

    def _complete(self, batch: Submitted) -> None:
        """A partial batch's rows stepped to their end (a threaded batch's thread joined) and scored."""
        if batch.rollouts is None:
            if isinstance(batch.handle, _InThread):
                generations = batch.handle.result()
            else:
                generations = self.rows.finish(batch.handle)
            batch.rollouts = score_round(self.cfg, self.task, batch.rows, generations)
            batch.metrics = batch_metrics(self.cfg, batch.rollouts)

    def _ahead(self, later: list[int], version: int) -> None:
        """The engine's work while the learner trains: submit the batches `later` (generated whole, or
        queued), and step the next partial batch to its end (the rows of later batches advance alongside and
        pause there, to continue under the next weights); agentic: every pending batch's trajectories
        up to their tool calls. Engine ranks of the separate placement step the queued rows on their own
        (`host.decodes_ahead`): nothing is stepped from here."""
        for ahead in later:
            self._submit(ahead, version)
        if self.agentic:
            for batch in sorted(self.pending):
                self.rows.advance(self.pending[batch].handle)
        elif self.partial and self.pending and not self.host.decodes_ahead:
            self._complete(self.pending[min(self.pending)])

    def _background(self, later: list[int], version: int) -> None:
        """`_ahead` in a thread while the learner computes; `wait` joins it. On a GPU the thread queues its
        kernels on the learner's stream (the engine's memory is never used by two streams unordered): the
        host's work overlaps, the device runs both in order."""

        def work() -> None:
            start = time.perf_counter()
            try:
                self._ahead(later, version)
            finally:
                self._busy_s += time.perf_counter() - start

        self._thread = _InThread(work, self.host.device, "rollouts-ahead")

    def wait(self) -> None:
        """Join the background generation (before the engine's weights change, a checkpoint or an
        evaluation); its error, if any, raised here."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.result()

    def busy_s(self) -> float:
        """Seconds the engine generated (in `take` and in the background) since the last call; under the
        separate placement the engine ranks' own clock (collective)."""
        busy, self._busy_s = self._busy_s, 0.0
        if self.host is not None and self.host.decodes_ahead:  # the engine ranks clock their own work
            return self.host.busy_s()
        return busy

    @staticmethod
    def overlaps(cfg: TrainConfig, host) -> bool:
        """Whether the batches ahead are generated in a thread while the learner computes: k >= 1, a world
        of one rank (the engine's generation then makes no collective that could interleave with the
        learner's), the embedded engine, an engine that stays awake, and agentic rollouts only on the
        engine ranks of the separate placement (their trajectories, generated whole turn by turn, and their
        tool calls then run beside the learner; in the colocated placement the trajectories' sessions
        share the learner's device)."""
        r = cfg.rollout
        world = dist.get_world_size() if dist.is_initialized() else 1
        return (
            r.max_staleness > 0
            and world == 1
            and host is not None
            and (not cfg.agent.enabled or host.decodes_ahead)
            and not r.sleep_level
        )

    def _rows(self, batch: Submitted) -> int:
        if batch.rollouts is not None:
            return len(batch.rollouts.generations)
        return len(batch.rows)

    def weights_are(self, version: int) -> None:
        """The engine holds `version` now: recorded with its tokens; rows in flight continue under it."""
        if version == self.version:
            return
        if self.host is not None:
            recompute = self.partial and self.cfg.rollout.partial_kv == "recompute"
            self.rows.weights_changed(version, recompute and self.version is not None)
        self.version = version

    def _submit(self, step: int, version: int) -> None:
        state = self.task.state_dict()
        # engine ranks of the separate placement decode queued rows while the learner computes (without
        # `partial` they finish them under the weights they started with, `trainer.separate`); agentic
        # trajectories there are generated whole, turn by turn through the engine ranks
        queued = self.partial or (
            self.k > 0 and self.host is not None and self.host.decodes_ahead and not self.cfg.agent.enabled
        )
        if not queued:
            rollouts, metrics = collect_rollouts(self.cfg, self.engine, self.task, self.sampling, step)
            self.pending[step] = Submitted(step, version, state, rollouts=rollouts, metrics=metrics)
            return
        rows, params = draw_round(self.cfg, self.task, self.sampling, step, 0)
        prompts = [list(p.token_ids) for p in rows]
        if self.threaded:
            generate = functools.partial(self.engine.generate, prompts, params)
            handle: Any = _InThread(generate, self.host.device, f"trajectories-{step}")
        else:
            handle = self.rows.start(prompts, params)
        self.pending[step] = Submitted(step, version, state, rows, params, handle)

    def _resubmit(
        self, batch: Submitted, dropped: list[int], versions: list[list[int]], version: int
    ) -> tuple[Rollouts, list[list[int]]]:
        """Rows `dropped` generated again now (same prompt, same seed stream: row i of the step samples
        from `seed_base + i`), the batch scored again; the new rows' versions."""
        rollouts = batch.rollouts
        assert rollouts is not None
        base = seed_base(self.cfg, batch.step, 0, len(rollouts.prompts))
        generations = list(rollouts.generations)
        for i in dropped:
            params = SamplingParams(**{**self.sampling.__dict__, "seed": base + i})
            generations[i] = self.engine.generate([list(rollouts.prompts[i].token_ids)], params)[0]
        rescored = score_round(self.cfg, self.task, rollouts.prompts, generations)
        fresh = row_versions(generations, version)
        return rescored, [fresh[i] if i in dropped else v for i, v in enumerate(versions)]


class _InThread:
    """`fn()` in a thread of its own, on `device` where that is a GPU (the current device is per thread);
    `result` joins it and returns its value, or raises its error in the caller's thread; `join` only
    joins."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, name: str):
        self.value: Any = None
        self.error: BaseException | None = None

        def work() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                self.value = fn()
            except BaseException as err:  # re-raised by result()
                self.error = err

        self.thread = threading.Thread(target=work, name=name, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def result(self) -> Any:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def idle_fractions(step_s: float, engine_s: float, learner_s: float) -> dict[str, float]:
    """`idle/engine_frac` and `idle/learner_frac`: the share of the step's wall time each side did not
    work (the engine generating; the learner computing log-probs and updating)."""
    step_s = max(step_s, 1e-9)
    return {
        "idle/engine_frac": max(0.0, 1.0 - engine_s / step_s),
        "idle/learner_frac": max(0.0, 1.0 - learner_s / step_s),
    }
