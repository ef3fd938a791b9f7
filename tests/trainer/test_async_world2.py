"""Partial rollouts with bounded staleness on 2 gloo ranks (colocated: the learner at data parallel 2, two
embedded-engine replicas): each replica queues and steps its block of every batch's rows and the rows are
gathered in order (`EmbeddedHost.start` / `finish`); every trained token is at most one version old, every
rank logs the same rows and the batch ahead counts in `buffer/depth`."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from helpers.batches import observed_batches
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]


def train(out: str) -> list[list[int]]:
    overrides = ["run.steps=2", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
                 "env.eval_size=1", "run.save_every=-1", "run.export_hf=false", "rollout.prompts_per_step=2",
                 "rollout.n_samples_per_prompt=2", "rollout.max_staleness=1", "rollout.partial=true",
                 f"run.output_dir={out}"]  # fmt: skip
    recorded: list[list[int]] = []  # the versions of every step's trained tokens
    with observed_batches(lambda _, batch: recorded.append(batch.versions[batch.loss_mask > 0].tolist())):
        loop.run(load_config(ROOT / "configs/demo_cpu.yaml", overrides))
    dist.barrier()
    return recorded


def test_partial_rollouts_on_two_ranks(tmp_path):
    versions = pool(2).run(train, str(tmp_path / "run"))
    assert versions[0] == versions[1]  # every rank trained the same tokens
    lines = {d["step"]: d for d in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())}
    assert len(versions[0]) == 2
    for step, seen in enumerate(versions[0], start=1):
        assert seen and max(seen) <= step - 1 and min(seen) >= max(0, step - 2)
        assert lines[step]["staleness/max"] == max(step - 1 - v for v in seen) <= 1.0
    assert lines[2]["staleness/max"] == 1.0 and lines[1]["buffer/depth"] == 4.0
