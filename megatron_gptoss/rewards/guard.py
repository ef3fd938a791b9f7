"""A broken reward function stops the run: `RewardFailureGuard` reads the reward metrics of every step (the
counts `RewardScorer` reports: `reward/rows`, `reward/failed`, and per kind `reward/errors`,
`reward/timeouts`, `reward/nonfinite`) and raises RewardError naming the function once every reward of
`max_steps` steps in a row failed. A step with one good reward resets the count; a task whose metrics hold
no `reward/rows` (the built-in arithmetic task cannot fail) is never judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_gptoss.errors import MegatronGptossError


class RewardError(MegatronGptossError, RuntimeError):
    """The reward function failed on every row of several steps in a row (it raised, returned no number or
    a non-finite one, timed out or ended its worker): training on it would learn nothing."""


class RewardFailureGuard:
    """Counts the steps in a row whose every reward failed; `check` raises RewardError at `max_steps`
    (0: never). `name`: the reward function, as `reward.name` gives it."""

    def __init__(self, name: str, max_steps: int):
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        self.name, self.max_steps = name, max_steps
        self.streak = 0
        self.first_step = 0

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        """Judge `step` by its metrics; RewardError when the streak reaches `max_steps`."""
        rows = metrics.get("reward/rows", 0.0)
        if not rows:
            return
        if metrics.get("reward/failed", 0.0) < rows:
            self.streak = 0
            return
        self.streak += 1
        self.first_step = self.first_step if self.streak > 1 else step
        if self.max_steps and self.streak >= self.max_steps:
            kinds = ", ".join(
                f"{int(metrics.get(key, 0.0))} {what}"
                for key, what in (
                    ("reward/errors", "errors"),
                    ("reward/timeouts", "timeouts"),
                    ("reward/nonfinite", "non-finite"),
                )
            )
            raise RewardError(
                f"reward function {self.name!r} failed on every row of {self.streak} steps in a row (steps "
                f"{self.first_step}-{step}; step {step}: {int(rows)} rows, {kinds}), so the run stops "
                f"(run.max_reward_error_steps={self.max_steps}); the first failure of each kind is logged "
                "above with its traceback"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "first_step": self.first_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak, self.first_step = int(state["streak"]), int(state["first_step"])
