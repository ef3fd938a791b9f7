"""The README's demo (tools/demo.sh -> tools/demo_reverse.py) at tiny width and length: the cold start on
configs/demo_reverse.yaml, RL from its HF export, held-out evaluations before and after RL, the plot of both
phases and the summary as the last printed line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_gptoss import two_phase
from megatron_gptoss.config import load_config
from megatron_gptoss.utils.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.intermediate_size=32", "run.steps=2", "run.eval_every=2",
        "env.eval_size=8", "sft.examples_per_step=4", "sft.micro_batches=2", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "ppo.num_micro_batches=2", "run.progress=false",
        "run.tensorboard=false"]  # fmt: skip


def test_demo_runs_both_phases(tmp_path, capfd):
    spec = importlib.util.spec_from_file_location("demo_reverse", ROOT / "tools/demo_reverse.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main(["--cold-start-steps", "3", *TINY, f"run.output_dir={tmp_path}"])

    cold = read_metrics(tmp_path / "cold_start/metrics.jsonl")
    assert [r["step"] for r in cold] == [1, 2, 3] and all(r["sft/tokens"] == 4 * 5 for r in cold)
    rl_config = json.loads((tmp_path / "rl/config.json").read_text())
    assert rl_config["run"]["init_from_hf"] == str(tmp_path / "cold_start/hf_final")
    assert rl_config["run"]["mode"] == "rl" and rl_config["run"]["steps"] == 2
    assert rl_config["env"]["name"] == "reverse" and rl_config["model"]["num_layers"] == 2
    rl = read_metrics(tmp_path / "rl/metrics.jsonl")
    evals = [r for r in rl if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert summary["start"] == {k: evals[0][k] for k in ("eval/accuracy", "reward/eval_mean")}
    assert summary["final"] == {k: evals[-1][k] for k in ("eval/accuracy", "reward/eval_mean")}
    assert all("loss/entropy" in r and "reward/train_mean" in r for r in rl if r["step"] > 0)
    assert (tmp_path / "both_phases.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    last = capfd.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary


def test_gpu_variant_loads_and_runs_tiny(tmp_path):
    """`tools/demo_reverse.py --gpu` (the command the README gives for one GPU): its config at full size
    loads as the docstring describes it; shrunk, both phases run on the CPU with the variant's settings."""
    cfg = load_config(ROOT / "configs/demo_reverse_gpu.yaml")
    assert (cfg.env.name, cfg.env.digits, cfg.env.eval_size, cfg.run.steps) == ("reverse", 6, 1000, 200)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.rollout.prompts_per_step) == (4, 256, 64)
    spec = importlib.util.spec_from_file_location("demo_reverse", ROOT / "tools/demo_reverse.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    tiny = [*TINY, "model.num_layers=2", "model.head_dim=8", "sft.examples_per_step=2", "sft.micro_batches=1",
            "env.eval_size=4", "ppo.num_micro_batches=1", "run.steps=1", "run.eval_every=1",
            "model.attention_backend=eager", "env.digits=4"]  # fmt: skip
    # eager: "auto" is Triton's interpreter under pytest; four digits: six list 10**6 strings per phase
    summary = demo.main(["--gpu", "--cold-start-steps", "1", *tiny, f"run.output_dir={tmp_path}"])

    cold_config = json.loads((tmp_path / "cold_start/config.json").read_text())
    assert cold_config["optim"]["lr"] == 1.0e-3 and cold_config["run"]["mode"] == "sft"
    rl_config = json.loads((tmp_path / "rl/config.json").read_text())
    assert rl_config["model"]["hidden_size"] == 32 and rl_config["rollout"]["max_new_tokens"] == 7
    assert rl_config["rollout"]["prompts_per_step"] == 2 and rl_config["sft"]["examples_per_step"] == 2
    assert rl_config["run"]["init_from_hf"] == str(tmp_path / "cold_start/hf_final")
    evals = [r for r in read_metrics(tmp_path / "rl/metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert summary["start"]["eval/accuracy"] == evals[0]["eval/accuracy"]
    assert summary["final"]["eval/accuracy"] == evals[-1]["eval/accuracy"]


def test_demo_sh_ends_in_the_demo_command():
    """The README's first command: its last line is one python3 command that passes the overrides on."""
    lines = [line for line in (ROOT / "tools/demo.sh").read_text().splitlines() if line.strip()]
    assert lines[-1] == 'python3 tools/demo_reverse.py "$@"'


def test_output_dir_is_taken_from_the_overrides():
    parser = two_phase.make_parser("demo", cold_start_steps=7)
    args, rest = two_phase.parse(parser, ["run.seed=1", "run.output_dir=/tmp/a", "run.steps=3"], "out/x")
    assert args.out == Path("/tmp/a") and args.cold_start_steps == 7 and rest == ["run.seed=1", "run.steps=3"]
    args, rest = two_phase.parse(parser, ["--cold-start-steps", "2"], "out/x")
    assert args.out == Path("out/x") and args.cold_start_steps == 2 and rest == []
    with pytest.raises(SystemExit):
        two_phase.parse(parser, ["run.output_dir="], "out/x")
