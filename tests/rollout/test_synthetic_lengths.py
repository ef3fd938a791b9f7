"""Synthetic response lengths (`rollout.length_median`, `SamplingParams.length_median`): each row's budget is
drawn from a log-normal by its own seed, so that a batch of a model that never samples a stop token ends in a
long tail, the same whatever the split of its rows over engines."""

from __future__ import annotations

import math
import statistics

import pytest
from helpers.embedded_engine import engine_of, perturbed_learner

from megatron_gptoss.config import ConfigError, TrainConfig
from megatron_gptoss.engine_api.protocol import SamplingParams, row_budget
from megatron_gptoss.trainer.common import sampling_params


def test_budgets_follow_the_log_normal():
    """4,000 rows: the median and the spread of log(budget) match (median, sigma); every budget within
    [1, max_new_tokens]; the row's budget depends on its stream (seed + row) only; off, max_new_tokens."""
    params = SamplingParams(max_new_tokens=100_000, seed=11, length_median=200, length_sigma=0.8)
    budgets = [row_budget(params, row) for row in range(4000)]
    logs = [math.log(b) for b in budgets]
    assert abs(statistics.median(budgets) / 200 - 1) < 0.06
    assert abs(statistics.stdev(logs) - 0.8) < 0.04
    assert len(set(budgets)) > 500
    shifted = SamplingParams(max_new_tokens=100_000, seed=11 + 7, length_median=200, length_sigma=0.8)
    assert [row_budget(shifted, row) for row in range(10)] == budgets[7:17]
    clipped = SamplingParams(max_new_tokens=150, seed=11, length_median=200, length_sigma=0.8)
    assert [row_budget(clipped, row) for row in range(4000)] == [min(b, 150) for b in budgets]
    assert row_budget(SamplingParams(max_new_tokens=33, seed=11), 5) == 33
    with pytest.raises(ValueError, match="length_median"):
        SamplingParams(length_median=-1)


def test_engine_rows_end_at_their_budgets():
    """No stop token: every row of the embedded engine ends at its drawn budget ("length"); the request
    split in two (the second part's seed offset by its first row) gives the same tokens."""
    engine = engine_of(perturbed_learner(3), max_batch_slots=4)
    prompts = [[1 + i, 7, 9 + i] for i in range(6)]
    params = SamplingParams(max_new_tokens=16, seed=5, length_median=5, length_sigma=1.0)
    whole = engine.generate(prompts, params)
    budgets = [row_budget(params, row) for row in range(6)]
    assert [len(g.token_ids) for g in whole] == budgets
    assert len(set(budgets)) >= 3 and max(budgets) <= 16
    assert all(g.finish_reason == "length" for g in whole)
    first = engine.generate(prompts[:2], params)
    rest = engine.generate(prompts[2:], SamplingParams(**{**params.__dict__, "seed": params.seed + 2}))
    assert [g.token_ids for g in first + rest] == [g.token_ids for g in whole]


def test_config_carries_and_checks_the_lengths():
    """The trainer's sampling parameters carry rollout.length_*; the engines that cannot take a budget per
    row and agent trajectories refuse it, naming the field."""
    cfg = TrainConfig()
    cfg.rollout.length_median, cfg.rollout.length_sigma = 256, 0.5
    cfg.validate()
    params = sampling_params(cfg, [3])
    assert (params.length_median, params.length_sigma) == (256, 0.5)
    cfg.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match="rollout.length_median"):
        cfg.validate()
    cfg.rollout.engine = "embedded"
    cfg.agent.enabled = True
    with pytest.raises(ConfigError, match="rollout.length_median"):
        cfg.validate()
    cfg.agent.enabled, cfg.rollout.length_sigma = False, 0.0
    with pytest.raises(ConfigError, match="rollout.length_sigma"):
        cfg.validate()
