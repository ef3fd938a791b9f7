"""What happens around every training step, written once for both modes and every world size.

- claim: before anything is built, the output directory is locked for this run (`checkpoint.run_dir`:
  the run's identity; a fresh run over another run's checkpoints is refused unless `run.overwrite`).
- start: the checkpoint located (`run.resume`: "" fresh, "auto" the newest verified one, or a path); the
  weights initialised only when nothing is resumed (with LoRA always: the checkpoint holds the adapters,
  the base comes from its source); the optimizer; the first weight sync; rank 0's
  metrics log (restarted by a fresh run) with the trackers of `run.loggers` (W&B, MLflow: their runs carry
  the run's id, so a resumed run continues them); signal handlers for a graceful stop.
- steps: the step numbers still to run (a progress bar on rank 0), after an evaluation at step 0.
- end_step: the reward guard (`rewards.guard`: every reward of `run.max_reward_error_steps` steps in a row
  failed raises RewardError naming the function); the divergence guards (`rl.guards`: skipped steps
  counted; too many in a row, or a loss or gradient norm beyond its bound, raise DivergenceError before the
  step's weights are saved); evaluation
  every `run.eval_every` steps and at the last; the metrics logged; a checkpoint
  every `run.save_every` steps (> 0), at the last step (>= 0) and when a stop was asked (SIGTERM /
  SIGUSR1 to any rank, or `run.stop_file` appearing: every rank agrees after the same step, saves and
  leaves the loop).
- finish: the background save awaited, the policy exported as HF (`run.export_hf`), plots; the result
  says whether the run finished or stopped. A failed save names the free space and `ulimit -f`.
- close: the log closed (after an error, the trackers' runs marked failed), the engine shut down (also
  after an error).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from tqdm import tqdm

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer, RunState
from megatron_gptoss.checkpoint.manager import MANIFEST, write_limits
from megatron_gptoss.checkpoint.run_dir import RunDir
from megatron_gptoss.config import TrainConfig, config_to_dict
from megatron_gptoss.errors import CheckpointSaveError, CorruptCheckpointError
from megatron_gptoss.hf.io import save_hf_tensors
from megatron_gptoss.parallel.watchdog import GracefulStop
from megatron_gptoss.rewards.guard import RewardError, RewardFailureGuard
from megatron_gptoss.rl.guards import DivergenceGuard
from megatron_gptoss.rl.kl_control import KLController
from megatron_gptoss.trainer.colocated import Colocated
from megatron_gptoss.trainer.session import Session, from_rank0
from megatron_gptoss.utils.host import collect_between_steps
from megatron_gptoss.utils.metrics import MetricsLogger
from megatron_gptoss.utils.plot import plot_metrics
from megatron_gptoss.utils.trackers import open_trackers

log = logging.getLogger(__name__)

Evaluation = Callable[[], dict[str, float]]


class Stateful(Protocol):
    """The task: its prompt stream's position travels with the checkpoints; `close` ends its workers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class RunResult(dict[str, float]):
    """A run's result metrics, with its `status` ("finished"; "stopped": a graceful stop saved a
    checkpoint before the last step) and `step` (the last step run)."""

    def __init__(self, metrics: dict[str, float], status: str, step: int):
        super().__init__(metrics)
        self.status, self.step = status, step


