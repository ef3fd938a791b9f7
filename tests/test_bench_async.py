"""benchmarks/bench_async.py: its figures from metrics records (exact, on made-up records), and a toy run of
the synchronous and the separate asynchronous settings on 2 gloo ranks through the one trainer."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_async  # noqa: E402
import pytest  # noqa: E402


def test_figures_from_records():
    """Steps 1 and the last (a drain) are left out; tokens per second = loss tokens / step seconds of the
    rest; the time to a reward counts the steps' seconds up to the first evaluation at or above it."""
    steps = [
        {"step": 0, "eval/accuracy": 0.2},
        {"step": 1, "time/step_s": 50.0, "mismatch/tokens": 1e6, "staleness/max": 0.0,
         "idle/engine_frac": 0.9},
        {"step": 2, "time/step_s": 2.0, "mismatch/tokens": 300.0, "staleness/max": 1.0,
         "idle/engine_frac": 0.5, "idle/learner_frac": 0.1, "staleness/dropped_rows": 2.0,
         "eval/accuracy": 0.95},
        {"step": 3, "time/step_s": 4.0, "mismatch/tokens": 900.0, "staleness/max": 0.0,
         "idle/engine_frac": 0.3, "idle/learner_frac": 0.3, "time/sync_s": 0.5, "time/generate_s": 1.0},
        {"step": 4, "time/step_s": 0.5, "mismatch/tokens": 1e6, "staleness/max": 3.0,
         "idle/engine_frac": 1.0},
    ]  # fmt: skip
    r = bench_async.throughput(steps)
    assert r["steps"] == 2 and r["tokens_per_s"] == pytest.approx(1200 / 6)
    assert r["steps_per_hour"] == pytest.approx(1200) and r["step_s"] == pytest.approx(3)
    assert r["idle_engine"] == pytest.approx(0.4) and r["idle_learner"] == pytest.approx(0.2)
    assert r["staleness_max"] == 1 and r["dropped_rows"] == 2
    assert r["sync_s"] == 0.5 and r["generate_s"] == 1.0  # the steps that logged them
    points = bench_async.reward_against_time(steps)
    assert points == [(0.0, 0.2), (52.0, 0.95)]
    assert bench_async.time_to(points, 0.9) == 52.0 and bench_async.time_to(points, 0.99) is None
    with pytest.raises(ValueError, match="at least 3 steps"):
        bench_async.throughput(steps[:3])


def test_tiny_sync_against_separate(tmp_path):
    """Both settings, run in two calls into one output directory, train every step and print in one table
    (the first call's row kept); the separate one at staleness <= 1; responses end at their synthetic budgets
    (shorter than rollout.max_new_tokens on average)."""
    args = ["--tiny", "--steps", "3", "--prompts", "4", "--out", str(tmp_path)]
    first = bench_async.main([*args, "--settings", "separate-k1"])
    results = bench_async.main([*args, "--settings", "sync"])
    assert list(results) == ["sync", "separate-k1"]
    assert results["separate-k1"] == first["separate-k1"]
    for name, r in results.items():
        assert r["steps"] == 1 and r["tokens_per_s"] > 0, name
        assert 0 < r["response_len"] < 24, name
    assert results["sync"]["staleness_max"] == 0
    assert results["separate-k1"]["staleness_max"] <= 1
    assert 0 <= results["separate-k1"]["idle_engine"] <= 1


def test_tiny_lookup_sync_against_separate(tmp_path):
    """--lookup from a random model of the lookup config (as the cold start's export), with the slow tool:
    both settings evaluate at step 0 and every 2 steps, the curve's times grow, and the plot is written."""
    import torch

    from megatron_gptoss.config import load_config
    from megatron_gptoss.hf.io import save_hf
    from megatron_gptoss.model import build_model

    config = load_config(bench_async.LOOKUP_CONFIG, []).model
    init = tmp_path / "init"
    save_hf(build_model(config, dtype=torch.float32, seed=3), init)
    args = ["--lookup", "--init", str(init), "--steps", "2", "--settings", "sync,separate-k1"]
    args += ["--out", str(tmp_path / "out"), "--slow-tool", "env.eval_size=4", "rollout.prompts_per_step=2"]
    results = bench_async.main(args)
    for name in results:  # --slow-tool: the runs offered the lookup tool that waits 0.5-2 s a call
        tools = json.loads((tmp_path / "out" / name / "config.json").read_text())["agent"]["tools"]
        assert [t["function"] for t in tools] == ["megatron_gptoss.envs.lookup:slow_lookup"], name
    assert list(results) == ["sync", "separate-k1"]  # separate-k1: trajectories across the sync
    for name, r in results.items():
        times = [t for t, _ in r["curve"]]
        assert len(times) == 2 and times[0] == 0 < times[1], (name, r["curve"])
        assert 0 <= r["final_reward"] <= 1
    assert (tmp_path / "out" / "lookup_reward_time.png").stat().st_size > 0
