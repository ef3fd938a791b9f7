import json
import logging
import math
import sys

import pytest
import torch

from megatron_gptoss.utils.metrics import MetricsLogger, flatten_metrics, read_metrics
from megatron_gptoss.utils.plot import DEFAULT_KEYS, join_runs, plot_metrics, plot_title

pytest.importorskip("matplotlib.backends.backend_agg")


def _log_steps(out, steps, **kwargs):
    with MetricsLogger(out, tensorboard=False, **kwargs) as logger:
        for step in steps:
            logger.log(step, {"reward/train_mean": step / 10, "train/loss": torch.tensor(1.0 / (step + 1))})


def test_jsonl_round_trip(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        flat = logger.log(
            3,
            {
                "reward": {"train_mean": torch.tensor(0.25)},
                "eval/accuracy": 1,
                "ok": True,
                "loss": float("nan"),
            },
        )
    assert flat == {"reward/train_mean": 0.25, "eval/accuracy": 1.0, "ok": 1.0, "loss": flat["loss"]}
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["step"] == 3 and record["reward/train_mean"] == 0.25 and record["ok"] == 1.0
    assert math.isnan(record["loss"])
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["step"] == 3


def test_lines_are_flushed_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(0, {"a": 1.0})
    logger.log(1, {"a": 2.0})
    # No close: what a crashed run leaves behind, plus a write cut short.
    assert [r["a"] for r in read_metrics(logger.path)] == [1.0, 2.0]
    with open(logger.path, "a") as f:
        f.write('{"step": 2, "a"')
    assert [r["step"] for r in read_metrics(logger.path)] == [0, 1]
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(3, {"a": 0.0})
    _log_steps(tmp_path, [2])  # a new logger drops the unfinished line, then appends
    assert [r["step"] for r in read_metrics(logger.path)] == [0, 1, 2]


def test_resume_truncates_and_plain_reopen_appends(tmp_path):
    _log_steps(tmp_path, range(10))
    _log_steps(tmp_path, range(6, 8), resume_step=6)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(8))
    _log_steps(tmp_path, [8])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(9))


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="'x/y' is a tensor of shape \\(2,\\)"):
        flatten_metrics({"x": {"y": torch.zeros(2)}})
    with pytest.raises(ValueError, match="'s' = 'hi'"):
        flatten_metrics({"s": "hi"})


def test_tensorboard_events_and_missing_tensorboard(tmp_path, monkeypatch, caplog):
    with MetricsLogger(tmp_path / "tb", tensorboard=True) as logger:
        logger.log(0, {"a": 1.0})
    assert any((tmp_path / "tb" / "tensorboard").iterdir())

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with caplog.at_level(logging.WARNING), MetricsLogger(tmp_path / "no_tb", tensorboard=True) as logger:
        logger.log(0, {"a": 1.0})
        logger.log(1, {"a": 2.0})
    assert sum("TensorBoard logging disabled" in r.message for r in caplog.records) == 1
    assert len(read_metrics(logger.path)) == 2


def test_plot_writes_png_and_skips_missing_keys(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(40):
            metrics = {
                "reward/train_mean": min(1.0, step / 30),
                "train/grad_norm": float("inf") if step == 5 else 1.0,
                "mismatch/kl_k3": 1e-4,  # the rl package's name for the rollout/learner k3
            }
            if step % 10 == 0:
                metrics["reward/eval_mean"] = step / 40
            logger.log(step, metrics)
    png = tmp_path / "plots" / "metrics.png"
    plotted = plot_metrics(logger.path, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert set(plotted) == {"reward/train_mean", "reward/eval_mean", "train/grad_norm", "mismatch/kl_k3"}
    assert set(plotted) <= set(DEFAULT_KEYS)


def test_plot_chosen_keys_and_nothing_to_plot(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(5):
            logger.log(step, {"mismatch/k3": 1e-4, "train/loss": float("nan"), "custom/thing": step})
    plotted = plot_metrics(
        logger.path, tmp_path / "some.png", keys=["custom/thing", "absent", "train/loss", "mismatch/k3"]
    )
    assert plotted == ["mismatch/k3", "custom/thing"]  # grouped panels first, then keys of their own
    assert plot_metrics(logger.path, tmp_path / "none.png", keys=["absent"]) == []
    assert (tmp_path / "none.png").stat().st_size > 0


def test_runs_join_on_one_step_axis(tmp_path):
    """A cold start's 3 steps then an RL run's steps 0..4: one axis 0..7, the RL run starting at 3; the plot
    holds the keys of both runs."""
    cold, rl = tmp_path / "cold", tmp_path / "rl"
    with MetricsLogger(cold, tensorboard=False) as logger:
        for step in range(3):
            logger.log(step, {"loss/total": 2.0 - step})
    with MetricsLogger(rl, tensorboard=False) as logger:
        for step in range(5):
            logger.log(step, {"reward/train_mean": step / 4, "loss/total": 0.1})
    joined, starts = join_runs([read_metrics(cold / "metrics.jsonl"), read_metrics(rl / "metrics.jsonl")])
    assert starts == [0, 3]
    assert [r["step"] for r in joined] == list(range(8))
    assert [r["loss/total"] for r in joined] == [2.0, 1.0, 0.0] + [0.1] * 5
    png = tmp_path / "both.png"
    plotted = plot_metrics(rl / "metrics.jsonl", png, before=[cold / "metrics.jsonl"])
    assert set(plotted) == {"reward/train_mean", "loss/total"} and png.stat().st_size > 10_000


def test_plot_title_names_runs_not_paths(tmp_path, monkeypatch):
    """The title (and the PNG's Title) names each run by its directory, not by where it lies: the demo
    drivers plot runs kept in temporary directories."""
    from PIL import Image

    cold, rl = tmp_path / "cold_start", tmp_path / "rl"
    _log_steps(cold, range(2))
    _log_steps(rl, range(2))
    png = tmp_path / "both.png"
    plot_metrics(rl / "metrics.jsonl", png, before=[cold / "metrics.jsonl"])
    assert Image.open(png).text["Title"] == "cold_start -> rl"
    monkeypatch.chdir(rl)  # a log named relative to the working directory: the directory's name
    assert plot_title(["metrics.jsonl"]) == "rl"
