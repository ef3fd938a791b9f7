"""The separate placement on two GPUs (NCCL): rank 0 the learner on cuda:0, rank 1 the embedded engine on
cuda:1, launched by torchrun as a user would. With k = 1 and partial rollouts the run finishes, every step's
trained tokens are at most one version old and weights reach the engine at every step; with the engine in
a child process the same holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.mark.parametrize("child", [False, True])
def test_separate_placement_on_two_gpus(tmp_path, child):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "megatron_gptoss.train",
        "--config", "configs/demo_cpu.yaml", "rollout.placement=separate", "rollout.max_staleness=1",
        "rollout.partial=true", "run.steps=4", "run.eval_every=0", "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4", "run.save_every=-1", f"rollout.engine_child={str(child).lower()}",
        f"run.output_dir={out}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {d["step"]: d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(lines) == [0, 1, 2, 3, 4]
    assert all(lines[s]["staleness/max"] <= 1.0 and lines[s]["sync/bytes"] > 0 for s in (1, 2, 3, 4))
    assert all(lines[s]["engine/restarts"] == 0.0 for s in (1, 2, 3, 4))
