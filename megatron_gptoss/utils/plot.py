"""Plot a run's metrics.jsonl as a PNG grid of panels: reward, accuracy, mismatch, optimisation.

python -m megatron_gptoss.utils.plot outputs/run/metrics.jsonl [outputs/run/metrics.png]
python -m megatron_gptoss.utils.plot rl/metrics.jsonl both.png --before cold_start/metrics.jsonl

With --before, the earlier runs' metrics (a supervised cold start, say) come first on one step axis: each
run's steps follow the previous run's last step, and a dashed line marks where each run begins. The title
(also the PNG's Title) names the runs by their directories' names (`plot_title`), never by the machine's
paths.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from megatron_gptoss.utils.metrics import read_metrics, run_name

# (title, y label, metric names, log y-axis when every value is positive). A panel lists every
# name its quantity is logged under (the rl package's names beside the generic ones).
PANELS: tuple[tuple[str, str, tuple[str, ...], bool], ...] = (
    ("Reward", "mean reward", ("reward/train_mean", "reward/eval_mean"), False),
    ("Eval accuracy (exact match)", "accuracy", ("eval/accuracy",), False),
    (
        "Rollout vs learner KL",
        "KL estimate",
        ("mismatch/k1", "mismatch/k3", "mismatch/kl_k1", "mismatch/kl_k3"),
        False,
    ),
    (
        "Rollout vs learner |Δ log-prob|",
        "|Δ log-prob|",
        ("mismatch/abs_diff_mean", "mismatch/abs_diff_p99", "mismatch/abs_diff_max"),
        True,
    ),
    (
        "Rollout correction weights",
        "importance weight",
        ("correction/weight_mean", "correction/weight_max"),
        False,
    ),
    ("Gradient norm", "global norm", ("train/grad_norm",), True),
    ("Relative update", "||update|| / ||weights||", ("train/update_ratio",), True),
    ("Clip fraction", "fraction of tokens", ("train/clipfrac", "pg/clipfrac", "pg/dual_clipfrac"), False),
    ("Entropy", "nats per token", ("train/entropy", "loss/entropy"), False),
    ("KL to reference", "KL estimate", ("train/kl_ref", "loss/kl"), False),
    ("Loss", "loss", ("train/loss", "pg/loss", "loss/total"), False),
    ("Response length", "tokens", ("response/length_mean",), False),
    ("Staleness", "policy versions", ("staleness/max", "staleness/mean"), False),
    ("Rollout buffer", "rows", ("buffer/depth", "staleness/dropped_rows"), False),
    ("Idle time", "fraction of the step", ("idle/engine_frac", "idle/learner_frac"), False),
)
DEFAULT_KEYS = tuple(key for _, _, keys, _ in PANELS for key in keys)
SMOOTH_MIN_POINTS = 20  # series at least this long get a smoothed line over the faint raw one
SMOOTH_FRACTION = 0.04  # the smoothing window spans this fraction of the series (at least 3 points)


def plot_metrics(
    jsonl_path: str | os.PathLike,
    png_path: str | os.PathLike,
    keys: list[str] | None = None,
    before: list[str | os.PathLike] | None = None,
) -> list[str]:
    """Write a PNG of the metrics in `jsonl_path` (see MetricsLogger) and return the keys plotted.

    `keys` None plots every name of DEFAULT_KEYS present in the log, grouped into the panels of
    PANELS; given keys keep those groupings and any other key gets a panel of its own. Keys absent
    from the log, and non-finite values, are skipped. With nothing to plot the PNG says so.
    `before`: metrics logs of earlier runs, plotted first on the same step axis (`join_runs`), each
    run's start marked. The title, also the PNG's Title, is `plot_title(runs)`. Uses matplotlib's Agg canvas
    directly (no pyplot state, no display needed).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = [*(before or []), jsonl_path]
    records, starts = join_runs([read_metrics(path) for path in paths])
    present = {name for record in records for name in record if name != "step"}
    wanted = list(DEFAULT_KEYS) if keys is None else list(keys)
    panels = _panels([key for key in wanted if key in present])

    ncols = min(3, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(5.2 * ncols, 3.6 * nrows))
    FigureCanvasAgg(fig)
    # Fixed margins in inches (a layout engine would draw the figure twice, doubling the cost).
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=1.0 / width,
        right=1 - 0.2 / width,
        bottom=0.55 / height,
        top=1 - 0.75 / height,
        wspace=0.38,
        hspace=0.5,
    )
    heading = plot_title(paths)
    fig.suptitle(heading, fontsize=10)
    if not panels:
        fig.text(0.5, 0.5, "no metrics to plot", ha="center", va="center")
    plotted: list[str] = []
    for index, (title, ylabel, panel_keys, log_scale) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, index + 1)
        all_positive = True
        for color, key in enumerate(panel_keys):
            steps, values = _series(records, key)
            if not steps:
                continue
            all_positive = all_positive and min(values) > 0
            shade = f"C{color}"
            if len(steps) >= SMOOTH_MIN_POINTS:
                ax.plot(steps, values, alpha=0.3, linewidth=0.8, color=shade)
                ax.plot(steps, _smooth(values), label=f"{key} (smoothed)", linewidth=1.6, color=shade)
            else:
                ax.plot(steps, values, marker="o", markersize=3, label=key, color=shade)
            plotted.append(key)
        if log_scale and all_positive:
            ax.set_yscale("log")
        for start in starts[1:]:
            ax.axvline(start - 0.5, color="0.4", linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100, metadata={"Title": heading})
    return plotted


