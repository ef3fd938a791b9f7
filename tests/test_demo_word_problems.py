"""The harmony demo's command (tools/demo_word_problems.py) at tiny width and length: it writes the word
problems and their cold-start conversations, trains the cold start, starts RL from the cold start's HF
export (the real tokenizer and the full 201,088-way output layer in both), evaluates the held-out problems
before and after RL, and plots both phases on one axis."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from PIL import Image

from megatron_gptoss.utils.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=2", "run.steps=2",
        "run.eval_every=2", "env.eval_size=3", "sft.examples_per_step=3", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "run.progress=false"]  # fmt: skip


def test_demo_runs_both_phases(tmp_path):
    spec = importlib.util.spec_from_file_location("demo_word_problems", ROOT / "tools/demo_word_problems.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main(["--train", "12", "--cold-start-steps", "2", *TINY, f"run.output_dir={tmp_path}"])

    assert len((tmp_path / "data/sft.jsonl").read_text().splitlines()) == 12
    assert len((tmp_path / "data/test.jsonl").read_text().splitlines()) == 200
    cold = read_metrics(tmp_path / "cold_start/metrics.jsonl")
    assert [r["step"] for r in cold] == [1, 2] and all(r["sft/tokens"] > 0 for r in cold)
    assert (tmp_path / "cold_start/hf_final/config.json").exists()
    rl_config = json.loads((tmp_path / "rl/config.json").read_text())
    assert rl_config["run"]["init_from_hf"] == str(tmp_path / "cold_start/hf_final")
    assert rl_config["model"]["vocab_size"] == 201088 and rl_config["run"]["mode"] == "rl"
    rl = read_metrics(tmp_path / "rl/metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r]
    assert [s for s, _ in evals] == [0, 2]
    assert (
        summary["start"]["eval/accuracy"] == evals[0][1] and summary["final"]["eval/accuracy"] == evals[-1][1]
    )
    assert all("reward/train_mean" in r for r in rl if r["step"] > 0)
    assert (tmp_path / "both_phases.png").stat().st_size > 10_000
    # plots name the runs by their directories, never by this machine's (temporary) paths
    assert Image.open(tmp_path / "both_phases.png").text["Title"] == "cold_start -> rl"
    assert Image.open(tmp_path / "rl/metrics.png").text["Title"] == "rl"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
