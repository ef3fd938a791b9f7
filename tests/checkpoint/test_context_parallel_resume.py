"""Checkpoints across context-parallel layouts, through the one trainer (run.mode=sft on the demo's task,
the tiny model, float32): a run saved at context_parallel_size=2 (gloo, world 2) resumes at world 1, and
one saved at world 1 resumes at cp2; each resumed step's metrics equal an uninterrupted run's at the
layout it resumed from (loss/total within 1e-5 relative), so the sharded state loads into and out of
the cp layout whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.mode=sft", "model.preset=gpt_oss_tiny", "model.vocab_size=32", "sft.examples_per_step=8",
        "sft.micro_batches=2", "run.dtype=float32", "run.save_every=1", "run.eval_every=0",
        "run.tensorboard=false", "run.progress=false", "run.export_hf=false", "optim.warmup_steps=0",
        "parallel.use_distributed_optimizer=true"]  # fmt: skip
CP2 = "parallel.context_parallel_size=2"
COMPARED = ("loss/total", "train/grad_norm")


def train(out: str, *overrides: str) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    if dist.is_initialized():
        dist.barrier()


def _cp2_runs(base: str) -> None:
    """On the cp2 ranks: the uninterrupted run, a run stopped after step 2, and the resume of the world-1
    run stopped after step 2."""
    train(f"{base}/whole_cp2", CP2, "run.steps=3")
    train(f"{base}/from_cp2", CP2, "run.steps=2")
    train(f"{base}/from_cp1", CP2, "run.steps=3", "run.resume=auto")


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_resume")
    train(str(base / "whole_cp1"), "run.steps=3")
    train(str(base / "from_cp1"), "run.steps=2")
    pool(2).run(_cp2_runs, str(base))
    train(str(base / "from_cp2"), "run.steps=3", "run.resume=auto")
    return {name: metrics(base / name) for name in ("whole_cp1", "whole_cp2", "from_cp1", "from_cp2")}


def test_cp2_resumes_at_cp1_and_cp1_at_cp2(runs):
    for moved, whole in (("from_cp2", "whole_cp1"), ("from_cp1", "whole_cp2")):
        assert sorted(runs[moved]) == sorted(runs[whole]), (moved, whole)
        for step in (1, 2, 3):
            for key in COMPARED:
                expected = runs[whole][step][key]
                assert runs[moved][step][key] == pytest.approx(expected, rel=1e-5), (moved, step, key)
    whole = runs["whole_cp1"]
    assert whole[3]["loss/total"] != pytest.approx(whole[2]["loss/total"], rel=1e-3)  # the steps differ
