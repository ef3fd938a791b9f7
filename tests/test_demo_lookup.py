"""The lookup demo's command (tools/demo_lookup.py) at tiny width and length: it writes the lookup task and
its cold-start conversations, trains the cold start (a sampled softmax over its output layer), starts agentic
RL (the calculator and lookup tools) from the cold start's HF export with the real tokenizer and the full
201,088-way output layer, evaluates the held-out keys before and after RL (reward and call rate), measures the
cold start's teacher-forced copy rates, and plots both phases on one axis."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_gptoss.envs import lookup
from megatron_gptoss.utils.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=2", "run.steps=2",
        "run.eval_every=2", "env.eval_size=3", "sft.examples_per_step=3", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "run.progress=false"]  # fmt: skip


def test_demo_runs_both_phases(tmp_path):
    spec = importlib.util.spec_from_file_location("demo_lookup", ROOT / "tools/demo_lookup.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main(["--sft", "40", "--cold-start-steps", "2", *TINY, f"run.output_dir={tmp_path}"])

    sft = [json.loads(line) for line in (tmp_path / "data/sft.jsonl").read_text().splitlines()]
    assert len(sft) == 40
    test_rows = (tmp_path / "data/test.jsonl").read_text().splitlines()
    assert len(test_rows) == len(lookup.split_keys(held_out=True))
    cold = read_metrics(tmp_path / "cold_start/metrics.jsonl")
    assert [r["step"] for r in cold] == [1, 2] and all(r["sft/tokens"] > 0 for r in cold)
    assert (tmp_path / "cold_start/hf_final/config.json").exists()
    cold_config = json.loads((tmp_path / "cold_start/config.json").read_text())
    assert cold_config["sft"]["sampled_vocab"] == 4096 and cold_config["run"]["mode"] == "sft"
    rl_config = json.loads((tmp_path / "rl/config.json").read_text())
    assert rl_config["run"]["init_from_hf"] == str(tmp_path / "cold_start/hf_final")
    assert rl_config["model"]["vocab_size"] == 201088 and rl_config["run"]["mode"] == "rl"
    assert rl_config["agent"]["enabled"] and rl_config["agent"]["tools"] == [lookup.tool_spec()]
    rl = read_metrics(tmp_path / "rl/metrics.jsonl")
    evals = [r for r in rl if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for key in ("eval/accuracy", "eval/call_rate", "reward/eval_mean"):
        assert summary["start"][key] == evals[0][key] and summary["final"][key] == evals[-1][key]
    assert summary["rl_steps"] == 2 and summary["total_s"] >= summary["cold_start_s"] + summary["rl_s"]
    copies = [summary[f"cold_start_copies_{name}"] for name in ("key", "value", "both")]
    assert all(0.0 <= rate <= 1.0 for rate in copies) and copies[2] <= min(copies[:2])
    held_out = (tmp_path / "held_out_calls.jsonl").read_text().splitlines()
    assert len(held_out) == len(test_rows)
    assert all("reward/train_mean" in r and "agent/call_rate" in r for r in rl if r["step"] > 0)
    assert (tmp_path / "both_phases.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
