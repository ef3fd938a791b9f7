"""Router replay in the one trainer at world 1 (the demo's model and task, float32): with r3 the embedded
engine records every token's experts, the learner's old-policy pass replays them (the engine's log-probs
equal the learner's, the on-policy ratio is 1) and the step logs how many tokens the learner would have
routed otherwise; with r2 the update replays the old-policy pass's own experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.steps=2", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
        "run.export_hf=false", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
        "ppo.num_mini_batches=2"]  # fmt: skip


def run(out: Path, replay: str) -> dict[int, dict]:
    overrides = [*FAST, f"moe.router_replay={replay}", f"run.output_dir={out}"]
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", overrides))
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("replay", ["r3", "r2"])
def test_replay_runs_in_the_trainer(tmp_path, replay):
    lines = run(tmp_path / replay, replay)
    for step in (1, 2):
        line = lines[step]
        assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])
        assert line["pg/ratio_min"] <= 1.0 <= line["pg/ratio_max"] and line["train/skipped"] == 0.0
        if replay == "r3":
            assert line["replay/tokens"] > 0 and 0.0 <= line["replay/flip_frac"] <= 1.0
            assert line["replay/mismatch_off_abs_diff_max"] >= 0.0
        else:
            assert "replay/flip_frac" not in line


def test_r3_needs_an_engine_that_records_routing():
    with pytest.raises(ConfigError, match="rollout.engine='vllm' does not return it"):
        load_config(ROOT / "configs/demo_cpu.yaml", ["moe.router_replay=r3", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=1"):
        load_config(
            ROOT / "configs/demo_cpu.yaml", ["moe.router_replay=r3", "rollout.tensor_parallel_size=2"]
        )
    with pytest.raises(ConfigError, match="moe.router_replay='r4' not in"):
        load_config(ROOT / "configs/demo_cpu.yaml", ["moe.router_replay=r4"])


def test_bitwise_on_policy_run_has_no_mismatch(tmp_path):
    """rollout.bitwise_on_policy: the engine's log-probs equal the learner's old-policy pass exactly."""
    bitwise = ["rollout.bitwise_on_policy=true", "model.attention_backend=triton", "rollout.max_new_tokens=4"]
    small = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=64", "run.steps=1"]
    overrides = [*FAST, *bitwise, *small, "rollout.prompts_per_step=2", f"run.output_dir={tmp_path}"]
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", overrides))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "mismatch/abs_diff_max" in line]
    assert len(steps) == 1
    for line in steps:
        assert line["mismatch/abs_diff_max"] == 0.0 and line["train/skipped"] == 0.0


def test_bitwise_on_policy_names_what_it_needs():
    with pytest.raises(ConfigError, match="model.attention_backend='triton'"):
        load_config(ROOT / "configs/demo_cpu.yaml", ["rollout.bitwise_on_policy=true"])
    with pytest.raises(
        ConfigError,
        match="rollout.engine='embedded'.*"
        "rollout.tensor_parallel_size=1 equal to parallel.tensor_model_parallel_size=2",
    ):
        load_config(
            ROOT / "configs/demo_cpu.yaml",
            [
                "rollout.bitwise_on_policy=true",
                "rollout.engine=vllm",
                "parallel.tensor_model_parallel_size=2",
            ],
        )
