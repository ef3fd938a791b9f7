"""Bounded failures (`parallel.watchdog`): a stalled rank ends the job within stall_s, a hung main loop is
named, a closed rank is never blamed; a graceful stop asked of one rank stops every rank at the same
step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.parallel.watchdog import (
    STALL_EXIT_CODE,
    GracefulStop,
    Watchdog,
    collective_timeout,
)

ROOT = Path(__file__).resolve().parents[2]


def test_collective_timeout():
    assert collective_timeout(None) == timedelta(minutes=5)
    assert collective_timeout(42) == timedelta(seconds=42)
    with pytest.raises(ValueError):
        collective_timeout(0)


def test_intervals_must_leave_room_for_a_missed_beat():
    with pytest.raises(ValueError):
        Watchdog(dist.HashStore(), 0, 2, stall_s=1.0, interval_s=0.5)
    with pytest.raises(ValueError):
        Watchdog(dist.HashStore(), 0, 2, stall_s=1.0, interval_s=0.1, step_stall_s=0.1)


# -------------------------------------------------------------------------------------------------
# In one process: two ranks' watchdogs on one store, reports collected instead of exiting
def _pair(store, reports, **kw):
    return [
        Watchdog(store, r, 2, stall_s=0.6, interval_s=0.1, on_stall=reports[r].append, **kw) for r in range(2)
    ]


def _run(watchdogs, seconds, beating):
    """Beat every `beating` rank every 50 ms for `seconds`."""
    end, step = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for r in beating:
            watchdogs[r].beat(step)
        step += 1
        time.sleep(0.05)


def test_healthy_and_closed_ranks_are_not_reported():
    reports: list[list[str]] = [[], []]
    a, b = _pair(dist.HashStore(), reports, step_stall_s=0.8)
    a.start()
    b.start()
    _run([a, b], 1.5, beating=[0, 1])
    b.close()  # a rank that finished is not stalled
    _run([a, b], 1.5, beating=[0])
    a.close()
    assert reports == [[], []]


def test_hung_main_loop_is_named():
    reports: list[list[str]] = [[], []]
    a, b = _pair(dist.HashStore(), reports, step_stall_s=0.8)
    a.start()
    b.start()
    b.beat(7)  # rank 1's loop starts, then hangs; its heartbeat thread goes on
    _run([a, b], 2.0, beating=[0])
    a.close()
    b.close()
    assert reports[1] == []
    assert len(reports[0]) == 1, reports[0]
    assert "rank 1 (host" in reports[0][0] and "last step 7): no new step" in reports[0][0]


def test_lost_store_is_named():
    """The store answers no more (its host, rank 0 outside torchrun, is gone): every rank says so."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    reports: list[list[str]] = [[], []]
    a, b = _pair(client, reports)
    a.start()
    b.start()
    _run([a, b], 0.5, beating=[0, 1])
    del server  # closes its socket
    _run([a, b], 1.5, beating=[0, 1])
    a.close()
    b.close()
    for r in range(2):
        assert len(reports[r]) == 1 and f"watchdog on rank {r}" in reports[r][0], reports[r]
        assert "the store has not answered for" in reports[r][0], reports[r]


# -------------------------------------------------------------------------------------------------
# Three processes: one is SIGSTOPped, the other two end themselves within stall_s + a margin
STALL_S, INTERVAL_S = 2.0, 0.2
RANK_SCRIPT = """
import sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from megatron_gptoss.parallel.watchdog import Watchdog, default_store

port, rank, world = (int(a) for a in sys.argv[1:4])
stall_s, interval_s = float(sys.argv[4]), float(sys.argv[5])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
watchdog = Watchdog(default_store(), rank, world, stall_s=stall_s, interval_s=interval_s).start()
try:
    for step in range(100_000):
        watchdog.beat(step)
        dist.all_reduce(torch.ones(1))  # blocks once a peer is stopped
        if step == 30:  # past a few heartbeats
            store.add("ready", 1)
        time.sleep(0.02)
except RuntimeError as exc:  # a peer the watchdog ended closed its connections: stay stuck
    print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
    threading.Event().wait()
"""


def test_stopped_rank_ends_the_others(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [str(server.port), "RANK", "3", str(STALL_S), str(INTERVAL_S)]
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(3)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, *[str(r) if a == "RANK" else a for a in args]],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + 60
        while server.add("ready", 0) < 3:
            assert time.monotonic() < deadline, "the ranks did not start"
            assert all(p.poll() is None for p in procs), [open(f.name).read() for f in logs]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        bound = STALL_S + 2 * INTERVAL_S + 4.0  # + CPU contention on a shared machine
        for r in (0, 2):
            procs[r].wait(timeout=max(0.1, stopped + bound - time.monotonic()))
        elapsed = time.monotonic() - stopped
        outputs = [open(f.name).read() for f in logs]
        for r in (0, 2):
            assert procs[r].returncode == STALL_EXIT_CODE, (r, procs[r].returncode, outputs[r])
            found = re.search(
                r"stalled: rank 1 \(host \S+, pid (\d+), last step (\d+)\): no heartbeat", outputs[r]
            )
            assert found and int(found[1]) == procs[1].pid and int(found[2]) > 0, outputs[r]
            assert outputs[r].count("watchdog on rank") == 1, outputs[r]
        assert STALL_S - INTERVAL_S <= elapsed <= bound, elapsed
        assert procs[1].poll() is None  # still stopped
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait(timeout=10)
        for f in logs:
            f.close()


# -------------------------------------------------------------------------------------------------
# Graceful stop on two gloo ranks
def _stop_at(signal_after_s: float | None, stop_file: str, steps: int = 200) -> dict:
    rank = dist.get_rank()
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop(dist.group.WORLD, torch.device("cpu"), stop_file if rank == 0 else None)
    timer = None
    if signal_after_s is not None and rank == 1:  # SIGTERM from another thread, at no step in particular
        timer = threading.Timer(signal_after_s, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
    try:
        for step in range(steps):
            if rank == 0 and stop_file and step == 3:
                Path(stop_file).touch()
            if stop.should_stop():
                break
            time.sleep(0.01)
        else:
            step = -1
    finally:
        if timer is not None:
            timer.cancel()
        stop.close()
    restored = signal.getsignal(signal.SIGTERM) is before
    return {"step": step, "requested": stop.requested, "reason": stop.reason, "restored": restored}


def test_sigterm_to_one_rank_stops_both_at_the_same_step():
    r0, r1 = pool(2).run(_stop_at, 0.3, "", timeout=60)
    assert r0["step"] > 0 and r0["step"] == r1["step"], (r0, r1)
    assert r1 == {"step": r0["step"], "requested": True, "reason": "SIGTERM", "restored": True}
    assert r0 == {"step": r0["step"], "requested": False, "reason": "", "restored": True}


def test_stop_file_seen_by_one_rank_stops_both(tmp_path):
    r0, r1 = pool(2).run(_stop_at, None, str(tmp_path / "STOP"), timeout=60)
    assert r0 == {"step": 3, "requested": True, "reason": f"stop file {tmp_path / 'STOP'}", "restored": True}
    assert r1 == {"step": 3, "requested": False, "reason": "", "restored": True}
