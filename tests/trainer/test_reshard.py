"""One trainer, any world size: an RL run of three steps at world 1 (a plain process), and the same run
stopped after each step and resumed at world 4 (gloo: learner tensor parallel 2 x data parallel 2, the
embedded engine at tensor parallel 2 with two replicas), then back at world 1. Seeded sampling gives every
row its own stream, so the resumed steps see the same rollouts and their losses, rewards and gradient
norms equal the uninterrupted run's to float32 rounding; at both world sizes the engine's log-probs equal
the learner's (max |delta| <= 1e-6) and the on-policy ratio is exactly 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["rollout.prompts_per_step=6", "rollout.n_samples_per_prompt=4", "run.tensorboard=false",
        "run.progress=false", "run.eval_every=0", "run.export_hf=false", "optim.warmup_steps=0",
        "run.save_every=1", "ppo.kl_coef=0.05"]  # fmt: skip
WORLD4 = ["parallel.tensor_model_parallel_size=2", "parallel.use_distributed_optimizer=true",
          "rollout.tensor_parallel_size=2"]  # fmt: skip
COMPARED = (
    "reward/train_mean", "response/length_mean", "pg/loss", "loss/entropy", "loss/kl", "train/grad_norm"
)  # fmt: skip


def train(out: str, overrides: list[str]) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    if dist.is_initialized():
        dist.barrier()


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard")
    train(str(base / "whole"), ["run.steps=3"])
    train(str(base / "moved"), ["run.steps=1"])
    pool(4).run(train, str(base / "moved"), ["run.steps=2", "run.resume=auto", *WORLD4])
    train(str(base / "moved"), ["run.steps=3", "run.resume=auto"])
    return metrics(base / "whole"), metrics(base / "moved")


def test_resharded_steps_equal_the_uninterrupted_run(runs):
    whole, moved = runs
    assert sorted(moved) == sorted(whole) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in COMPARED:
            assert key in whole[step], key
            assert moved[step][key] == pytest.approx(whole[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert whole[3]["pg/loss"] != whole[1]["pg/loss"]  # the steps differ: the comparison can fail


def test_engine_equals_learner_at_world_1_and_4(runs):
    for line in [*runs[0].values(), *runs[1].values()]:
        if line["step"]:
            assert line["mismatch/abs_diff_max"] <= 1e-6, line
            assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
