"""The one trainer (`python -m megatron_gptoss.train`) in supervised mode under torchrun and without it.

4 gloo processes, tp2 x pp2 with sequence parallel (`configs/layouts/tiny_tp2_pp2_cpu.yaml`):
  - a stop file that exists from the start: every rank saves after step 1 and exits 0; `--resume auto`
    then logs bit for bit the losses and gradient norms of a run that never stopped;
  - that checkpoint resumed into another layout (pp4, an uneven stage split with the embedding alone on
    the first stage) continues with the same losses to float32 rounding;
  - SIGTERM to the torchrun launcher mid-run: torchrun forwards it to the ranks, which save after the same
    step and leave `main` normally (per-rank logs: no traceback, rank 0's final line). torchrun itself
    raises SignalException once the ranks are gone, so the launcher exits 1 with a traceback: that is
    torchrun's design (a signalled agent reports failure), not the ranks'.
One rank without torchrun, then two ranks (data parallel 2, distributed optimizer) under torchrun, then one
again, all in one output directory with `--resume auto`: the losses of an uninterrupted one-rank run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.run_logs import logged

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/layouts/tiny_tp2_pp2_cpu.yaml"
STEPS = 4
QUIET = ("run.tensorboard=false", "run.progress=false", "run.export_hf=false")
# The demo's task (arithmetic, supervised on reference answers) with the tiny model: one rank or two.
WORLD_CHANGE = (
    "--config", str(ROOT / "configs/demo_cpu.yaml"), "run.mode=sft", "model.preset=gpt_oss_tiny",
    "model.vocab_size=32", "sft.examples_per_step=8", "sft.micro_batches=2", "run.steps=3",
    "parallel.use_distributed_optimizer=true", *QUIET,
)  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TIMEOUT_S = 300


def torchrun(procs: int, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    """The trainer with `args` under torchrun (`options`: torchrun's own) on `procs` local ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *options,
        "-m", "megatron_gptoss.train", *args,
    ]  # fmt: skip


def tiny(out: Path, *extra: str, steps: int = STEPS, options: tuple[str, ...] = ()) -> list[str]:
    """The tp2 x pp2 run of `steps` steps into `out` under torchrun (4 ranks)."""
    args = ("--config", str(CONFIG), f"run.steps={steps}", f"run.output_dir={out}", *QUIET, *extra)
    return torchrun(4, *args, options=options)


def ok(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def saved(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    whole, stopped, moved = base / "whole", base / "stopped", base / "moved"
    ok(tiny(whole))
    stop_file = base / "STOP"
    stop_file.touch()  # seen after the first step: save and exit 0
    first = ok(tiny(stopped, "--stop-file", str(stop_file)))
    stop_file.unlink()
    after_stop = {"saved": saved(stopped), "logged": sorted(logged(stopped)), "stderr": first.stderr}
    other_layout = (
        "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
        "parallel.pipeline_model_parallel_size=4", "parallel.pipeline_layers=[0,2,1,1]",
    )  # fmt: skip
    ok(tiny(moved, "--resume", str(stopped / "checkpoints/step_000001"), *other_layout))
    ok(tiny(stopped, "--resume", "auto", "--stop-file", str(stop_file)))
    return {"whole": logged(whole), "stopped": logged(stopped), "moved": logged(moved), **after_stop}


def test_stop_file_saves_after_step_one_and_exits_0(runs):
    assert runs["saved"] == ["step_000001"]
    assert runs["logged"] == [1]
    assert "stop requested (stop file" in runs["stderr"]
    assert "stopped after step 1 with a checkpoint" in runs["stderr"]


def test_resume_auto_is_bitwise(runs):
    whole, stopped = runs["whole"], runs["stopped"]
    assert sorted(whole) == sorted(stopped) == list(range(1, STEPS + 1))
    for step in whole:
        for key in ("sft/loss", "train/grad_norm", "sft/tokens"):
            assert stopped[step][key] == whole[step][key], (step, key, stopped[step][key], whole[step][key])
    assert whole[STEPS]["sft/loss"] < whole[1]["sft/loss"]


def test_resume_into_another_layout(runs):
    whole, moved = runs["whole"], runs["moved"]
    assert sorted(moved) == list(range(2, STEPS + 1))  # a fresh output dir: the steps after the checkpoint
    for step in moved:
        for key in ("sft/loss", "train/grad_norm"):
            assert moved[step][key] == pytest.approx(whole[step][key], rel=1e-5), (step, key)


def test_sigterm_to_the_launcher_saves_on_every_rank(tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = tiny(out, steps=500, options=("--log-dir", str(logs), "--redirects", "3"))  # per-rank logs
    env = {**ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}  # the ranks' time to save before SIGKILL
    console = (tmp_path / "launcher.log").open("w+")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert launcher.poll() is None and time.monotonic() < deadline, "no step logged"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)  # the launcher only: it forwards SIGTERM to the ranks
        launcher.wait(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:  # the ranks run in sessions of their own: torchrun ends them
            launcher.terminate()
            try:
                launcher.wait(timeout=150)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    console.seek(0)
    said = console.read()
    # torchrun re-raises the signal as SignalException after the ranks have exited: exit 1, a traceback
    assert launcher.returncode == 0 or "SignalException" in said, (launcher.returncode, said[-3000:])
    steps = sorted(logged(out))
    assert 1 <= steps[-1] < 500
    assert saved(out) == [f"step_{steps[-1]:06d}"]  # every rank wrote its part after the last step logged
    rank_logs = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(rank_logs) == ["0", "1", "2", "3"], sorted(logs.rglob("*"))
    for rank, text in rank_logs.items():
        assert f"rank {rank}: stop requested (SIGTERM)" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    assert f"stopped after step {steps[-1]} with a checkpoint" in rank_logs["0"]
    rank0_out = next(p for p in logs.rglob("stdout.log") if p.parent.name == "0").read_text()
    assert '"final"' in rank0_out  # rank 0 left main() normally (exit status 0)


def test_world_size_changes_across_resumes(tmp_path):
    whole, changing, stop_file = tmp_path / "whole", tmp_path / "changing", tmp_path / "STOP"
    single = [sys.executable, "-m", "megatron_gptoss.train"]
    ok([*single, *WORLD_CHANGE, f"run.output_dir={whole}"])
    stop_file.touch()  # every segment stops after one step
    segment = (*WORLD_CHANGE, f"run.output_dir={changing}", "--stop-file", str(stop_file))
    ok([*single, *segment])
    ok(torchrun(2, *segment, "--resume", "auto"))
    stop_file.unlink()
    ok([*single, *segment, "--resume", "auto"])
    expected, got = logged(whole), logged(changing)
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step in expected:
        for key in ("sft/loss", "train/grad_norm"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-4), (step, key)
    assert expected[3]["sft/loss"] < expected[1]["sft/loss"]
