"""`ToolExecutor`: tool calls of many trajectories in flight at once, each under its own timeout.

    submit(call) ──> a supervisor thread per call: waits for one of `max_concurrent` slots, runs the call in
                     a worker thread, and resolves the call's future with its outcome, or with a timeout
                     outcome `timeout_s` after the tool began to run (a user tool's worker may have to start
                     first; the slot is freed then: a stuck tool never holds the others up)

The python tool is stopped by its sandbox at the timeout (and answers with what it printed). Any other tool
is answered as a timeout by the executor at `timeout_s` (counted as `abandoned`): a user tool
(`agent.tools`) runs in a worker process, which is killed then (`tools.ToolWorkers`), so a function
holding the GIL or never returning costs its call only; a function run in this process (a `Tool` built in
code) cannot be interrupted, and its thread is left to finish on its own. Only ToolError (a sandbox or a
tool worker that cannot run) resolves a future with an exception.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from megatron_gptoss.agent.calls import ToolCall, ToolOutcome, run_call
from megatron_gptoss.agent.tools import WORKER_START_S, ToolRegistry
from megatron_gptoss.config.agent import AgentConfig

SANDBOX_GRACE_S = 2.0  # seconds a python call may answer past its timeout (the sandbox's start and stop)


@dataclass
class ToolMetrics:
    """Counts since the last reset: calls by status, latencies (seconds, submit to outcome, queueing
    included), calls the executor answered at their timeout without the tool's answer (`abandoned`: a user
    tool's worker is killed, an in-process function's thread left to finish), and the most calls running
    at once."""

    calls: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    abandoned: int = 0
    peak_running: int = 0
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Flat numbers for the step's log: tool/calls, tool/errors, ... tool/latency_mean_s, _max_s."""
        lat = sorted(self.latencies)
        return {
            "tool/calls": self.calls,
            "tool/ok": self.ok,
            "tool/errors": self.errors,
            "tool/timeouts": self.timeouts,
            "tool/abandoned": self.abandoned,
            "tool/peak_running": self.peak_running,
            "tool/latency_mean_s": sum(lat) / len(lat) if lat else 0.0,
            "tool/latency_p50_s": lat[len(lat) // 2] if lat else 0.0,
            "tool/latency_max_s": lat[-1] if lat else 0.0,
        }


class ToolExecutor:
    """Runs tool calls concurrently; thread-safe. `close()` stops the registry's tool workers and waits for
    no thread (they are daemons)."""

    def __init__(self, registry: ToolRegistry, *, timeout_s: float, max_concurrent: int, max_chars: int):
        self.registry = registry
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._running = 0
        self._metrics = ToolMetrics()

    @classmethod
    def from_config(cls, registry: ToolRegistry, agent: AgentConfig) -> ToolExecutor:
        return cls(
            registry,
            timeout_s=agent.tool_timeout_s,
            max_concurrent=agent.max_concurrent_calls,
            max_chars=agent.max_result_chars,
        )

    def submit(self, call: ToolCall, *, budget_left: bool = True) -> Future:
        """A future of the call's ToolOutcome (or of a ToolError)."""
        future: Future = Future()
        threading.Thread(
            target=self._supervise, args=(call, budget_left, future, time.monotonic()), daemon=True
        ).start()
        return future

    def done(self, futures: Sequence[Future], *, wait: bool, wait_all: bool = False) -> list[Future]:
        """The futures of `futures` that hold their outcome, in the given order; with `wait`, after the
        first of them has one; with `wait_all`, after all have."""
        if (wait or wait_all) and futures:
            until = concurrent.futures.ALL_COMPLETED if wait_all else concurrent.futures.FIRST_COMPLETED
            concurrent.futures.wait(futures, return_when=until)
        return [f for f in futures if f.done()]

    def run(self, call: ToolCall, *, budget_left: bool = True) -> ToolOutcome:
        """submit(call).result(): one call, in the calling thread's time."""
        return self.submit(call, budget_left=budget_left).result()

    def _supervise(self, call: ToolCall, budget_left: bool, future: Future, submitted: float) -> None:
        with self._slots:
            with self._lock:
                self._running += 1
                self._metrics.peak_running = max(self._metrics.peak_running, self._running)
            try:
                box: list = []
                started, done = threading.Event(), threading.Event()
                worker = threading.Thread(
                    target=self._work, args=(call, budget_left, box, started, done), daemon=True
                )
                worker.start()
                # a user tool's worker starts within WORKER_START_S, or the call raises ToolError
                started.wait(WORKER_START_S + SANDBOX_GRACE_S)
                # the sandbox stops python at timeout_s itself, and answers a moment later
                finished = done.wait(
                    self.timeout_s + (SANDBOX_GRACE_S if call.recipient == "python" else 0.0)
                )
            finally:
                with self._lock:
                    self._running -= 1
        latency = time.monotonic() - submitted
        if not finished:
            outcome = ToolOutcome(f"error: {call.recipient} timed out after {self.timeout_s:g} s", "timeout")
            self._record(outcome, latency, abandoned=True)
            future.set_result(ToolOutcome(outcome.text, outcome.status, latency))
        elif isinstance(box[0], BaseException):
            future.set_exception(box[0])
        else:
            # a user tool's worker killed at the timeout (by `run_call`, when its clock ran out a moment
            # before this thread's) is abandoned as when this thread answers first: the count does not depend
            # on which of the two timers fired; python's sandbox answers at its timeout itself
            killed = box[0].status == "timeout" and call.recipient != "python"
            self._record(box[0], latency, abandoned=killed)
            future.set_result(ToolOutcome(box[0].text, box[0].status, latency))

    def _work(
        self, call: ToolCall, budget_left: bool, box: list, started: threading.Event, done: threading.Event
    ) -> None:
        try:
            box.append(
                run_call(
                    self.registry,
                    call,
                    timeout_s=self.timeout_s,
                    budget_left=budget_left,
                    max_chars=self.max_chars,
                    started=started.set,
                )
            )
        except BaseException as err:  # ToolError, or a bug: re-raised in the caller through the future
            box.append(err)
        started.set()
        done.set()

    def _record(self, outcome: ToolOutcome, latency: float, *, abandoned: bool) -> None:
        with self._lock:
            m = self._metrics
            m.calls += 1
            m.ok += outcome.status == "ok"
            m.errors += outcome.status == "error"
            m.timeouts += outcome.status == "timeout"
            m.abandoned += abandoned
            m.latencies.append(latency)

    def close(self) -> None:
        """Stop the user tools' worker processes; calls submitted after fail with ToolError."""
        self.registry.close()

    def metrics(self, reset: bool = True) -> ToolMetrics:
        """The metrics since the last reset (and reset them)."""
        with self._lock:
            current = self._metrics
            if reset:
                self._metrics = ToolMetrics(peak_running=self._running)
            return current
