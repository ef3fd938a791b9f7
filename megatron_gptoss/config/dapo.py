"""Configuration of DAPO's sampling and reward shaping: dynamic sampling and the overlong-response penalty."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gptoss.errors import ConfigError


@dataclass
class DAPOConfig:
    """Dynamic sampling keeps only prompt groups whose rewards differ; the overlong penalty lowers the reward
    of responses that run into the last `overlong_buffer` tokens before `rollout.max_new_tokens`."""

    # Drop groups whose rewards are all equal (they carry no group-relative signal) and refill the batch with
    # groups of freshly sampled prompts, up to `rollout.prompts_per_step` groups.
    dynamic_sampling: bool = False
    # Generation rounds a step may add to refill the batch (>= 0); when they run out the step trains on the
    # groups it has (all of the first round's groups when none differs).
    max_extra_rounds: int = 4
    # Tokens before `rollout.max_new_tokens` where the soft overlong penalty starts (0: no penalty).
    overlong_buffer: int = 0
    # The penalty at `rollout.max_new_tokens`: a response of L tokens gets
    # min(0, -(L - (max_new_tokens - overlong_buffer)) / overlong_buffer x overlong_penalty).
    overlong_penalty: float = 1.0

    def validate(self, max_new_tokens: int) -> None:
        if self.max_extra_rounds < 0:
            raise ConfigError(f"dapo.max_extra_rounds must be >= 0, got {self.max_extra_rounds}")
        if self.overlong_buffer < 0 or self.overlong_buffer > max_new_tokens:
            raise ConfigError(
                f"dapo.overlong_buffer={self.overlong_buffer} must be in [0, rollout.max_new_tokens="
                f"{max_new_tokens}]"
            )
        if self.overlong_penalty < 0:
            raise ConfigError(f"dapo.overlong_penalty must be >= 0, got {self.overlong_penalty}")
