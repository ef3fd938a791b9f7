"""The rollout buffer of the RL loop: batches sampled ahead of the learner, with bounded staleness.

The policy version v is the learner's weights after v optimizer steps; at step s the learner holds version
s - 1 and so does the engine (synced after every update). With `rollout.max_staleness: k`:

    take(s)   submit    the batches of data steps s .. s + k not yet submitted, each with the prompts and
                        sampling seeds the synchronous loop gives that step (`rollouts.draw_round`), under
                        the engine's version now; without partial rollouts each batch is generated and
                        scored whole at once
              finish    (`rollout.partial`) the engine steps until batch s's rows have stopped; the rows of
                        later batches advance alongside and pause where they are, to continue under the next
                        weights (`rollout.partial_kv`: their prefix's cache kept, or recomputed)
              check     a row whose oldest token is more than k versions behind the learner is dropped and
                        generated again now, with the same prompt and seed (`staleness/dropped_rows`)
              -> batch s, its rows' per-token versions

So batch s was first sampled at version >= s - 1 - k and every trained token is at most k versions old;
k = 0 is the synchronous loop, call for call (the same prompts, seeds and engine calls). Colocated, the
batches ahead are generated while the learner waits: the schedule of an engine that runs beside it.

Checkpoints: the buffer is the task the cadence saves: its prompt stream's position is the one before the
first batch not yet trained, so a resumed run draws the batches in flight again (generated with the
resumed weights): no prompt of the data order is skipped or trained twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_gptoss.config import TrainConfig
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
    for vLLM. Collective: every rank calls the same methods in the same order."""

    def __init__(self, cfg: TrainConfig, engine, host, task, sampling: SamplingParams):
        self.cfg, self.engine, self.host, self.task, self.sampling = cfg, engine, host, task, sampling
        if cfg.rollout.partial and host is None:
            raise ValueError("partial rollouts need the embedded engine's host")
        self.k, self.partial = cfg.rollout.max_staleness, cfg.rollout.partial
        self.pending: dict[int, Submitted] = {}
        self.version: int | None = None  # the engine's policy version as this buffer knows it

    # ------------------------------------------------------------------------------- the task's state
    def state_dict(self) -> dict[str, Any]:
        """The task's prompt stream before the first batch not yet trained."""
        if self.pending:
            return self.pending[min(self.pending)].task_state
        return self.task.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task.load_state_dict(state)

    def close(self) -> None:
        self.task.close()

    # ------------------------------------------------------------------------------------------------
    def take(self, step: int, last_step: int) -> tuple[Rollouts, list[list[int]], dict[str, float]]:
        """Batch `step` (learner and engine at version step - 1), the per-token versions of its rows, and
        its metrics (the reward metrics, `staleness/dropped_rows`, `buffer/depth`: rows submitted and not
        yet trained after this one). Batches up to `last_step` are submitted ahead."""
        version = step - 1
        self.weights_are(version)
        for ahead in range(step, min(step + self.k, last_step) + 1):
            if ahead not in self.pending:
                self._submit(ahead, version)
        batch = self.pending.pop(step)
        if batch.rollouts is None:
            assert batch.params is not None
            generations = self.host.finish(batch.handle)
            batch.rollouts = score_round(self.cfg, self.task, batch.rows, generations)
            batch.metrics = batch_metrics(self.cfg, batch.rollouts)
        rollouts, metrics = batch.rollouts, dict(batch.metrics)
        versions = row_versions(rollouts.generations, batch.version)
        dropped = stale_rows(versions, version, self.k)
        if dropped:
            rollouts, versions = self._resubmit(batch, dropped, versions, version)
            metrics.update(batch_metrics(self.cfg, rollouts))
        metrics["staleness/dropped_rows"] = float(len(dropped))
        metrics["buffer/depth"] = float(sum(self._rows(b) for b in self.pending.values()))
        return rollouts, versions, metrics

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
            self.host.weights_changed(version, recompute and self.version is not None)
        self.version = version

    def _submit(self, step: int, version: int) -> None:
        state = self.task.state_dict()
        if not self.partial:
            rollouts, metrics = collect_rollouts(self.cfg, self.engine, self.task, self.sampling, step)
            self.pending[step] = Submitted(step, version, state, rollouts=rollouts, metrics=metrics)
            return
        rows, params = draw_round(self.cfg, self.task, self.sampling, step, 0)
        handle = self.host.start([list(p.token_ids) for p in rows], params)
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


def idle_fractions(step_s: float, engine_s: float, learner_s: float) -> dict[str, float]:
    """`idle/engine_frac` and `idle/learner_frac`: the share of the step's wall time each side did not
    work (the engine generating; the learner computing log-probs and updating)."""
    step_s = max(step_s, 1e-9)
    return {
        "idle/engine_frac": max(0.0, 1.0 - engine_s / step_s),
        "idle/learner_frac": max(0.0, 1.0 - learner_s / step_s),
    }
