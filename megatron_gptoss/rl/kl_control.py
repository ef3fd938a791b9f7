"""The KL penalty in the reward and its coefficient's controller.

    penalty[b, t] = -coef x KL_t(old || reference)   at the loss tokens, 0 elsewhere
    fixed:     coef stays
    adaptive:  coef *= 1 + clip(kl / target - 1, -0.2, 0.2) x rows / horizon    (Ziegler et al., 2019)

`kl` is the batch's KL: the mean over sequences (with a loss token) of each sequence's mean over its loss
tokens. The penalty enters the advantage estimators through `compute_advantages(token_penalty=...)`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.rl.ppo_loss import kl_penalty


class KLController:
    """The coefficient of the KL penalty in the reward (`value`), updated after every step."""

    def __init__(self, cfg: AlgorithmConfig):
        self.value = float(cfg.kl_in_reward_coef)
        self.adaptive = cfg.kl_ctrl == "adaptive"
        self.target, self.horizon = float(cfg.kl_target), int(cfg.kl_horizon)

    def update(self, kl: float, rows: int) -> None:
        """One step of `rows` rows measured a KL of `kl` (non-finite values leave the coefficient)."""
        if not self.adaptive or not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * rows / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


@torch.no_grad()
def reward_kl_penalty(
    old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, coef: float, estimator: str, k3_max: float = 0.0
) -> tuple[Tensor, dict[str, float]]:
    """The per-token reward penalty [B, T] (float32 at least, 0 outside the mask) and its metrics:
    `kl_reward/kl` (the batch's KL as the module docstring defines it, 0 with no loss token) and
    `kl_reward/coef`."""
    m = mask.bool()
    kl = torch.where(m, kl_penalty(old_logprobs, ref_logprobs, estimator, k3_max=k3_max), 0.0)
    n_s = m.sum(dim=-1)
    has = n_s > 0
    per_seq = kl.sum(dim=-1)[has] / n_s[has]
    batch_kl = float(per_seq.double().mean()) if bool(has.any()) else 0.0
    return -coef * kl, {"kl_reward/kl": batch_kl, "kl_reward/coef": coef}
