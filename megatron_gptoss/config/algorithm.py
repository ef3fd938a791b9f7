"""Configuration of the RL algorithm: which advantage estimator turns rewards into advantages, and its
discounting."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gptoss.errors import ConfigError

# Sequence-level estimators compare a sample's reward with the other samples of its prompt; token-level
# ones (reinforce_pp, reinforce_pp_baseline) give every token its own advantage.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@dataclass
class AlgorithmConfig:
    """How rewards become advantages (see megatron_gptoss/rl/README.md for each estimator's formula)."""

    # "grpo": (r - group mean) / (group std + ppo.adv_eps) (ppo.norm_adv_by_std=false drops the division);
    # "dr_grpo": r - group mean; "rloo": r - mean of the other samples of the group;
    # "reinforce_pp": discounted return of every token, whitened over the batch's loss tokens;
    # "reinforce_pp_baseline": (r - group mean) on every token, whitened over the batch's loss tokens.
    advantage: str = "grpo"
    # Discount factor per policy token (reinforce_pp); tool and environment tokens take no discount step.
    gamma: float = 1.0

    def validate(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"algorithm.advantage={self.advantage!r} not in {ADVANTAGE_ESTIMATORS}")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"algorithm.gamma must be in [0, 1], got {self.gamma}")
