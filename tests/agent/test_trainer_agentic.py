"""Agentic rollouts in the one trainer (`agent.enabled`), with the real tokenizer and harmony prompts, and a
policy that calls the calculator (tests/agent/scripted_policy.py):

- world 1 with engine sessions, and world 1 re-generating every turn (rounds waiting for every tool call);
- world 4 (gloo), the embedded engine with one rank per replica: each replica's own loop with sessions;
- world 4, the embedded engine at tensor parallel 2 x expert parallel 4 (two tp groups stepping together):
  every rank runs the loop in lockstep, rank 0 the tools (rounds waiting for every tool call, as the
  world-1 run it is compared with); a round with fewer rows than engine replicas pads them.

Every run trains on trajectories with tool tokens out of the loss: the engine's log-probs of the model's
tokens equal the learner's (fp32), the on-policy ratio is exactly 1, the tool metrics count the calls. A
world-4 run samples the same trajectories as the world-1 run of the same mode, and its losses and gradient
norms agree to float32 reduction order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool
from scripted_policy import write_scripted_checkpoint

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
SAME = ("reward/train_mean", "response/length_mean", "agent/call_rate", "agent/tool_calls_mean",
        "agent/tokens_model", "agent/tokens_tool", "agent/turns_mean", "tool/calls")  # fmt: skip


REGEN = ["agent.sessions=false", "agent.wait_for_tools=true"]  # rounds independent of tool timing


def write_inputs(base: Path) -> Path:
    """`base` holding what `overrides` names: the scripted policy's checkpoint, 8 training and 2 held-out
    problems."""
    write_scripted_checkpoint(base / "scripted", max_position_embeddings=1024)
    problems(base / "train.jsonl", 8)
    problems(base / "test.jsonl", 2)
    return base


def problems(path: Path, rows: int) -> Path:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"What is 2 + 3? ({i})", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    return path


def overrides(base: Path, out: str) -> list[str]:
    return [
        "model.preset=gpt_oss_tiny", "model.vocab_size=201088", "model.max_position_embeddings=1024",
        f"run.init_from_hf={base / 'scripted'}", "env.name=dataset",
        f"data.train_files=[{base / 'train.jsonl'}]", f"data.eval_files=[{base / 'test.jsonl'}]",
        "env.eval_size=2", "reward.workers=0", "optim.lr=1e-4", "optim.warmup_steps=0",
        "agent.enabled=true", "agent.builtin_tools=[calculator]", "agent.max_turns=3",
        "agent.max_total_tokens=700", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=24", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
        "run.export_hf=false", "run.save_every=0", f"run.steps={STEPS}", f"run.output_dir={out}",
    ]  # fmt: skip


def train(base: str, out: str, extra: list[str]) -> None:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*overrides(Path(base), out), *extra]))
    if dist.is_initialized():
        dist.barrier()


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = write_inputs(tmp_path_factory.mktemp("agentic"))
    train(str(base), str(base / "w1"), [])
    train(str(base), str(base / "w1_regen"), REGEN)
    workers = pool(4)
    workers.run(train, str(base), str(base / "w4"), [])
    tp2_ep4 = ["rollout.tensor_parallel_size=2", "rollout.expert_parallel_size=4", *REGEN]
    workers.run(train, str(base), str(base / "w4_tp2"), tp2_ep4)
    return {name: metrics(base / name) for name in ("w1", "w1_regen", "w4", "w4_tp2")}


@pytest.mark.parametrize("name", ["w1", "w1_regen", "w4", "w4_tp2"])
def test_trajectories_call_tools_and_train_on_model_tokens_only(runs, name):
    run = runs[name]
    assert sorted(run) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        line = run[step]
        assert line["agent/tool_calls_mean"] > 0 and line["agent/tokens_tool"] > 0, line
        assert line["tool/calls"] > 0 and line["tool/ok"] > 0
        # loss tokens are the model's only: response/length_mean counts them
        assert line["response/length_mean"] * 8 == pytest.approx(line["agent/tokens_model"])
        assert line["mismatch/tokens"] == line["agent/tokens_model"]
        assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])
        assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
    final = run[STEPS]
    assert 0.0 <= final["eval/call_rate"] <= 1.0 and "eval/accuracy" in final


@pytest.mark.parametrize(("sharded", "single"), [("w4", "w1"), ("w4_tp2", "w1_regen")])
def test_world_4_samples_and_learns_as_world_1(runs, sharded, single):
    for step in range(1, STEPS + 1):
        a, b = runs[sharded][step], runs[single][step]
        for key in SAME:
            assert a[key] == b[key], (step, key, a[key], b[key])
        for key in ("pg/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)
