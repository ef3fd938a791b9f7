"""Bounded failures: a collective timeout of minutes, a heartbeat watchdog that ends the job when a rank
stalls, and a graceful stop every rank agrees on.

    collective_timeout(seconds)    the `timeout` of init_process_group (gloo's default is 30 minutes)
    Watchdog(store, rank, world)   heartbeats through the rendezvous store; ends this process when another
                                   rank has not beaten for `stall_s` seconds
    GracefulStop(group, device)    SIGTERM / SIGUSR1 / SIGINT or a stop file on any rank -> every rank
                                   stops at the same step (`should_stop` is an all_reduce MAX)

Heartbeats, for a world of N ranks sharing one store (torchrun's, or the process group's):

    rank r, thread "heartbeat"  every interval_s, and at once after each `beat(step)`:
                                store[watchdog/beat/r] = "<seq> <beats> <step>" (seq counts the thread's
                                writes, beats the main loop's `beat(step)` calls)
    rank r, thread "monitor"    every interval_s: one multi_get of the other ranks' keys; a rank whose seq
                                has not changed for stall_s (stopped, dead, its host gone) or, with
                                step_stall_s, whose beats have not changed for that long after its first
                                (main loop hung) is stalled: one log line names it, this process exits
                                with STALL_EXIT_CODE, and the launcher tears the job down

Every rank watches every other, so the survivors of a stalled rank all exit within stall_s + interval_s
(plus the store's own timeout, stall_s / 2, when the store itself stops answering). A rank's clock starts
when the monitor starts: start the watchdog on every rank right after the process group exists, and
`close` it on every rank before the process group is destroyed (a closed rank is never stalled).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Exit status of a process the watchdog ends (distinct from Python's 1 and a signal's 128 + n).
STALL_EXIT_CODE = 87
# Collective timeout when none is configured: long enough for a checkpoint save or a slow first
# compilation between two collectives, short enough that a lost rank does not hold the job for long.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
_DONE = "done"


def collective_timeout(seconds: float | None = None) -> timedelta:
    """The `timeout` for `dist.init_process_group` / `new_group`: `seconds` (> 0), or
    DEFAULT_COLLECTIVE_TIMEOUT_S when None."""
    value = DEFAULT_COLLECTIVE_TIMEOUT_S if seconds is None else float(seconds)
    if not value > 0:
        raise ValueError(f"collective_timeout: seconds must be > 0, got {seconds}")
    return timedelta(seconds=value)


def default_store() -> dist.Store:
    """The store of the default process group (torchrun's rendezvous store, prefixed per restart)."""
    if not dist.is_initialized():
        raise RuntimeError("default_store: torch.distributed is not initialised")
    return dist.distributed_c10d._get_default_store()


@dataclass(frozen=True)
class Stall:
    """A rank the monitor found stalled."""

    rank: int
    host: str  # "?" when the rank never published it
    pid: int  # -1 when unknown
    step: int  # the last step passed to beat(); -1 before the first
    seconds: float  # since its heartbeat (or, for a hung loop, its beat count) last changed
    what: str  # "no heartbeat" or "no new step"

    def describe(self) -> str:
        return (
            f"rank {self.rank} (host {self.host}, pid {self.pid}, last step {self.step}): "
            f"{self.what} for {self.seconds:.1f} s"
        )


def exit_on_stall(line: str) -> None:
    """The default reaction: log `line` once, flush, end this process with STALL_EXIT_CODE."""
    log.critical(line)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STALL_EXIT_CODE)


