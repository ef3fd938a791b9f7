"""Bit-for-bit reproducibility on the CPU for a fixed seed and thread count: the expert layers' backward
gives the same gradients on every repetition with 2 threads (the bias gather's backward once added with
racing float atomics), and two runs of the trainer log identical metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_gptoss.config import gpt_oss_demo
from megatron_gptoss.model.moe import Experts

ROOT = Path(__file__).resolve().parents[2]


def test_expert_backward_is_repeatable_with_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = gpt_oss_demo(expert_backend="loop")
        gen = torch.Generator().manual_seed(0)
        experts = Experts(config)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        tokens = 2048  # the bias gradient [rows, 2I] is past the CPU kernels' parallel threshold
        x = torch.randn(tokens, config.hidden_size, generator=gen)
        indices = torch.stack([torch.randperm(config.num_experts, generator=gen)[:2] for _ in range(tokens)])
        probs = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)
        upstream = torch.randn(tokens, config.hidden_size, generator=gen)
        first = None
        for _ in range(30):
            experts.zero_grad()
            (experts(x, probs, indices) * upstream).sum().backward()
            grads = [p.grad.clone() for p in experts.parameters()]
            first = first or grads
            assert all(torch.equal(a, b) for a, b in zip(first, grads))
    finally:
        torch.set_num_threads(threads)


def _run(out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_gptoss.train", "--config", "configs/demo_cpu.yaml", "run.steps=4",
           "run.eval_every=0", "run.progress=false", "run.export_hf=false", "run.tensorboard=false",
           "run.num_threads=2", "rollout.prompts_per_step=8", f"run.output_dir={out}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(("time/", "idle/"))} for line in lines]


def test_two_runs_with_one_seed_log_the_same_metrics(tmp_path):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    assert len(a) == 5 and a == b
