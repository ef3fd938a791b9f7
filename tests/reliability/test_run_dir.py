"""A run owns its output directory: the lock (a second live run is refused, naming the holder; a dead
holder blocks nothing), the run identity (new, continued, shared with other ranks), and a new run that
would mix with another run's checkpoints or replace the outputs of a run that left none (refused unless
overwrite)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron_gptoss.checkpoint.manager import CheckpointManager
from megatron_gptoss.checkpoint.run_dir import IDENTITY_FILE, LOCK_FILE, RunDir
from megatron_gptoss.errors import ConfigError, CorruptCheckpointError


def save(root, step: int, run_id: str | None) -> None:
    CheckpointManager(root, keep_last=5, run_id=run_id).save(
        step, lambda d: (d / "w.bin").write_bytes(b"w" * 64), {}
    )


def test_a_second_live_run_is_refused_naming_the_holder(tmp_path):
    first = RunDir.claim(tmp_path / "out", resume="")
    holder = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
    assert holder["run_id"] == first.run_id and holder["pid"] == os.getpid()
    with pytest.raises(ConfigError) as err:
        RunDir.claim(tmp_path / "out", resume="auto")
    for part in (f"pid {os.getpid()}", socket.gethostname(), first.run_id, holder["started"], "in use"):
        assert part in str(err.value)
    first.release()
    with RunDir.claim(tmp_path / "out", resume="auto") as second:
        assert second.run_id == first.run_id and second.resumed


_HOLDER = """
import sys, time
from megatron_gptoss.checkpoint.run_dir import RunDir
claim = RunDir.claim(sys.argv[1], resume="")
print(claim.run_id, flush=True)
time.sleep(60)
"""


def test_a_holder_in_another_process_is_named_and_its_death_frees_the_directory(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        run_id = proc.stdout.readline().strip()
        with pytest.raises(ConfigError, match=f"pid {proc.pid} on host .*, run {run_id}, started"):
            RunDir.claim(tmp_path, resume="auto")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with RunDir.claim(tmp_path, resume="auto") as claim:  # the lock died with its holder
        assert claim.run_id == run_id


def test_a_new_run_does_not_mix_with_another_runs_checkpoints(tmp_path):
    with RunDir.claim(tmp_path, resume="") as old:
        save(old.checkpoints, 1, old.run_id)
    with pytest.raises(ConfigError) as err:
        RunDir.claim(tmp_path, resume="")
    message = str(err.value)
    assert str(tmp_path) in message and f"run {old.run_id}" in message and "step_000001" in message
    assert "overwrite" in message
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()  # nothing deleted
    assert json.loads((tmp_path / IDENTITY_FILE).read_text())["run_id"] == old.run_id
    with RunDir.claim(tmp_path, resume="", overwrite=True) as new:
        assert new.run_id != old.run_id and not new.resumed
        assert not (tmp_path / "checkpoints").exists()
    assert json.loads((tmp_path / IDENTITY_FILE).read_text())["run_id"] == new.run_id


def test_resume_auto_continues_only_its_own_run(tmp_path):
    with RunDir.claim(tmp_path, resume="") as mine:
        save(mine.checkpoints, 1, mine.run_id)
    save(tmp_path / "checkpoints", 2, "someone-else")  # a checkpoint of another run copied in
    with RunDir.claim(tmp_path, resume="auto") as again:
        assert again.run_id == mine.run_id
        manager = CheckpointManager(again.checkpoints, run_id=again.run_id)
        assert manager.find_resumable() == again.checkpoints / "step_000001"
        (again.checkpoints / "step_000001" / "w.bin").write_bytes(b"x" * 64)
        with pytest.raises(CorruptCheckpointError) as err:
            manager.find_resumable()
    assert "step_000002: " in str(err.value) and "written by run someone-else" in str(err.value)
    assert "step_000001: " in str(err.value) and "checksum mismatch" in str(err.value)


def test_without_run_json_resume_adopts_the_run_its_checkpoints_name(tmp_path):
    save(tmp_path / "checkpoints", 1, "abc")
    with RunDir.claim(tmp_path, resume="auto") as claim:
        assert claim.run_id == "abc" and claim.resumed
    save(tmp_path / "checkpoints", 2, "def")
    (tmp_path / IDENTITY_FILE).unlink()
    with pytest.raises(ConfigError, match="several runs"):
        RunDir.claim(tmp_path, resume="auto")


def test_other_ranks_learn_the_run_id_or_rank_0s_error(tmp_path):
    shared: list = []

    def share(value):  # a broadcast from rank 0: rank 0 runs first here
        if value is not None:
            shared.append(value)
        return shared[-1]

    zero = RunDir.claim(tmp_path, resume="", rank=0, share=share)
    one = RunDir.claim(tmp_path, resume="", rank=1, share=share)
    assert one.run_id == zero.run_id and not (tmp_path / LOCK_FILE).read_text() == ""
    one.release()  # holds no lock: the directory stays claimed by rank 0
    with pytest.raises(ConfigError, match="in use by another live run"):
        RunDir.claim(tmp_path, resume="", rank=0, share=share)
    with pytest.raises(ConfigError, match="rank 0: cannot claim .*in use by another live run"):
        RunDir.claim(tmp_path, resume="", rank=1, share=share)
    zero.release()
    with pytest.raises(ValueError, match="needs `share`"):
        RunDir.claim(tmp_path, resume="", rank=1)


def test_a_new_run_does_not_replace_a_run_that_left_no_checkpoint(tmp_path):
    with RunDir.claim(tmp_path, resume="") as old:  # e.g. run.save_every=-1: metrics and hf_final only
        (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError) as err:
        RunDir.claim(tmp_path, resume="")
    message = str(err.value)
    assert f"belongs to run {old.run_id}" in message and "left no checkpoint" in message
    assert "overwrite" in message and "resume=auto" in message
    assert json.loads((tmp_path / IDENTITY_FILE).read_text())["run_id"] == old.run_id
    with RunDir.claim(tmp_path, resume="auto") as again:
        assert again.run_id == old.run_id
    with RunDir.claim(tmp_path, resume="", overwrite=True) as new:
        assert new.run_id != old.run_id
