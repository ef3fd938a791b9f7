import math
import multiprocessing
import os
import time

import pytest
from helpers.reward_rows import completion, gsm8k_row

from megatron_gptoss.config import RewardConfig
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.rewards import RewardScorer

TIMEOUT_S = 1.5


def row(do=None):
    return {"ground_truth": "", "data_source": "test", "extra_info": {"do": do}}


@pytest.fixture(scope="module")
def scorer():
    others = set(multiprocessing.active_children())  # e.g. the gloo pools of other test modules
    with RewardScorer(
        RewardConfig(name="helpers.reward_fixtures:misbehave", timeout_s=TIMEOUT_S, workers=2)
    ) as s:
        s.score_batch([completion("x")] * 2, [row(), row()])  # the workers are up
        yield s
    assert set(multiprocessing.active_children()) <= others  # killed, replaced and closed workers are gone


def timed_batch(scorer, actions):
    start = time.perf_counter()
    rewards, metrics = scorer.score_batch([completion("x")] * len(actions), [row(a) for a in actions])
    return rewards, metrics, time.perf_counter() - start


def test_gsm8k_batch_in_workers():
    finals = ["\\boxed{18}", "It is 17.", None, "1,234 apples"]
    answers = ["18", "18", "18", "1234"]
    with RewardScorer(RewardConfig(name="gsm8k", format_weight=0.5, workers=2)) as s:
        rewards, metrics = s.score_batch([completion(f) for f in finals], [gsm8k_row(a) for a in answers])
    assert rewards == [1.5, 0.5, 0.0, 1.5]
    assert metrics["reward/mean"] == pytest.approx(3.5 / 4)
    assert metrics["reward/task"] == pytest.approx(0.5)
    assert metrics["reward/format"] == pytest.approx(0.75)
    assert metrics["reward/reason/no_final"] == 1.0
    assert metrics["reward/reason/wrong_answer"] == 1.0
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (0.0, 0.0)


def test_a_hung_and_a_raising_function_score_zero_within_the_timeout(scorer):
    rewards, metrics, seconds = timed_batch(scorer, [None, "hang", None, "raise", None, None])
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (1.0, 1.0)
    assert metrics["reward/messages"] == 2.0  # the mean of the rows that returned it
    assert seconds < TIMEOUT_S + 3.0
    assert [index for index, _ in scorer.last_errors] == [3]
    assert "RuntimeError: boom" in scorer.last_errors[0][1]
    # the hung worker was replaced: the next batch is whole
    rewards, metrics, _ = timed_batch(scorer, [None] * 4)
    assert rewards == [1.0] * 4
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (0.0, 0.0)


def test_hangs_in_every_worker_time_out_together(scorer):
    rewards, metrics, seconds = timed_batch(scorer, ["hang", "hang"])
    assert rewards == [0.0, 0.0]
    assert metrics["reward/timeouts"] == 2.0
    assert seconds < TIMEOUT_S + 1.0  # one timeout, not one after the other


def test_bad_values_and_a_dead_worker_are_errors_a_nan_is_kept(scorer):
    rewards, metrics, _ = timed_batch(scorer, ["nan", "text", "die", None])
    assert math.isnan(rewards[0]) and rewards[1:] == [0.0, 0.0, 1.0]  # a NaN drops its group in the trainer
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (2.0, 0.0)
    assert (metrics["reward/nonfinite"], metrics["reward/failed"]) == (1.0, 3.0)
    assert metrics["reward/mean"] == pytest.approx(1 / 3)  # of the finite rewards
    messages = dict(scorer.last_errors)
    assert "must be a number, got str 'one'" in messages[1]
    assert "died (exit code 3)" in messages[2]


def test_an_unpicklable_row_is_an_error(scorer):
    rows = [row(), {"ground_truth": "", "extra_info": {"do": None, "f": lambda: 0}}]
    rewards, metrics = scorer.score_batch([completion("x")] * 2, rows)
    assert rewards == [1.0, 0.0]
    assert metrics["reward/errors"] == 1.0
    assert "cannot send the row" in scorer.last_errors[0][1]


def test_a_megabyte_completion_scores_in_bounded_time():
    big = "word 7 " * 150_000
    cfg = RewardConfig(name="gsm8k", format_weight=1.0, timeout_s=20.0, workers=1)
    with RewardScorer(cfg) as s:
        start = time.perf_counter()
        rewards, metrics = s.score_batch([completion(big)], [gsm8k_row("7")])
        assert time.perf_counter() - start < 20.0
    assert rewards == [2.0] and metrics["reward/timeouts"] == 0.0


def test_rows_are_scored_in_parallel_worker_processes(scorer):
    rewards, _, seconds = timed_batch(scorer, ["slow"] * 4)
    assert rewards == [1.0] * 4
    assert seconds < 1.9  # two workers: about 1 s; one after the other: 2 s
    with RewardScorer(RewardConfig(name="helpers.reward_fixtures:pid", workers=1)) as s:
        rewards, _ = s.score_batch([completion("x")] * 2, [row()] * 2)
    assert os.getpid() not in rewards


def test_in_process_scoring_counts_errors():
    s = RewardScorer(RewardConfig(name="helpers.reward_fixtures:misbehave", workers=0))
    rewards, metrics = s.score_batch([completion("x")] * 3, [row(), row("raise"), row("nan")])
    assert rewards[:2] == [1.0, 0.0] and math.isnan(rewards[2])
    assert (metrics["reward/errors"], metrics["reward/nonfinite"]) == (1.0, 1.0)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.score_batch([], [])


def test_mismatched_lengths_and_bad_names():
    s = RewardScorer(RewardConfig(workers=0))
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        s.score_batch([[], []], [row()])
    for name, message in [
        ("no_such_module_xyz:f", "cannot import"),
        ("helpers.reward_fixtures:absent", "no function 'absent'"),
        ("helpers.reward_fixtures:not_callable", "no function 'not_callable'"),
        ("gsm9k", "neither one of"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RewardScorer(RewardConfig(name=name))


def test_a_worker_that_dies_while_starting_fails_the_batch():
    s = RewardScorer(RewardConfig(name="helpers.reward_fixtures_dying:score", workers=1))
    with pytest.raises(RuntimeError, match=r"died while starting \(exit code 5\)"):
        s.score_batch([completion("x")], [row()])
