"""Short RL runs of one config with each MoE fidelity setting, and their mismatch, ratio and KL metrics on
one plot: router replay off / r2 / r3, and bitwise on-policy mode.

    python benchmarks/compare_fidelity_runs.py [--out DIR] [--config CONFIG] [--nproc N] [OVERRIDES...]

Runs `python -m megatron_gptoss.train --config CONFIG OVERRIDES` once per setting (in DIR/<setting>; with
--nproc N > 1 through `torchrun --nproc_per_node N`, the layout in OVERRIDES), then writes DIR/fidelity.png
(one panel per metric, one line per setting, against the step) and prints a table: per setting the mean over
steps of each metric and of the step's generate / log-prob / update times. Two GPUs, bitwise at matched
layouts against none and r3 (the model and task overrides are the caller's):

    python benchmarks/compare_fidelity_runs.py --nproc 2 --out outputs/fidelity_ep2 \
        parallel.expert_model_parallel_size=2 rollout.expert_parallel_size=2 --settings none r3 bitwise
    python benchmarks/compare_fidelity_runs.py --nproc 2 --out outputs/fidelity_tp2 \
        parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true rollout.tensor_parallel_size=2 \
        --settings bitwise

(--settings takes every word after it: the overrides go before it.)
Defaults: configs/demo_cpu.yaml in bfloat16 (learner and engine), 20 steps, the Triton attention (the
bitwise mode needs it; the other settings run it too, so only the setting differs).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "none": ["moe.router_replay=none"],
    "r2": ["moe.router_replay=r2"],
    "r3": ["moe.router_replay=r3"],
    "bitwise": ["rollout.bitwise_on_policy=true"],
}
DEFAULTS = ["run.dtype=bfloat16", "rollout.dtype=bfloat16", "model.attention_backend=triton",
            "run.steps=20", "run.eval_every=0", "run.progress=false", "run.export_hf=false",
            "run.tensorboard=false"]  # fmt: skip
TIMES = ["time/generate_s", "time/logprobs_s", "time/update_s"]
PANELS = ["mismatch/abs_diff_max", "mismatch/abs_diff_mean", "mismatch/kl_k3", "pg/ratio_max", "pg/ratio_min",
          "pg/clipfrac", "replay/flip_frac"]  # fmt: skip


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(runs: dict[str, list[dict]], png: Path) -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [k for k in PANELS if any(k in r for rows in runs.values() for r in rows)]
    fig = Figure(figsize=(5 * len(keys), 3.6))
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        if key.startswith("mismatch/"):
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return keys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/fidelity")
    parser.add_argument("--config", default=str(ROOT / "configs/demo_cpu.yaml"))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run, through torchrun")
    args, overrides = parser.parse_known_args(argv)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}"]
    if args.nproc == 1:
        launcher = [sys.executable]
    out = Path(args.out)
    runs = {}
    for name in args.settings:
        run_dir = out / name
        command = [*launcher, "-m", "megatron_gptoss.train", "--config", args.config, *DEFAULTS,
                   *SETTINGS[name], f"run.output_dir={run_dir}", "run.overwrite=true",
                   *overrides]  # fmt: skip
        subprocess.run(command, check=True)
        runs[name] = [r for r in read(run_dir / "metrics.jsonl") if "mismatch/abs_diff_max" in r]
        shutil.rmtree(
            run_dir / "checkpoints", ignore_errors=True
        )  # the next run's disk (full optimizer state)
    keys = plot(runs, out / "fidelity.png")
    print(f"wrote {out / 'fidelity.png'}")
    columns = keys + [k for k in TIMES if any(k in r for rows in runs.values() for r in rows)]
    print("| setting | steps | " + " | ".join(f"mean {k}" for k in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for name, rows in runs.items():
        cells = []
        for key in columns:
            values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
            cells.append(f"{sum(values) / len(values):.3g}" if values else "-")
        print(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
