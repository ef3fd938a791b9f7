"""How a run ends: Ctrl-C stops it like SIGTERM (a checkpoint, exit 0, a final line saying "stopped"; a
second Ctrl-C stops at once); a full disk or a file size limit is one line naming the file or the
checkpoint and the limit; the watchdog reports the step a stopped rank had reached."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_gptoss.checkpoint import manager
from megatron_gptoss.checkpoint.manager import describe_os_error, write_limits
from megatron_gptoss.parallel.watchdog import GracefulStop, Watchdog

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.preset=gpt_oss_tiny", "model.vocab_size=32", "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4", "env.eval_size=8", "run.eval_every=0", "run.progress=false",
        "run.tensorboard=false", "run.export_hf=false", "optim.warmup_steps=0"]  # fmt: skip


def start(out: Path, *overrides: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_gptoss.train", "--config", "configs/demo_cpu.yaml", *TINY,
           f"run.output_dir={out}", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def test_ctrl_c_saves_and_the_final_line_says_stopped(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "run.steps=500")
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text().count("\n") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)  # step 1 is logged
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    final = json.loads(stdout.strip().splitlines()[-1])
    assert final["status"] == "stopped" and final["step"] >= 1
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{final['step']:06d}"]
    assert "stop requested (SIGINT)" in stderr


def test_a_second_ctrl_c_interrupts_at_once():
    before = signal.getsignal(signal.SIGINT)
    stop = GracefulStop(dist.group.WORLD, torch.device("cpu"))  # type: ignore[arg-type]  # no collective here
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def _file_size_limit(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def test_a_file_size_limit_is_one_line_naming_it(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "run.steps=1", preexec_fn=_file_size_limit(64 * 1024))  # the checkpoint is larger
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if "ERROR" in line)
    assert "CheckpointSaveError: checkpoint of step 1 not saved" in line
    assert f"writing {out / 'checkpoints' / '.step_000001.partial'}" in line
    assert "likely cause: the file size limit of this process (ulimit -f: 65536 bytes)" in line
    proc = start(tmp_path / "tiny", "run.steps=1", preexec_fn=_file_size_limit(1024))  # config.json is larger
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    expected = f"file size limit exceeded (ulimit -f: 1024 bytes) writing {tmp_path / 'tiny' / 'config.json'}"
    assert expected in stderr


def test_a_full_disk_is_named(tmp_path, monkeypatch):
    err = OSError(errno.ENOSPC, "No space left on device", "/out/metrics.jsonl")
    assert describe_os_error(err).startswith("disk full writing /out/metrics.jsonl")
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(manager.resource, "getrlimit", lambda which: unlimited)
    monkeypatch.setattr(manager.shutil, "disk_usage", lambda path: SimpleNamespace(free=10 << 20))
    expected = f"likely cause: disk full (10 MiB free on the file system of {tmp_path})"
    assert write_limits(tmp_path / "checkpoints") == expected  # the nearest existing directory


def test_the_watchdog_publishes_a_step_at_once():
    store = dist.HashStore()
    watchdog = Watchdog(store, 1, 2, stall_s=60.0, interval_s=20.0).start()  # a heartbeat every 20 s
    try:
        watchdog.beat(3)
        deadline = time.monotonic() + 5.0
        while store.get("watchdog/beat/1").decode().split()[2] != "3":
            assert time.monotonic() < deadline, "step 3 was not published: a stopped rank would read -1"
            time.sleep(0.01)
    finally:
        watchdog.close()
