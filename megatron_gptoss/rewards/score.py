"""One completion's reward under a `RewardConfig`, in the calling process (the pool runs this in workers).

The total is the task reward plus `format_weight` x the format reward (the format reward alone for
`name: format`). `score_one` returns the total and the metrics of the row: `task` and `format` (when
computed), every other number the reward function returned, and its `reason` string.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.rewards.formatting import format_reward
from megatron_gptoss.rewards.gsm8k import gsm8k_reward
from megatron_gptoss.rewards.ifeval import ifeval_reward
from megatron_gptoss.rewards.types import Message, RewardFn, RewardResult


def resolve(cfg: RewardConfig) -> RewardFn:
    """The reward function `cfg.name` names; ConfigError when a `module:function` cannot be imported or is
    not callable."""
    if cfg.name == "gsm8k":
        return gsm8k_reward
    if cfg.name == "format":
        return format_reward
    if cfg.name == "ifeval":
        return functools.partial(ifeval_reward, mode=cfg.ifeval_mode)
    module_name, _, function_name = cfg.name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ConfigError(f"reward.name={cfg.name!r}: cannot import {module_name!r} ({err!r})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise ConfigError(f"reward.name={cfg.name!r}: {module_name!r} has no function {function_name!r}")
    return fn


class BadRewardValue(ValueError):
    """A reward function returned something that is not a reward (None, a string, a mapping without a
    number under "reward")."""


def split_result(result: RewardResult) -> tuple[float, dict[str, float], str | None]:
    """(reward, numeric extras, reason) of what a reward function returned (a bool counts as 0 or 1); a
    NaN or infinite reward is returned as it is (the trainer drops its group). BadRewardValue when the
    reward is missing or not a number."""
    extras: dict[str, float] = {}
    reason = None
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise BadRewardValue(
                f"a reward mapping needs a 'reward' key, got keys {sorted(map(str, result))}"
            )
        for key, value in result.items():
            if key == "reason" and isinstance(value, str):
                reason = value
            elif key != "reward" and isinstance(value, (bool, int, float)) and math.isfinite(value):
                extras[str(key)] = float(value)
        result = result["reward"]
    if not isinstance(result, (int, float)):
        raise BadRewardValue(f"a reward must be a number, got {_shown(result)}")
    return float(result), extras, reason


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:200]}{'...' if len(text) > 200 else ''}"


def score_one(
    cfg: RewardConfig, fn: RewardFn, messages: Sequence[Message], row: Mapping[str, Any]
) -> tuple[float, dict[str, float], str | None]:
    """(total reward, metrics of the row, reason) of one completion (NaN or infinite when the function
    returned such a reward); the reward function's exceptions and BadRewardValue propagate."""
    task, extras, reason = split_result(fn(messages, row))
    if cfg.name == "format":
        return task, {"format": task, **extras}, reason
    extras["task"] = task
    if cfg.format_weight:
        fmt, _, fmt_reason = split_result(format_reward(messages, row))
        extras["format"] = fmt
        task += cfg.format_weight * fmt
        reason = reason or (None if fmt_reason is None else f"format_{fmt_reason}")
    return task, extras, reason
