"""The critic is checkpointed, resharded and resumed like the policy: a gae run of three steps at world 1,
and the same run stopped after each step and resumed at world 2 (gloo: learner and engine tensor parallel
2), then back at world 1. The resumed steps' critic loss, gradient norm and explained variance, and the
policy's loss, equal the uninterrupted run's to float32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", "run.tensorboard=false",
        "run.progress=false", "run.eval_every=0", "run.export_hf=false", "optim.warmup_steps=0",
        "run.save_every=1", "env.eval_size=2", "algorithm.advantage=gae", "critic.lr=1e-3",
        "env.prefix_credit=0.5"]  # fmt: skip
WORLD2 = ["parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=2"]
COMPARED = ("critic/value_loss", "critic/grad_norm", "critic/explained_var", "critic/values_mean", "pg/loss")


def train(out: str, overrides: list[str]) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    if dist.is_initialized():
        dist.barrier()


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_critic_resumes_across_layouts(tmp_path):
    train(str(tmp_path / "whole"), ["run.steps=3"])
    train(str(tmp_path / "moved"), ["run.steps=1"])
    pool(2).run(train, str(tmp_path / "moved"), ["run.steps=2", "run.resume=auto", *WORLD2])
    train(str(tmp_path / "moved"), ["run.steps=3", "run.resume=auto"])
    whole, moved = metrics(tmp_path / "whole"), metrics(tmp_path / "moved")
    assert sorted(moved) == sorted(whole) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in COMPARED:
            assert moved[step][key] == pytest.approx(whole[step][key], rel=1e-4, abs=1e-6), (step, key)
    # the critic learned between the steps, so a critic restarted from the policy would differ
    assert whole[3]["critic/values_mean"] != whole[1]["critic/values_mean"]