def plot_title(paths: list[str | os.PathLike]) -> str:
    """The runs of the metrics logs `paths`, in order: each the name of the directory holding its log
    ("cold_start -> rl"), which says which run it is without the machine's path to it."""
    return " -> ".join(run_name(Path(path).parent) for path in paths)


def join_runs(runs: list[list[dict]]) -> tuple[list[dict], list[int]]:
    """Records of consecutive runs on one step axis: run k's steps shifted to follow run k-1's last step.
    Returns (the shifted records, the step at which each run starts)."""
    joined: list[dict] = []
    starts: list[int] = []
    offset = 0
    for records in runs:
        starts.append(offset)
        joined += [{**r, "step": r["step"] + offset} for r in records]
        if records:
            offset += max(r["step"] for r in records) + 1
    return joined, starts


def _panels(keys: list[str]) -> list[tuple[str, str, tuple[str, ...], bool]]:
    """The PANELS restricted to `keys`, then one panel for each key outside PANELS."""
    chosen = set(keys)
    panels = [
        (title, ylabel, tuple(k for k in names if k in chosen), log)
        for title, ylabel, names, log in PANELS
        if chosen.intersection(names)
    ]
    panels += [(key, key, (key,), False) for key in keys if key not in DEFAULT_KEYS]
    return panels


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding a finite number under `key`."""
    pairs = [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _smooth(values: list[float]) -> list[float]:
    """Centred moving average (no lag) over an odd window of about SMOOTH_FRACTION of the series;
    the window shrinks at the ends."""
    half = max(1, round(len(values) * SMOOTH_FRACTION / 2))
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", help="a metrics.jsonl written by MetricsLogger")
    parser.add_argument("png", nargs="?", help="output PNG (default: beside the JSONL, metrics.png)")
    parser.add_argument("--keys", nargs="+", help="metric names to plot (default: DEFAULT_KEYS)")
    parser.add_argument("--before", nargs="+", help="metrics.jsonl of earlier runs, plotted first")
    args = parser.parse_args(argv)
    png = args.png or str(Path(args.jsonl).with_suffix(".png"))
    plotted = plot_metrics(args.jsonl, png, args.keys, args.before)
    print(f"wrote {png} ({len(plotted)} series)")


if __name__ == "__main__":
    main()