class Cadence:
    """Checkpoints, logging, evaluation and stopping of one run (collective to build: every rank)."""

    def __init__(
        self, cfg: TrainConfig, setup: Colocated, run_session: Session, claim: RunDir, task: Stateful
    ):
        self.cfg, self.setup, self.claim, self.session, self.task = cfg, setup, claim, run_session, task
        device = run_session.device
        run = cfg.run
        self.guard = DivergenceGuard(
            run.max_consecutive_skips, run.max_loss, run.max_grad_norm, run.max_update_ratio
        )
        self.rewards = RewardFailureGuard(cfg.reward.name, run.max_reward_error_steps)
        self.kl_ctrl = KLController(cfg.algorithm)  # the reward's KL coefficient travels with checkpoints
        self.rank, self.out_dir = setup.dims.rank, Path(cfg.run.output_dir)
        config = {"run_id": self.claim.run_id, **config_to_dict(cfg)}
        if self.rank == 0:
            _write_text(self.out_dir / "config.json", json.dumps(config, indent=2))
        self.checkpointer = DistributedCheckpointer.for_run(cfg, setup.dims, run_id=self.claim.run_id)
        found = self.checkpointer.locate(cfg.run.resume)
        if found is None or cfg.model.lora.enabled:  # a checkpoint overwrites all of it (LoRA: the adapters)
            setup.initialise()
        setup.build_optimizer()
        self.start = 0
        if found is not None:
            self.start = self._resume(found)
        setup.sync()
        resume_step = self.start + 1 if self.start else 0  # a fresh run starts a fresh log
        self.logger: MetricsLogger | None = None
        if self.rank == 0:
            tensorboard = cfg.run.tensorboard and "tensorboard" in cfg.run.loggers
            trackers = open_trackers(cfg.run.loggers, self.out_dir, self.claim.run_id, config)
            self.logger = MetricsLogger(self.out_dir, tensorboard, resume_step, trackers)
        world = dist.group.WORLD
        assert world is not None
        self.stop = GracefulStop(world, device, cfg.run.stop_file or None)
        self.stopping = False
        self.step = self.start  # the last step run
        self.evaluation: dict[str, float] = {}
        self._evaluate: Evaluation | None = None
        self._bar: tqdm | None = None

    def _resume(self, found: Path) -> int:
        """Load checkpoint `found` (weights, optimizer, guards, the KL coefficient, the task's position);
        its step. A manifest or state that lacks a field (another version's, or edited) is a
        CorruptCheckpointError naming the checkpoint and the field."""
        setup = self.setup
        try:
            loaded = self.checkpointer.resume_from(
                found, setup.modules(), setup.optimizer, setup.group_optimizers()
            )
            data = loaded.run.data
            parts: dict[str, Any] = {"guard": self.guard, "reward_guard": self.rewards}
            parts["kl_ctrl"] = self.kl_ctrl
            for key, part in parts.items():
                if key in data:
                    part.load_state_dict(data[key])
            if "task" in data:  # the prompt stream's position
                self.task.load_state_dict(data["task"])
        except KeyError as err:
            raise CorruptCheckpointError(
                f"cannot resume from {found}: its {MANIFEST} or stored state lacks the field {err.args[0]!r} "
                "(written by another version, or edited); resume another checkpoint by its path, or start a "
                "new run"
            ) from err
        return loaded.run.step

    def steps(self, evaluate: Evaluation | None) -> Iterator[int]:
        """The steps left to run; `evaluate` (RL: greedy held-out rewards) runs at step 0 of a fresh run,
        every `run.eval_every` steps and at the last."""
        self._evaluate = evaluate
        if evaluate is not None:
            self.evaluation = evaluate()
            if self.logger is not None and self.start == 0:
                self.logger.log(0, self.evaluation)
        disable = self.rank != 0 or not self.cfg.run.progress
        self._bar = tqdm(
            range(self.start + 1, self.cfg.run.steps + 1), disable=disable, desc=self.cfg.run.mode
        )
        for step in collect_between_steps(self._bar, self.cfg.run.gc_every):
            self.session.beat(step)
            yield step
            if self.stopping:
                return

    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        """Judge the step (divergence guards), evaluate when due, log, save when due or stopping
        (collective). A diverging run raises DivergenceError after logging, before saving."""
        run = self.cfg.run
        last = step == run.steps
        try:
            self.rewards.check(step, metrics)  # a reward function that fails on every row
        except RewardError:
            if self.logger is not None:
                self.logger.log(step, metrics)
            raise
        verdict = self.guard.check_step(step, metrics)
        metrics.update(verdict.metrics)
        if verdict.stop:
            if self.logger is not None:
                self.logger.log(step, metrics)
            verdict.raise_if_stop()
        if self._evaluate is not None and (run.eval_every and step % run.eval_every == 0 or last):
            self.evaluation = self._evaluate()
            metrics.update(self.evaluation)
        if self.logger is not None:
            self.logger.log(step, metrics)
            if self._bar is not None:
                self._bar.set_postfix(_postfix(metrics, self.evaluation))
        self.stopping = self.stop.should_stop() and not last
        periodic = run.save_every > 0 and step % run.save_every == 0
        if periodic or self.stopping or (last and run.save_every >= 0):
            data = {
                "next_step": step + 1,
                "guard": self.guard.state_dict(),
                "reward_guard": self.rewards.state_dict(),
                "task": self.task.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
            }
            state = RunState(step, data=data)
            modules, optimizers = self.setup.modules(), self.setup.group_optimizers()
            with self._saving():
                if run.async_save and not last and not self.stopping:
                    self.checkpointer.save_async(step, modules, self.setup.optimizer, state, None, optimizers)
                else:
                    self.checkpointer.save(step, modules, self.setup.optimizer, state, None, optimizers)
        self.step = step
        if self.stopping and self.rank == 0:
            log.warning("stopped after step %d with a checkpoint; continue with --resume auto", step)

    @contextmanager
    def _saving(self) -> Iterator[None]:
        """A failed checkpoint save says what bounds writes here (free space, `ulimit -f`): a full disk or a
        file size limit reaches us from the checkpoint writer's own buffers as a bare RuntimeError."""
        try:
            yield
        except CheckpointSaveError as err:
            raise CheckpointSaveError(f"{err} [{write_limits(self.checkpointer.manager.root)}]") from err

    def finish(self, last: dict[str, float]) -> RunResult:
        """Wait for the background save, export, plot; the run's result: the last evaluation's metrics
        (the last step's without evaluation), "stopped" after a graceful stop, else "finished"."""
        with self._saving():
            self.checkpointer.wait()
        if self.cfg.run.export_hf and not self.stopping:
            export_hf(self.setup, self.cfg, self.out_dir / "hf_final")
        if self.logger is not None:
            self.logger.close()
            plot_metrics(self.out_dir / "metrics.jsonl", self.out_dir / "metrics.png")
        metrics = self.evaluation if self._evaluate is not None else last
        return RunResult(metrics, "stopped" if self.stopping else "finished", self.step)

    def close(self) -> None:
        """Signal handlers restored, the log closed, the task's workers and the engine shut down (also
        after an error)."""
        self.stop.close()
        self.task.close()
        if self.logger is not None:  # still open only when `finish` did not run: the run failed
            self.logger.close(failed=True)
        self.setup.shutdown()

    def __enter__(self) -> Cadence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_text(path: Path, text: str) -> None:
    """`path.write_text(text)`, an OSError naming `path` (a failed write() names no file)."""
    try:
        path.write_text(text)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err


