"""`RewardScorer`: score a batch of completions in spawned worker processes, each call under a timeout.

    score_batch(completions, rows)
        queue of row indices ──> idle ready worker ──(index, messages, row)──> score_one ──> result
                                       │ no answer within timeout_s: killed, replaced, row scores 0
                                       │ raised, or returned a bad value: row scores 0
                                       │ returned NaN or inf: the row's reward is that value (its GRPO
                                       │   group is dropped by the trainer)
                                       └ died: replaced, row scores 0

Failures of the reward function are never silent: each is counted (`reward/errors`, `reward/timeouts`,
`reward/nonfinite`, all of them in `reward/failed`), and the first of each kind (raised, bad value,
non-finite, timeout, died, unsendable row) is logged once per scorer, naming the function and the row, with
the function's traceback when it raised.

A worker is one spawned process with a pipe; it resolves the reward function once, says it is ready,
then scores one row at a time. Nothing a reward function does holds the batch longer than its timeout
(plus the start of a replacement worker, which runs in parallel with the others). Workers are started
when the scorer is made and live until `close()`.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.rewards.score import BadRewardValue, resolve, score_one
from megatron_gptoss.rewards.types import Message

log = logging.getLogger(__name__)

# Seconds a new worker may take to import the reward function and report ready.
START_TIMEOUT_S = 120.0
# Kinds of failure, each logged the first time it happens.
RAISED, BAD_VALUE, NONFINITE, TIMEOUT, DIED, UNSENDABLE = (
    "raised", "returned a bad value", "returned a non-finite reward", "timed out", "died", "unsendable row"
)  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """One row whose reward failed: its `kind` (RAISED ... UNSENDABLE), a one-line `message` and, when
    the function raised, its `traceback`."""

    index: int
    kind: str
    message: str
    traceback: str = ""


def _attempt(cfg: RewardConfig, fn: Any, messages: Any, row: Any) -> tuple:
    """The wire form of one row's result: (index-less) (True, reward, metrics, reason) or (False, kind,
    message, traceback)."""
    try:
        reward, metrics, reason = score_one(cfg, fn, messages, row)
    except BadRewardValue as err:
        return False, BAD_VALUE, str(err)[:1000], ""
    except Exception as err:
        return False, RAISED, f"{type(err).__name__}: {err}"[:1000], traceback.format_exc()[-8000:]
    return True, reward, metrics, reason


def _worker_main(conn: Connection, cfg: RewardConfig) -> None:
    """A worker's loop: ("ready",) once, then one (index, *`_attempt`) per task until it receives None or
    its pipe closes."""
    try:
        fn = resolve(cfg)
    except ConfigError as err:
        conn.send(("failed", str(err)))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, messages, row = task
        conn.send((index, *_attempt(cfg, fn, messages, row)))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    started: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0


class _Tally:
    """Per-row rewards, the batch's failures and its metrics."""

    def __init__(self, size: int) -> None:
        self.rewards = [0.0] * size
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.failures: list[Failure] = []

    def result(self, index: int, answer: tuple) -> None:
        """Record one row's `_attempt` result."""
        if answer[0]:
            self.success(index, *answer[1:])
        else:
            self.fail(index, *answer[1:])

    def success(self, index: int, reward: float, metrics: Mapping[str, float], reason: str | None) -> None:
        self.rewards[index] = reward
        if not math.isfinite(reward):
            self.fail(index, NONFINITE, f"the reward is {reward}: its group is dropped", keep=True)
            return
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1
        if reason is not None:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def fail(self, index: int, kind: str, message: str, trace: str = "", keep: bool = False) -> None:
        """Row `index` failed (it scores 0, or with `keep` its non-finite reward as it is)."""
        if not keep:
            self.rewards[index] = 0.0
        self.failures.append(Failure(index, kind, message, trace))

    def count(self, *kinds: str) -> float:
        return float(sum(f.kind in kinds for f in self.failures))

    def metrics(self) -> dict[str, float]:
        finite = [r for r in self.rewards if math.isfinite(r)]
        out = {"reward/mean": sum(finite) / max(1, len(finite))}
        out.update({f"reward/{key}": self.sums[key] / self.counts[key] for key in sorted(self.sums)})
        out.update({f"reward/reason/{key}": float(count) for key, count in sorted(self.reasons.items())})
        out["reward/errors"] = self.count(RAISED, BAD_VALUE, DIED, UNSENDABLE)
        out["reward/timeouts"] = self.count(TIMEOUT)
        out["reward/nonfinite"] = self.count(NONFINITE)
        out["reward/failed"] = float(len(self.failures))
        out["reward/rows"] = float(len(self.rewards))
        return out


