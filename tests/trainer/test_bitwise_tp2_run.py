"""Bitwise on-policy mode in the one trainer on 2 gloo ranks: the learner at tensor parallel 2 with sequence
parallel, the embedded engine at tensor parallel 2 (`rollout.tensor_parallel_size` matched), Triton
attention, fp32. The step's rollout/learner mismatch over every loss token is exactly 0 (the command line's
`torchrun --nproc_per_node 2 -m megatron_gptoss.train --config configs/demo_cpu.yaml ...` runs the same)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
    "rollout.tensor_parallel_size=2", "rollout.bitwise_on_policy=true", "model.attention_backend=triton",
    "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=64",
    "run.steps=1", "run.eval_every=0", "env.eval_size=1", "run.save_every=-1", "run.progress=false",
    "run.tensorboard=false", "run.export_hf=false", "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4",
]  # fmt: skip


def train(out: str) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*OVERRIDES, f"run.output_dir={out}"]))
    dist.barrier()


def test_tp2_sequence_parallel_run_has_no_mismatch(tmp_path):
    pool(2).run(train, str(tmp_path / "run"), timeout=300.0)
    lines = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "mismatch/abs_diff_max" in line]
    assert len(steps) == 1 and steps[0]["mismatch/tokens"] > 0
    assert steps[0]["mismatch/abs_diff_max"] == 0.0 and steps[0]["train/skipped"] == 0.0