class Watchdog:
    """Heartbeats of this rank and a monitor of the others, through `store` (shared by all `world_size`
    ranks; the watchdog talks to its own clone of it, keys under `watchdog/`).

    Args:
        store: the rendezvous store (`default_store()` under torchrun).
        rank, world_size: this process's rank and the number of ranks beating.
        stall_s: a rank whose heartbeat thread has not written for this long is stalled.
        interval_s: seconds between heartbeats and between monitor passes (< stall_s / 2).
        step_stall_s: when set, a rank whose main loop has not called `beat` for this long (after its
            first call) is stalled too; it must exceed the longest step, checkpoint saves included.
        on_stall: called with the one-line report (default: `exit_on_stall`); the monitor stops after.

    Use: `wd = Watchdog(...).start()`, `wd.beat(step)` once per step, `wd.close()` at the end (or `with`).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        stall_s: float,
        interval_s: float = 5.0,
        step_stall_s: float | None = None,
        on_stall: Callable[[str], None] = exit_on_stall,
    ):
        if not 0 < 2 * interval_s < stall_s:
            raise ValueError(f"Watchdog: need 0 < 2 x interval_s < stall_s, got {interval_s} and {stall_s}")
        if step_stall_s is not None and step_stall_s <= interval_s:
            raise ValueError(f"Watchdog: step_stall_s={step_stall_s} must exceed interval_s={interval_s}")
        self.rank, self.world_size = rank, world_size
        self.stall_s, self.interval_s, self.step_stall_s = stall_s, interval_s, step_stall_s
        self.on_stall = on_stall
        own = store.clone()  # type: ignore[attr-defined]  # its own connection and timeout
        own.set_timeout(timedelta(seconds=stall_s / 2))
        self.store = dist.PrefixStore("watchdog", own)
        self._step, self._beats, self._seq = -1, 0, 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by beat(): the heartbeat thread publishes the step at once
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Publish this rank's host and pid and its first heartbeat, start both threads; returns self."""
        self.store.set(f"info/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._publish()
        for name, target in (("heartbeat", self._heartbeat_loop), ("monitor", self._monitor_loop)):
            thread = threading.Thread(target=target, name=f"watchdog-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def beat(self, step: int) -> None:
        """The main loop reached `step` (no store access here: the heartbeat thread, woken, publishes it
        at once, so a rank stopped right after is reported with this step)."""
        self._step, self._beats = step, self._beats + 1
        self._wake.set()

    def close(self) -> None:
        """Stop both threads and mark this rank done (the others no longer watch it)."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=self.stall_s)
        self._threads = []
        try:
            self.store.set(f"beat/{self.rank}", _DONE)
        except RuntimeError as exc:  # the store may already be gone at the end of a job
            log.warning("watchdog: rank %d could not mark itself done: %s", self.rank, exc)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------
    def _publish(self) -> None:
        self._seq += 1
        self.store.set(f"beat/{self.rank}", f"{self._seq} {self._beats} {self._step}")

    def _heartbeat_loop(self) -> None:
        failing = False
        while True:
            self._wake.wait(self.interval_s)  # every interval_s, and at once after a beat
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                failing = False
            except RuntimeError as exc:  # the monitor reports a store that stays unreachable
                if not failing:
                    log.warning("watchdog: rank %d heartbeat not written: %s", self.rank, exc)
                failing = True

    def _monitor_loop(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        start = time.monotonic()
        last: dict[int, str | None] = dict.fromkeys(others)
        seq_at = dict.fromkeys(others, start)  # when each rank's heartbeat last changed
        beats_at: dict[int, float] = {}  # when each rank's beat count last changed (after its first)
        store_ok, waited_from = start, start
        present: list[int] = []  # ranks whose key exists (it stays: "done" replaces a heartbeat)
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - waited_from > self.interval_s + self.stall_s / 4:
                # this process was paused (or starved) while waiting: nobody else is to blame
                seq_at = dict.fromkeys(seq_at, now)
                beats_at = dict.fromkeys(beats_at, now)
                store_ok = now
            try:
                present += [r for r in others if r not in present and self.store.check([f"beat/{r}"])]
                values = self._read(present)
            except RuntimeError as exc:
                waited_from = time.monotonic()
                if waited_from - store_ok > self.stall_s:
                    self._report(f"the store has not answered for {waited_from - store_ok:.1f} s ({exc})", [])
                    return
                continue
            waited_from = store_ok = time.monotonic()
            for r, value in values.items():
                if value == _DONE:
                    seq_at.pop(r, None)
                    beats_at.pop(r, None)
                    continue
                old = last[r]
                last[r] = value
                seq, beats, _ = value.split()
                if old is None or old.split()[0] != seq:
                    seq_at[r] = now
                if beats != "0" and (old is None or old.split()[1] != beats):
                    beats_at[r] = now
            stalls = [
                self._stall(r, now - t, "no heartbeat") for r, t in seq_at.items() if now - t > self.stall_s
            ]
            if self.step_stall_s is not None:
                stalls += [
                    self._stall(r, now - t, "no new step")
                    for r, t in beats_at.items()
                    if now - t > self.step_stall_s and now - seq_at.get(r, now) <= self.stall_s
                ]
            if stalls:
                self._report("", stalls)
                return

    def _read(self, ranks: Sequence[int]) -> dict[int, str]:
        """The current heartbeat of each of `ranks` (all published): one round trip to the store."""
        if not ranks:
            return {}
        raw = self.store.multi_get([f"beat/{r}" for r in ranks])
        return {r: bytes(v).decode() for r, v in zip(ranks, raw)}

    def _stall(self, rank: int, seconds: float, what: str) -> Stall:
        host, pid, step = "?", -1, -1
        try:
            if self.store.check([f"info/{rank}"]):
                name, number = self.store.get(f"info/{rank}").decode().split()
                host, pid = name, int(number)
            beat = (
                self.store.get(f"beat/{rank}").decode().split() if self.store.check([f"beat/{rank}"]) else []
            )
            step = int(beat[2]) if len(beat) == 3 else -1
        except RuntimeError:
            pass  # report what is known
        return Stall(rank, host, pid, step, seconds, what)

    def _report(self, problem: str, stalls: list[Stall]) -> None:
        what = problem or "stalled: " + "; ".join(s.describe() for s in sorted(stalls, key=lambda s: s.rank))
        self.on_stall(
            f"watchdog on rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): {what} "
            f"(stall_s={self.stall_s}); ending this rank with exit code {STALL_EXIT_CODE}"
        )


class GracefulStop:
    """A graceful stop asked for by SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) to any rank, or by `stop_file`
    appearing (as seen by any rank), agreed on by every rank of `group` so they all stop after the same
    step. A second SIGINT, once a stop was asked, raises KeyboardInterrupt at once (nothing more is saved).

    Construct it in the main thread (signal handlers); `close` restores the previous handlers.
    `should_stop()` is a collective over `group` (one all_reduce MAX of one integer on `device`): call it
    at the same point of every step on every rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        stop_file: str | Path | None = None,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT),
    ):
        self.group, self.device = group, device
        self.stop_file = Path(stop_file) if stop_file else None
        self.reason = ""  # why this rank asked: a signal's name or the stop file
        self._reported = False
        self._previous = {sig: signal.signal(sig, self._ask) for sig in signals}

    def _ask(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.reason:  # asked twice: the user does not want to wait for the step's end
                raise KeyboardInterrupt
            sys.stderr.write(
                "interrupt: stopping after this step with a checkpoint (Ctrl-C again to stop at once, "
                "unsaved)\n"
            )
        self.reason = self.reason or signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        """Whether this rank was asked to stop (not collective)."""
        if not self.reason and self.stop_file is not None and self.stop_file.exists():
            self.reason = f"stop file {self.stop_file}"
        return bool(self.reason)

    def should_stop(self) -> bool:
        """Collective: True on every rank when any rank of `group` was asked to stop."""
        flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        stop = bool(flag.item())
        if stop and self.reason and not self._reported:
            log.warning("rank %d: stop requested (%s)", dist.get_rank(), self.reason)
            self._reported = True
        return stop

    def close(self) -> None:
        """Restore the signal handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> GracefulStop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
