"""Two-phase demos: a supervised cold start, then RL from the cold start's HF export, one plot of both phases
and a summary. The demos in tools/ (demo_reverse.py, demo_lookup.py) are this driver with their task's data,
config and settings.

    OUT/cold_start       python -m megatron_gptoss.train --config CONFIG [data] [user] [cold start's own]
                         run.steps=N run.output_dir=OUT/cold_start
    OUT/rl               python -m megatron_gptoss.train --config CONFIG [data] [RL's own]
                         run.init_from_hf=OUT/cold_start/hf_final run.output_dir=OUT/rl [user]
    OUT/both_phases.png  the cold start's metrics, then RL's, on one step axis
    OUT/summary.json     also the last line printed: {"start": RL's step-0 evaluation (the cold start's
                         policy, greedy, every held-out prompt), "final": RL's last evaluation, "rl_steps":
                         its step, "cold_start_s", "rl_s", "total_s": wall seconds, the demo's own entries}

The user's overrides (section.field=value) apply to both phases; the cold start's own settings (mode, length,
learning rate) come after them, RL's own before them. `run.output_dir=DIR` among them names OUT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_gptoss.utils.metrics import read_metrics
from megatron_gptoss.utils.plot import plot_metrics

OUTPUT_DIR = "run.output_dir="


def make_parser(doc: str, cold_start_steps: int) -> argparse.ArgumentParser:
    """A demo's command line: --cold-start-steps (default `cold_start_steps`); the demo may add options of
    its own, then `parse` it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cold-start-steps",
        type=int,
        default=cold_start_steps,
        help=f"supervised steps of the cold start (default {cold_start_steps})",
    )
    return parser


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, default_out: str
) -> tuple[argparse.Namespace, list[str]]:
    """The options and the config overrides after them. `run.output_dir=DIR` among the overrides (the last
    one if several) is taken out of them and becomes `args.out` (a Path; `default_out` without one)."""
    args, rest = parser.parse_known_args(argv)
    outs = [item[len(OUTPUT_DIR) :] for item in rest if item.startswith(OUTPUT_DIR)]
    out = outs[-1] if outs else default_out
    if not out.strip():
        parser.error("run.output_dir is empty: name the demo's output directory")
    args.out = Path(out)
    return args, [item for item in rest if not item.startswith(OUTPUT_DIR)]


class TwoPhase:
    """One demo run into `out`: `cold_start`, then `rl`, then `finish`. `config`: the YAML both phases start
    from; `user`: the user's overrides (without run.output_dir). Each phase is a `megatron_gptoss.train`
    process (its output goes to this process's); a failed phase raises CalledProcessError."""

    def __init__(self, config: Path, out: Path, user: Sequence[str]) -> None:
        self.config, self.out, self.user = config, out, list(user)
        self.cold_start_dir, self.rl_dir = out / "cold_start", out / "rl"
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def train(self, phase: str, overrides: Sequence[str]) -> None:
        """Run the trainer on `config` with `overrides`; its wall time is `seconds[phase]`."""
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "megatron_gptoss.train", "--config", str(self.config), *overrides]
        subprocess.run(cmd, check=True)
        self.seconds[phase] = time.perf_counter() - start

    def cold_start(self, steps: int, own: Sequence[str], data: Sequence[str] = ()) -> Path:
        """The supervised phase (`own` holds run.mode=sft and its other settings, after the user's overrides);
        returns its HF export."""
        out = self.cold_start_dir
        self.train("cold_start", [*data, *self.user, *own, f"run.steps={steps}", f"{OUTPUT_DIR}{out}"])
        return out / "hf_final"

    def rl(self, own: Sequence[str] = (), data: Sequence[str] = ()) -> None:
        """RL from the cold start's HF export (`own`: RL's settings, before the user's overrides)."""
        init = f"run.init_from_hf={self.cold_start_dir / 'hf_final'}"
        self.train("rl", [*data, *own, init, f"{OUTPUT_DIR}{self.rl_dir}", *self.user])

    def finish(self, plotted: list[str] | None = None, extra: dict | None = None) -> dict:
        """Plot both phases (`plotted` keys; None: the plot's defaults), write and print the summary (the
        module docstring; `extra` entries added) and return it."""
        plot_metrics(
            self.rl_dir / "metrics.jsonl",
            self.out / "both_phases.png",
            plotted,
            before=[self.cold_start_dir / "metrics.jsonl"],
        )
        evals = [r for r in read_metrics(self.rl_dir / "metrics.jsonl") if "eval/accuracy" in r]
        summary = {
            "start": evaluation(evals[0]),
            "final": evaluation(evals[-1]),
            "rl_steps": evals[-1]["step"],
            "cold_start_s": self.seconds["cold_start"],
            "rl_s": self.seconds["rl"],
            "total_s": time.perf_counter() - self.started,
            **(extra or {}),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary), flush=True)
        return summary


def evaluation(record: dict) -> dict[str, float]:
    """The held-out evaluation's metrics of a metrics record (eval/*, reward/eval_mean)."""
    return {k: v for k, v in record.items() if k.startswith("eval/") or k == "reward/eval_mean"}
