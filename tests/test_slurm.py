"""launch/slurm_train.sbatch without Slurm: the script runs under bash with stand-ins for `srun` (one node:
its own options dropped, the command run once) and `scontrol` (`show hostnames` -> localhost; `requeue ID`
appends ID to $SCONTROL_REQUEUE_LOG) first on PATH, 2 gloo ranks on this node.

  - supervised training (tp2) runs to the end: exit 0, no requeue;
  - RL (learner and embedded engine at tp2) runs to the end the same way;
  - USR1 to the batch script (what `--signal=B:USR1@300` sends before the time limit) mid-run: the script
    creates the stop file, the ranks save after their current step and exit 0, the script requeues the
    job and exits 0; the script run again (the requeued job) finishes from that checkpoint with the
    losses of the uninterrupted run, no step logged twice, and does not requeue again;
  - the requeue decision alone (torchrun stood in for too): after USR1 the job requeues only when the ranks
    exited 0 before the run's last step; the script exits with the ranks' status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers.run_logs import logged

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch/slurm_train.sbatch"
STUBS = ROOT / "tests/launch_stubs"
JOB_ID = "4242"
QUIET = ("run.tensorboard=false", "run.progress=false", "run.export_hf=false")
# The 4-rank layouts shrunk to 2 ranks: tensor parallel 2, no pipeline.
SFT = (ROOT / "configs/layouts/tiny_tp2_pp2_cpu.yaml", "parallel.pipeline_model_parallel_size=1", *QUIET)
RL = (
    ROOT / "configs/layouts/tiny_rl_tp2_pp2_cpu.yaml", "parallel.pipeline_model_parallel_size=1",
    "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "run.eval_every=0", *QUIET,
)  # fmt: skip
SFT_STEPS = 6
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(submit_dir: Path, config: Path) -> dict[str, str]:
    """What Slurm would give the batch script of a one-node job, the stand-ins first on PATH."""
    return {
        **os.environ,
        "PATH": f"{STUBS}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_SUBMIT_DIR": str(submit_dir),
        "SCONTROL_REQUEUE_LOG": str(submit_dir / "requeued"),
        "PORT": str(free_port()),
        "CONFIG": str(config),
        "PROCS_PER_NODE": "2",
    }


def sbatch(submit_dir: Path, config, *overrides: str) -> subprocess.CompletedProcess:
    """The batch script run to its end, as Slurm would start it on the first node."""
    return subprocess.run(
        ["bash", str(SCRIPT), *overrides],
        env=job_env(submit_dir, config),
        cwd=submit_dir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def end_group(job: subprocess.Popen) -> None:
    """End what is left of the job's process group (the script and torchrun, when a test failed): SIGTERM,
    which torchrun passes to the ranks, then SIGKILL after a minute."""
    deadline = time.monotonic() + 60
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(job.pid, sig)
            while time.monotonic() < deadline:
                job.poll()  # reaps the script once it has ended
                os.killpg(job.pid, 0)
                time.sleep(0.5)
        except ProcessLookupError:
            break
    job.wait()


def requeues(submit_dir: Path) -> list[str]:
    log = submit_dir / "requeued"
    return log.read_text().split() if log.exists() else []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """Supervised training to the end under the script: exit 0, no requeue, a checkpoint of the last step."""
    submit = tmp_path_factory.mktemp("sft")
    out = submit / "out"
    config, *overrides = SFT
    ok(sbatch(submit, config, *overrides, f"run.steps={SFT_STEPS}", f"run.output_dir={out}"))
    assert requeues(submit) == []
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{SFT_STEPS:06d}"]
    assert not (submit / f".stop-{JOB_ID}").exists()
    return logged(out)


def test_supervised_run_to_the_end(uninterrupted):
    assert sorted(uninterrupted) == list(range(1, SFT_STEPS + 1))
    assert uninterrupted[SFT_STEPS]["sft/loss"] < uninterrupted[1]["sft/loss"]


def test_rl_run_to_the_end(tmp_path):
    out = tmp_path / "out"
    config, *overrides = RL
    result = ok(sbatch(tmp_path, config, *overrides, "run.steps=2", f"run.output_dir={out}"))
    assert requeues(tmp_path) == []
    metrics = logged(out)
    assert sorted(metrics) == [0, 1, 2]  # step 0: the evaluation before training
    for step in (1, 2):
        for key in ("reward/train_mean", "mismatch/abs_diff_max", "pg/ratio_max"):
            assert key in metrics[step], (step, sorted(metrics[step]))
    assert "2 ranks" in result.stdout


def test_usr1_checkpoints_requeues_and_the_requeued_job_finishes(tmp_path, uninterrupted):
    out = tmp_path / "out"
    config, *overrides = SFT
    args = (*overrides, f"run.steps={SFT_STEPS}", f"run.output_dir={out}")
    console = (tmp_path / "first.log").open("w+")
    job = subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        env=job_env(tmp_path, config),
        cwd=tmp_path,
        stdout=console,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the script and torchrun: one process group, ended together on failure
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert job.poll() is None and time.monotonic() < deadline, "no step logged"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)  # the batch shell only, as --signal=B:USR1@300 does
        job.wait(timeout=TIMEOUT_S)
    finally:
        end_group(job)
    console.seek(0)
    said = console.read()
    assert job.returncode == 0, said[-6000:]
    assert "requeueing" in said and requeues(tmp_path) == [JOB_ID], said[-3000:]
    stopped_at = max(logged(out))
    assert 1 <= stopped_at < SFT_STEPS
    assert f"stopped after step {stopped_at} with a checkpoint" in said
    assert (out / f"checkpoints/step_{stopped_at:06d}").is_dir()
    assert not (tmp_path / f".stop-{JOB_ID}").exists()  # removed: the requeued job must not stop at once

    second = ok(sbatch(tmp_path, config, *args))  # the requeued job
    assert f"resumed from {out}/checkpoints/step_{stopped_at:06d}" in second.stderr
    assert requeues(tmp_path) == [JOB_ID]  # finished: not requeued again
    resumed = logged(out)
    assert sorted(resumed) == list(range(1, SFT_STEPS + 1))
    for step in resumed:
        for key in ("sft/loss", "train/grad_norm"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


# Stands in for torchrun and its ranks: Slurm's USR1 reaches the batch shell mid-run, the ranks log
# $LOGGED_STEPS steps into run.output_dir and exit with $RANKS_STATUS.
FAKE_TORCHRUN = """#!/usr/bin/env bash
kill -USR1 "$PPID"
for arg in "$@"; do [[ $arg == run.output_dir=* ]] && out=${arg#run.output_dir=}; done
mkdir -p "$out"
for step in $(seq 1 "$LOGGED_STEPS"); do echo "{\\"step\\": $step}" >>"$out/metrics.jsonl"; done
exit "$RANKS_STATUS"
"""


@pytest.mark.parametrize(
    ("logged_steps", "ranks_status", "requeued"),
    [(3, 0, False), (2, 0, True), (2, 3, False)],
    ids=["stopped-at-the-last-step", "stopped-early", "ranks-failed"],
)
def test_requeue_only_when_stopped_early_and_clean(tmp_path, logged_steps, ranks_status, requeued):
    fake = tmp_path / "bin/torchrun"
    fake.parent.mkdir()
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    env = job_env(tmp_path, SFT[0])
    env.update(PATH=f"{fake.parent}{os.pathsep}{env['PATH']}", LOGGED_STEPS=str(logged_steps))
    env["RANKS_STATUS"] = str(ranks_status)
    result = subprocess.run(
        ["bash", str(SCRIPT), "run.steps=3", f"run.output_dir={tmp_path / 'out'}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == ranks_status, result.stdout + result.stderr
    assert requeues(tmp_path) == ([JOB_ID] if requeued else []), result.stdout + result.stderr
    assert not (tmp_path / f".stop-{JOB_ID}").exists()
