"""launch/torchrun_train.py end to end under torchrun (4 gloo processes, tp2 x pp2 with sequence parallel):
a run stopped gracefully and resumed with `--resume auto` logs bit for bit the losses and gradient norms
of a run that never stopped; resuming that checkpoint into another layout (pp4 with an uneven stage split,
the first stage the embedding alone) continues with the same losses to float32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/layouts/tiny_tp2_pp2_cpu.yaml"
STEPS = 4


def launch(out: Path, *extra: str, procs: int = 4) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
        str(ROOT / "launch/torchrun_train.py"), "--config", str(CONFIG), "--token-budget", "64",
        "--micro-batches", "3", f"run.steps={STEPS}", f"run.output_dir={out}", "run.tensorboard=false",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def logged(out: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {line["step"]: line for line in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    whole = base / "whole"
    ok(launch(whole))
    stopped = base / "stopped"
    stop_file = base / "STOP"
    stop_file.touch()  # seen after the first step: save and exit 0
    first = ok(launch(stopped, "--stop-file", str(stop_file), "run.save_every=0"))
    stop_file.unlink()
    saved = sorted(p.name for p in (stopped / "checkpoints").glob("step_*"))
    logged_before = sorted(logged(stopped))
    ok(launch(stopped, "--resume", "auto", "--stop-file", str(stop_file)))
    moved = base / "moved"
    other_layout = (
        "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
        "parallel.pipeline_model_parallel_size=4", "parallel.pipeline_layers=0,2,1,1",
    )  # fmt: skip
    ok(launch(moved, "--resume", str(stopped / "checkpoints" / "step_000001"), *other_layout))
    return {
        "whole": logged(whole),
        "stopped": logged(stopped),
        "moved": logged(moved),
        "saved": saved,
        "logged_before": logged_before,
        "first_stdout": first.stdout,
    }


def test_graceful_stop_saves_and_exits(runs):
    assert runs["saved"] == ["step_000001"]
    assert runs["logged_before"] == [0]
    assert "stop requested" in runs["first_stdout"]


def test_resume_auto_is_bitwise(runs):
    whole, stopped = runs["whole"], runs["stopped"]
    assert sorted(stopped) == list(range(STEPS))
    for step in range(STEPS):
        for key in ("train/loss", "train/grad_norm", "train/tokens"):
            assert stopped[step][key] == whole[step][key], (step, key, stopped[step][key], whole[step][key])
    assert whole[STEPS - 1]["train/loss"] < whole[0]["train/loss"]


def test_resume_into_another_layout(runs):
    whole, moved = runs["whole"], runs["moved"]
    assert sorted(moved) == list(range(1, STEPS))  # a fresh output dir: steps from the checkpoint on
    for step in range(1, STEPS):
        for key in ("train/loss", "train/grad_norm"):
            assert moved[step][key] == pytest.approx(whole[step][key], rel=1e-5), (step, key)