class RewardScorer:
    """Scores completions with the reward `cfg` names, in `cfg.workers` spawned processes.

    `score_batch(completions, rows)` returns (rewards, metrics): one float per completion (0 for one whose
    scoring raised, returned something not a number, took longer than `cfg.timeout_s` or killed its
    worker; NaN or inf as the function returned them) and `reward/mean` (over the finite rewards),
    `reward/<metric>` (the mean of each number the reward returned, `task` and `format` among them),
    `reward/reason/<reason>` (rows per reason), and the counts `reward/errors`, `reward/timeouts`,
    `reward/nonfinite`, `reward/failed` (rows of any failure) and `reward/rows`. `last_failures` holds the
    last batch's `Failure`s, `last_errors` the (row index, message) of its errors. The first failure of
    each kind is logged (module docstring). With `cfg.workers == 0` rows are scored in the calling
    process, without timeouts (a function that ends its process ends the caller).
    """

    def __init__(self, cfg: RewardConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self._fn = resolve(cfg)
        self._context = multiprocessing.get_context("spawn")
        self._closed = False
        self._workers = [self._start() for _ in range(cfg.workers)]
        self.last_failures: list[Failure] = []
        self._logged: set[str] = set()  # kinds of failure already logged

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(theirs, self.cfg), daemon=True)
        process.start()
        theirs.close()
        return _Worker(process=process, conn=ours, started=time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start()

    def score_batch(
        self, completions: Sequence[Sequence[Message]], rows: Sequence[Mapping[str, Any]]
    ) -> tuple[list[float], dict[str, float]]:
        """(one reward per completion, the batch's metrics); ValueError when the two lengths differ."""
        if self._closed:
            raise RuntimeError("the RewardScorer is closed")
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        tally = _Tally(len(rows))
        tasks = [
            (i, [dict(m) for m in messages], dict(row) if isinstance(row, Mapping) else row)
            for i, (messages, row) in enumerate(zip(completions, rows))
        ]
        if self._workers:
            self._run(tasks, tally)
        else:
            for index, messages, row in tasks:
                tally.result(index, _attempt(self.cfg, self._fn, messages, row))
        self.last_failures = sorted(tally.failures, key=lambda f: f.index)
        self._log_new_kinds(self.last_failures)
        return tally.rewards, tally.metrics()

    @property
    def last_errors(self) -> list[tuple[int, str]]:
        """(row index, message) of the last batch's errors (the failures `reward/errors` counts), by row."""
        return [(f.index, f.message) for f in self.last_failures if f.kind not in (TIMEOUT, NONFINITE)]

    def _log_new_kinds(self, failures: list[Failure]) -> None:
        """Log the first failure of every kind not logged before, naming the function and the row."""
        for failure in failures:
            if failure.kind in self._logged:
                continue
            self._logged.add(failure.kind)
            trace = f"\n{failure.traceback.rstrip()}" if failure.traceback else ""
            log.warning(
                "reward function %r %s on row %d of a batch: %s (the first such failure; later ones are "
                "counted in reward/failed, not logged)%s",
                self.cfg.name,
                failure.kind,
                failure.index,
                failure.message,
                trace,
            )

    def _run(self, tasks: list[tuple[int, list[dict[str, Any]], Any]], tally: _Tally) -> None:
        queue = deque(tasks)
        while queue or any(w.task is not None for w in self._workers):
            for worker in list(self._workers):
                while worker.ready and worker.task is None and queue:  # a row that cannot be sent is
                    self._send(worker, queue.popleft(), tally)  # an error: the worker takes the next
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            if not waiting:  # every worker idle: nothing is in flight, so nothing can arrive
                if queue:
                    states = [(w.process.pid, w.process.is_alive(), w.ready, w.task) for w in self._workers]
                    raise RuntimeError(f"{len(queue)} rows left and no reward worker to take them: {states}")
                break
            deadlines = [w.deadline if w.ready else w.started + START_TIMEOUT_S for w in waiting]
            timeout = max(0.0, min(deadlines) - time.monotonic())
            for conn in wait([w.conn for w in waiting], timeout):
                worker = next(w for w in self._workers if w.conn is conn)
                self._receive(worker, tally)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.task is not None and now >= worker.deadline:
                    limit = f"no reward within reward.timeout_s={self.cfg.timeout_s} s: the worker was killed"
                    tally.fail(worker.task, TIMEOUT, limit)
                    self._replace(worker)
                elif not worker.ready and now >= worker.started + START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S} s")

    def _send(self, worker: _Worker, task: tuple[int, list[dict[str, Any]], Any], tally: _Tally) -> None:
        try:
            worker.conn.send(task)
        except Exception as err:  # unpicklable row (nothing was sent) or a dead worker
            tally.fail(task[0], UNSENDABLE, f"cannot send the row to a worker: {type(err).__name__}: {err}")
            if not worker.process.is_alive():
                self._replace(worker)
            return
        worker.task = task[0]
        worker.deadline = time.monotonic() + self.cfg.timeout_s

    def _receive(self, worker: _Worker, tally: _Tally) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            if not worker.ready:
                code = worker.process.exitcode
                self.close()
                raise RuntimeError(f"a reward worker died while starting (exit code {code})") from None
            if worker.task is not None:
                code = worker.process.exitcode
                tally.fail(worker.task, DIED, f"the worker died (exit code {code}) while scoring the row")
            self._replace(worker)
            return
        if message[0] == "ready":
            worker.ready = True
        elif message[0] == "failed":
            self.close()
            raise ConfigError(message[1])
        else:
            worker.task = None
            tally.result(message[0], message[1:])

    def close(self) -> None:
        """Stop every worker (asked first, killed after a second); the scorer cannot be used after."""
        for worker in self._workers:
            if worker.ready and worker.task is None:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        for worker in self._workers:
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
        self._workers = []
        self._closed = True
