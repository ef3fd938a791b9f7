"""Configuration of the RL algorithm: which advantage estimator turns rewards into advantages, its
discounting, and the KL penalty in the reward with its controller."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gptoss.errors import ConfigError

# Sequence-level estimators compare a sample's reward with the other samples of its prompt; token-level
# ones (reinforce_pp, reinforce_pp_baseline, gae) give every token its own advantage.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
KL_CONTROLLERS = ("fixed", "adaptive")
REWARD_KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class AlgorithmConfig:
    """How rewards become advantages (see megatron_gptoss/rl/README.md for each estimator's formula)."""

    # "grpo": (r - group mean) / (group std + ppo.adv_eps) (ppo.norm_adv_by_std=false drops the division);
    # "dr_grpo": r - group mean; "rloo": r - mean of the other samples of the group;
    # "reinforce_pp": discounted return of every token, whitened over the batch's loss tokens;
    # "reinforce_pp_baseline": (r - group mean) on every token, whitened over the batch's loss tokens;
    # "gae": generalised advantage estimation with a learned value model (the `critic` section), whitened.
    advantage: str = "grpo"
    # Discount factor per policy token (reinforce_pp, gae); tool and environment tokens take no discount step.
    gamma: float = 1.0
    # GAE's lambda (gae): 1 gives the Monte-Carlo return minus the value, 0 the one-step TD error.
    lam: float = 1.0
    # KL penalty in the reward: every loss token's reward gets -coef x KL(old policy || reference) at that
    # token (0: off; > 0 keeps a frozen reference policy). With kl_ctrl "adaptive" this is the initial value.
    kl_in_reward_coef: float = 0.0
    # Per-token KL estimator of the reward penalty: "k1", "k2" or "k3" (ppo.kl_k3_max bounds k3).
    kl_in_reward_estimator: str = "k1"
    # "fixed": the coefficient stays; "adaptive": after every step
    # coef *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) x rows / kl_horizon (Ziegler et al., 2019).
    kl_ctrl: str = "fixed"
    # Per-token KL the adaptive controller steers towards (mean over sequences of their mean over tokens).
    kl_target: float = 0.1
    # Rows over which the adaptive controller moves the coefficient by at most 20%.
    kl_horizon: int = 10000

    def validate(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"algorithm.advantage={self.advantage!r} not in {ADVANTAGE_ESTIMATORS}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.kl_in_reward_coef < 0:
            raise ConfigError(f"algorithm.kl_in_reward_coef must be >= 0, got {self.kl_in_reward_coef}")
        if self.kl_in_reward_estimator not in REWARD_KL_ESTIMATORS:
            raise ConfigError(
                f"algorithm.kl_in_reward_estimator={self.kl_in_reward_estimator!r} not in "
                f"{REWARD_KL_ESTIMATORS}"
            )
        if self.kl_ctrl not in KL_CONTROLLERS:
            raise ConfigError(f"algorithm.kl_ctrl={self.kl_ctrl!r} not in {KL_CONTROLLERS}")
        if self.kl_ctrl == "adaptive":
            if not self.kl_in_reward_coef > 0:
                raise ConfigError(
                    "algorithm.kl_ctrl='adaptive' needs algorithm.kl_in_reward_coef > 0 (its initial value)"
                )
            if not self.kl_target > 0:
                raise ConfigError(f"algorithm.kl_target must be > 0, got {self.kl_target}")
            if self.kl_horizon < 1:
                raise ConfigError(f"algorithm.kl_horizon must be >= 1, got {self.kl_horizon}")
