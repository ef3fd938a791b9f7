"""The engine of an engine rank (`rollout.placement: separate`): in the rank's own process, or in a child
process the rank supervises (`rollout.engine_child`), so an engine that dies does not end the process group.

    EngineCore    the embedded engine and its bookkeeping: whole generations, rows queued by `start` under
                  a handle and stepped in a thread between calls (one engine step at a time under a lock,
                  where this rank is a whole replica), weights loaded between two steps, a pause from a
                  weight load until the new version's number arrives, and the seconds spent generating
    ChildEngine   the same calls, each sent to an EngineCore in a child process (multiprocessing spawn) over
                  a pipe; tensors cross as shared memory. When the child dies (the pipe breaks), a new child
                  is started (at most `rollout.engine_restarts` times in a run), given the last weights and
                  versions, and every row queued and not yet finished is queued again under its handle, from
                  its prompt and with its own seed; then the broken call is made again. So every row is
                  answered once: none lost, none twice (rows started over sample again from their prompt under
                  the weights of now).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gptoss.config import TrainConfig
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.errors import EngineError
from megatron_gptoss.trainer.engines import EmbeddedHost
from megatron_gptoss.utils.host import set_host_threads

Pairs = list[tuple[str, torch.Tensor]]


class TurnLock:
    """A lock that a thread taking it again and again cannot starve. `threading.Lock` is not fair: the
    decoding thread, releasing it after one engine step and taking it again at once, kept a weight load
    waiting for the whole batch in flight (14-15 s a step on two H200s, the learner blocked in its sync).
    Every holder passes a gate first, and a waiting caller holds the gate, so it gets the lock at the end of
    the current step."""

    def __init__(self):
        self._gate = threading.Lock()
        self._lock = threading.Lock()

    def __enter__(self) -> TurnLock:
        with self._gate:
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class EngineCore:
    """This rank's part of the embedded engine over the current default group (every call collective over
    it, in the same order); thread-safe."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.device, self.partial = device, cfg.rollout.partial
        self.host = EmbeddedHost(cfg, [], None, device)
        edims = self.host.engine_dims
        self.handles: dict[int, tuple[list, int]] = {}
        self.lock = TurnLock()  # calls get it between two engine steps of the decoding thread
        self.work = threading.Event()  # set when the decoding thread may have rows to step
        self.paused = False  # from a weight load until its version arrives
        self.closed = False
        self.busy_time = 0.0
        self.thread = None
        if edims.tp == 1 and edims.ep == 1:  # no lockstep with other ranks: each rank decodes alone
            self.thread = threading.Thread(target=self._decode, name="engine-decode", daemon=True)
            self.thread.start()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._timed(lambda: self.host.generate(prompts, params))

    def start(self, handle: int, prompts: list[list[int]], params: SamplingParams) -> None:
        """Queue the rows under `handle`; they decode from now on."""
        with self.lock:
            self.handles[handle] = self.host.start(prompts, params)
        self.work.set()

    def finish(self, handle: int) -> list[Generation]:
        return self._timed(lambda: self.host.finish(self.handles.pop(handle)))

    def load(self, buckets: list[Pairs]) -> None:
        """New weights, between two engine steps; the engine pauses until `version`. Without
        `rollout.partial` the rows in flight are first stepped to their end under the weights they started
        with (every rank of a lockstep block steps until none has rows left)."""
        with self.lock:
            if not self.partial:
                start = time.perf_counter()
                self.host.engine.advance(2**62)
                self.busy_time += time.perf_counter() - start
            self.host.engine.update_weights(pair for bucket in buckets for pair in bucket)
            self.paused = True

    def version(self, version: int, recompute: bool) -> None:
        with self.lock:
            self.host.weights_changed(version, recompute)
            self.paused = False
        self.work.set()

    def busy(self) -> float:
        """Seconds spent generating since the last call."""
        with self.lock:
            busy, self.busy_time = self.busy_time, 0.0
        return busy

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.work.set()
        if self.thread is not None:
            self.thread.join()
        self.host.shutdown()

    def _timed(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                self.busy_time += time.perf_counter() - start

    def _in_flight(self) -> bool:
        return any(not seq.left for seqs, _ in self.handles.values() for seq in seqs)

    def _decode(self) -> None:
        """Step the rows in flight, one engine step at a time, while any is left and no load pauses them."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            self.work.wait()
            with self.lock:
                if self.closed:
                    return
                if self.paused or not self._in_flight():
                    self.work.clear()
                    continue
                start = time.perf_counter()
                self.host.engine.advance(1)
                self.busy_time += time.perf_counter() - start


def child_main(cfg: TrainConfig, device: str, conn) -> None:
    """A child engine: an EngineCore in a world of its own, answering `(method, args)` calls on `conn` with
    (ok, value) until `None`."""
    where = torch.device(device)
    set_host_threads(where, cfg.run.num_threads)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    core = EngineCore(cfg, where)
    try:
        while (call := conn.recv()) is not None:
            method, args = call
            try:
                conn.send((True, getattr(core, method)(*args)))
            except Exception:
                conn.send((False, traceback.format_exc()))
    finally:
        core.close()
        dist.destroy_process_group()


class ChildEngine:
    """EngineCore's calls, answered by a child process this rank supervises; restarted when it dies."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.restarts = 0
        self.queued: dict[int, tuple[list[list[int]], SamplingParams]] = {}  # started, not finished
        self.weights: list[Pairs] | None = None  # the last weights loaded (in host memory)
        self.label: int | None = None  # the last version told
        self.loaded_at: int | None = None  # the version told before the last load
        self.version_now: int | None = None  # the version told after it (None: paused)
        self._spawn()

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=child_main, args=(self.cfg, str(self.device), child), name="engine", daemon=True
        )
        self.process.start()
        child.close()  # the pipe breaks here when the child dies

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _call(self, method: str, *args: Any) -> Any:
        """The child's answer to `method(*args)`; made again in a new child when the child dies."""
        while True:
            try:
                ok, value = self._send(method, args)
            except (EOFError, OSError):
                self._restart(method)
                continue
            if not ok:
                raise EngineError(f"the engine process failed in {method}:\n{value}")
            return value

    def _send(self, method: str, args: tuple) -> tuple[bool, Any]:
        self.conn.send((method, args))
        return self.conn.recv()

    def _restart(self, method: str) -> None:
        """A new child with the last weights and versions, every queued row queued again (a child that dies
        meanwhile is replaced too; at most `rollout.engine_restarts` children in all)."""
        while True:
            self.process.join(timeout=5)
            if self.restarts >= self.cfg.rollout.engine_restarts:
                raise EngineError(
                    f"the engine process died in {method} (exit code {self.process.exitcode}) after "
                    f"{self.restarts} restarts (rollout.engine_restarts={self.cfg.rollout.engine_restarts})"
                )
            self.restarts += 1
            self.conn.close()
            self._spawn()
            replay: list[tuple[str, tuple]] = []
            if self.loaded_at is not None:
                replay.append(("version", (self.loaded_at, False)))
            if self.weights is not None:
                replay.append(("load", (self.weights,)))
            if self.version_now is not None:
                replay.append(("version", (self.version_now, False)))
            replay += [("start", (h, *self.queued[h])) for h in sorted(self.queued)]
            try:
                for name, args in replay:
                    ok, value = self._send(name, args)
                    if not ok:
                        raise EngineError(f"the restarted engine process failed in {name}:\n{value}")
                return
            except (EOFError, OSError):
                continue

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._call("generate", prompts, params)

    def start(self, handle: int, prompts: list[list[int]], params: SamplingParams) -> None:
        self._call("start", handle, prompts, params)
        self.queued[handle] = (prompts, params)

    def finish(self, handle: int) -> list[Generation]:
        generations = self._call("finish", handle)
        del self.queued[handle]
        return generations

    def load(self, buckets: list[Pairs]) -> None:
        self._call("load", buckets)
        if self.device.type != "cpu":  # the copy kept for a new child waits in host memory
            buckets = [[(name, tensor.cpu()) for name, tensor in bucket] for bucket in buckets]
        self.weights, self.loaded_at, self.version_now = buckets, self.label, None

    def version(self, version: int, recompute: bool) -> None:
        self._call("version", version, recompute)
        self.label = self.version_now = version

    def busy(self) -> float:
        return self._call("busy")

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
