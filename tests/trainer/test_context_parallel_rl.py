"""RL in the one trainer under context parallelism: parallel.context_parallel_size=2 (gloo, world 2, one
cp group; the embedded engine unchanged, generating whole rows) logs the metrics of world 1 (demo task,
2 layers of width 64, float32, a KL and an entropy term, two mini-batches so the second is off-policy):
the loss, the policy-gradient statistics, the rollout correction over the chunked tokens and the
gradient norm, for two steps; with router replay (r3: the engine's experts replayed, split like the
tokens) and with the critic (algorithm.advantage=gae: values and GAE over the gathered tokens), one step
each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.eval_every=0", "run.progress=false", "run.tensorboard=false", "run.export_hf=false",
        "run.save_every=0", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
        "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=64", "run.dtype=float32",
        "rollout.dtype=float32", "ppo.kl_coef=0.05", "ppo.entropy_coef=0.01",
        "ppo.num_mini_batches=2"]  # fmt: skip
CASES = {
    "plain": ["run.steps=2"],
    "r3": ["run.steps=1", "moe.router_replay=r3"],
    "gae": ["run.steps=1", "algorithm.advantage=gae"],
}
POLICY = ("loss/total", "pg/loss", "pg/clipfrac", "pg/ratio_mean", "pg/ratio_min", "pg/ratio_max",
          "pg/approx_kl_k3", "loss/entropy", "loss/kl", "train/grad_norm", "reward/train_mean",
          "correction/weight_mean", "correction/weight_min", "correction/weight_max", "correction/ess",
          "correction/truncated_frac", "correction/masked_frac")  # fmt: skip
EXTRA = {"plain": (), "r3": ("replay/tokens", "replay/flip_frac"), "gae": ("critic/value_loss",)}


def train(out: str, overrides: list[str]) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    if dist.is_initialized():
        dist.barrier()


def _cp2_runs(base: str) -> None:
    for name, overrides in CASES.items():
        train(f"{base}/cp2_{name}", [*overrides, "parallel.context_parallel_size=2"])


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_rl")
    for name, overrides in CASES.items():
        train(str(base / f"cp1_{name}"), overrides)
    pool(2).run(_cp2_runs, str(base))
    return {(name, cp): metrics(base / f"cp{cp}_{name}") for name in CASES for cp in (1, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_logs_the_metrics_of_world_1(runs, case):
    one, two = runs[(case, 1)], runs[(case, 2)]
    steps = [s for s in sorted(one) if s]
    assert sorted(two) == sorted(one) and steps == list(range(1, len(steps) + 1))
    for step in steps:
        for key in (*POLICY, *EXTRA[case]):
            assert key in one[step], (case, key)
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (case, step, key)
        # the engine is unchanged: its log-probs equal the learner's at either layout
        assert one[step]["mismatch/abs_diff_max"] <= 1e-6 and two[step]["mismatch/abs_diff_max"] <= 1e-6
    assert abs(one[1]["loss/total"]) > 1e-3  # a loss the comparison can tell apart