def claim_output_dir(cfg: TrainConfig) -> RunDir:
    """The run's output directory, locked for this run (collective; before anything is built or written)."""
    return RunDir.claim(
        cfg.run.output_dir,
        resume=cfg.run.resume,
        overwrite=cfg.run.overwrite,
        rank=dist.get_rank(),
        share=from_rank0,
    )


def _postfix(metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
    """The progress bar's numbers: the step's mean reward and the last held-out accuracy (a task without
    held-out prompts has none), or the supervised loss."""
    if "reward/train_mean" in metrics:
        out = {"reward": f"{metrics['reward/train_mean']:.3f}"}
        if "eval/accuracy" in evaluation:
            out["acc"] = f"{evaluation['eval/accuracy']:.2f}"
        return out
    return {"loss": f"{metrics.get('sft/loss', float('nan')):.4f}"}


def export_hf(setup: Colocated, cfg: TrainConfig, path: Path) -> None:
    """The policy as an HF directory written by rank 0, gathered through the bridge (collective)."""
    exporter = WeightExporter(
        setup.models, cfg.model, setup.dims, EngineLayout(), cfg.rollout.bucket_size_mb << 20, dst=0
    )
    pairs = (pair for bucket in exporter.buckets() for pair in bucket)
    if setup.dims.rank == 0:
        save_hf_tensors(pairs, cfg.model, path)
    else:
        for _ in pairs:  # every rank takes part in each bucket's gather
            pass
