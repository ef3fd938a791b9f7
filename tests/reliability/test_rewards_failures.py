"""A broken user reward function is never silent: the first failure of each kind (raised, returned None or a
string, NaN or inf, ended its worker) is logged naming the function, with the traceback when it raised; a
NaN or inf reward stays non-finite, so the trainer drops its group; a run whose every reward fails for
`run.max_reward_error_steps` steps stops with RewardError naming the function."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from helpers.reward_rows import completion

from megatron_gptoss.config import RewardConfig, load_config
from megatron_gptoss.rewards import RewardScorer
from megatron_gptoss.rewards.guard import RewardError, RewardFailureGuard
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]


def row(do: str | None = None) -> dict:
    return {"ground_truth": "", "data_source": "test", "extra_info": {"do": do}}


def test_the_first_failure_of_each_kind_is_logged_once_with_its_traceback(caplog):
    actions = [None, "raise", "raise", "text", "nan", "die", "nan", None]
    with caplog.at_level(logging.WARNING, logger="megatron_gptoss.rewards.pool"):
        with RewardScorer(
            RewardConfig(name="helpers.reward_fixtures:misbehave", workers=1, timeout_s=20)
        ) as scorer:
            rewards, metrics = scorer.score_batch([completion("x")] * len(actions), [row(a) for a in actions])
            scorer.score_batch([completion("x")] * 2, [row("raise"), row("nan")])  # kinds already logged
    assert rewards[0] == rewards[7] == 1.0 and rewards[1:4] == [0.0] * 3 and rewards[5] == 0.0
    assert math.isnan(rewards[4]) and math.isnan(rewards[6])  # kept: the trainer drops their groups
    assert (metrics["reward/errors"], metrics["reward/nonfinite"], metrics["reward/failed"]) == (
        4.0,
        2.0,
        6.0,
    )
    assert metrics["reward/rows"] == 8.0 and metrics["reward/mean"] == pytest.approx(2 / 6)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # raised, bad value, non-finite, died: each once
    assert all(line.startswith("reward function 'helpers.reward_fixtures:misbehave' ") for line in lines)
    raised = next(line for line in lines if " raised on row 1 " in line)
    assert "RuntimeError: boom" in raised and "Traceback (most recent call last)" in raised
    assert 'raise RuntimeError("boom")' in raised  # the user's own line
    assert any("returned a bad value on row 3" in line and "got str 'one'" in line for line in lines)
    assert any("returned a non-finite reward on row 4" in line for line in lines)
    assert any("died on row 5" in line and "exit code 3" in line for line in lines)


def test_the_guard_stops_after_the_steps_in_a_row_whose_every_reward_failed():
    guard = RewardFailureGuard("m:f", max_steps=3)
    failed = {"reward/rows": 4.0, "reward/failed": 4.0, "reward/errors": 4.0}
    guard.check(1, failed)
    guard.check(2, failed)
    guard.check(3, {"reward/rows": 4.0, "reward/failed": 3.0})  # one good reward resets the count
    guard.check(4, failed)
    guard.check(5, failed)
    guard.check(6, {})  # a task that reports no reward failures is not judged
    with pytest.raises(RewardError, match=r"'m:f' failed on every row of 3 steps in a row \(steps 4-7"):
        guard.check(7, failed)
    never = RewardFailureGuard("m:f", max_steps=0)
    for step in range(10):
        never.check(step, failed)


def test_a_run_on_a_raising_reward_stops_naming_it(tmp_path, caplog):
    """Also a dataset run without held-out files: it trains past step 1 (no evaluation metrics)."""
    train = tmp_path / "train.jsonl"
    prompt, extra = [{"role": "user", "content": "1 + 1 = ?"}], {"do": "raise"}  # every row raises
    rows = [
        {"prompt": prompt, "data_source": "t", "reward_model": {"ground_truth": "2"}, "extra_info": extra}
    ] * 4
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "model.preset=gpt_oss_tiny", "model.vocab_size=201088", "model.max_position_embeddings=512",
        "env.name=dataset", f"data.train_files=[{train}]", "reward.name=helpers.reward_fixtures:misbehave",
        "reward.workers=1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
        "run.export_hf=false", "run.steps=5", "run.save_every=1", f"run.output_dir={tmp_path / 'out'}",
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING), pytest.raises(RewardError) as err:
        loop.run(load_config(ROOT / "configs/demo_cpu.yaml", overrides))
    assert "reward function 'helpers.reward_fixtures:misbehave' failed on every row of 3 steps" in str(
        err.value
    )
    assert "steps 1-3" in str(err.value) and "run.max_reward_error_steps=3" in str(err.value)
    logged = [r.getMessage() for r in caplog.records if r.name == "megatron_gptoss.rewards.pool"]
    assert len(logged) == 1 and "RuntimeError: boom" in logged[0] and "Traceback" in logged[0]
    lines = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[0] == {"step": 0}  # no held-out files: no evaluation metrics
    assert all(line["reward/failed"] == line["reward/rows"] == 4.0 for line in lines[1:])
    assert sorted(p.name for p in (tmp_path / "out/checkpoints").glob("step_*")) == [
        "step_000001",
        "step_000002",
    ]


def test_an_infinite_reward_is_kept_for_the_trainer_to_drop(caplog):
    scorer = RewardScorer(RewardConfig(name="helpers.reward_fixtures:misbehave", workers=0))
    scorer._fn = lambda messages, row: float("-inf")  # a user function in this process
    with caplog.at_level(logging.WARNING, logger="megatron_gptoss.rewards.pool"):
        rewards, metrics = scorer.score_batch([completion("x")] * 2, [row(), row()])
    scorer.close()
    assert rewards == [float("-inf")] * 2 and metrics["reward/nonfinite"] == 2.0
    assert metrics["reward/mean"] == 0.0 and metrics["reward/failed"] == metrics["reward/rows"] == 2.0
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "returned a non-finite reward on row 0" in logged[0] and "-inf" in logged[0]
