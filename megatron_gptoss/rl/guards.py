"""Divergence guards: rollout groups with a non-finite reward are dropped, steps whose loss or gradient norm
is not finite are counted, and a run that keeps skipping or blows up stops before its damaged weights
become the newest checkpoint.

    drop_nonfinite_groups(batch, G)   before `prepare`: every group (G consecutive rows, one prompt) with
                                      a NaN / inf reward gets reward 0 and loss mask 0, so its rows add
                                      no token, no sequence, no advantage and no correction statistic
    DivergenceGuard(...)              after `update`: check_step(step, metrics) -> GuardVerdict
                                      "ok"    the update was applied and is within bounds
                                      "skip"  the optimizer skipped it (non-finite gradient norm, its
                                              `train/skipped`) or the loss is not finite
                                      "stop"  max_consecutive_skips skips in a row, or a finite loss or
                                              gradient norm beyond its bound: `raise_if_stop()` raises
                                              DivergenceError; save nothing (the newest checkpoint
                                              stays the last good one)

The optimizers (`parallel.data_parallel.DistributedOptimizer`, `rl.optim.MasterWeightAdamW`) already
skip an update whose global gradient norm is not finite: they leave parameters and optimizer state
unchanged and report `train/skipped` 1.0 (averaged over the mini-batches of a step by `update`). The
metrics `update` returns are the same on every rank, so every rank reaches the same verdict without a
collective.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megatron_gptoss.errors import DivergenceError
from megatron_gptoss.rl.batch import RolloutBatch

log = logging.getLogger(__name__)

# The keys of the metrics `rl.learner.update` / `rl.parallel_learner.update` return that the guard reads.
LOSS_KEY = "loss/total"
GRAD_NORM_KEY = "train/grad_norm"
UPDATE_RATIO_KEY = "train/update_ratio"  # ||weights after - before|| / ||before|| of the step's updates
SKIPPED_KEY = "train/skipped"


# ------------------------------------------------------------------------------------------------
# Non-finite rewards
@dataclass(frozen=True)
class RewardFilter:
    """Which rows of a rollout batch are kept: a group is dropped whole when any reward in it is NaN or
    infinite."""

    keep: Tensor  # [B] bool, False on every row of a dropped group
    groups: int  # B / group_size
    dropped_groups: int
    dropped_samples: int  # dropped_groups x group_size

    @property
    def all_dropped(self) -> bool:
        """No group is left: skip the step (no generation is worth a gradient)."""
        return self.dropped_groups == self.groups

    def metrics(self) -> dict[str, float]:
        return {
            "guard/dropped_groups": float(self.dropped_groups),
            "guard/dropped_samples": float(self.dropped_samples),
        }


def nonfinite_reward_groups(rewards: Tensor, group_size: int) -> RewardFilter:
    """The keep-mask of `rewards` [B] (groups of `group_size` consecutive rows, B divisible by it)."""
    if rewards.dim() != 1:
        raise ValueError(
            f"nonfinite_reward_groups: rewards must be 1-D [B], got shape {tuple(rewards.shape)}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"nonfinite_reward_groups: B={rewards.numel()} rewards do not split into groups of {group_size}"
        )
    groups = rewards.numel() // group_size
    good = torch.isfinite(rewards.detach()).view(groups, group_size).all(dim=1)  # [groups]
    dropped = groups - int(good.sum())
    keep = good.repeat_interleave(group_size)
    return RewardFilter(keep, groups, dropped, dropped * group_size)


def drop_nonfinite_groups(batch: RolloutBatch, group_size: int) -> tuple[RolloutBatch, RewardFilter]:
    """`batch` with every group holding a non-finite reward taken out of the loss: its rewards set to 0
    (so GRPO gives its rows advantage 0) and its loss mask zeroed (no token or sequence of it counts in
    the loss denominators). Rows are kept in place: the batch keeps its shape and group layout. Call
    before `prepare`; when `filter.all_dropped`, skip the step instead."""
    kept = nonfinite_reward_groups(batch.rewards, group_size)
    if kept.dropped_groups == 0:
        return batch, kept
    keep = kept.keep.to(batch.rewards.device)
    rewards = torch.where(keep, batch.rewards, torch.zeros_like(batch.rewards))
    mask = batch.loss_mask * keep[:, None].to(batch.loss_mask.dtype)
    changes: dict[str, Tensor] = {"rewards": rewards, "loss_mask": mask}
    if batch.advantages is not None:
        rows = keep.view(-1, *([1] * (batch.advantages.dim() - 1)))  # [B] or [B, 1]
        changes["advantages"] = torch.where(rows, batch.advantages, torch.zeros_like(batch.advantages))
    return batch.with_(**changes), kept


# ------------------------------------------------------------------------------------------------
# Diverging steps
Action = Literal["ok", "skip", "stop"]


@dataclass(frozen=True)
class GuardVerdict:
    """What the trainer does with a step: "ok" go on; "skip" go on (the update was not applied, the step
    counts); "stop" raise DivergenceError(reason) before any save."""

    action: Action
    reason: str  # empty when "ok"
    metrics: dict[str, float]  # guard/skipped_steps (run total), guard/consecutive_skips: log them

    @property
    def stop(self) -> bool:
        return self.action == "stop"

    def raise_if_stop(self) -> None:
        """Raise DivergenceError(reason) when the verdict is "stop"."""
        if self.stop:
            raise DivergenceError(self.reason)


class DivergenceGuard:
    """Counts skipped steps and stops a diverging run.

    Args:
        max_consecutive_skips: this many skipped steps in a row stop the run (0: never for this reason).
        max_loss: a finite |loss| above this stops the run (inf: no bound).
        max_grad_norm: a finite gradient norm (before clipping) above this stops the run (inf: no bound).
        max_update_ratio: an update that moves the weights by more than this fraction of their norm
            (the optimizer's `train/update_ratio`) stops the run (inf: no bound): weights a huge learning
            rate destroyed often give finite, even zero, losses and gradients afterwards.

    `state_dict` / `load_state_dict` carry the counters across a resume (the run's checkpoint metadata).
    """

    def __init__(
        self,
        max_consecutive_skips: int,
        max_loss: float,
        max_grad_norm: float,
        max_update_ratio: float = float("inf"),
    ):
        if max_consecutive_skips < 0:
            raise ValueError(
                f"DivergenceGuard: max_consecutive_skips must be >= 0, got {max_consecutive_skips}"
            )
        if not (max_loss > 0 and max_grad_norm > 0 and max_update_ratio > 0):
            raise ValueError(
                f"DivergenceGuard: bounds must be > 0, got max_loss={max_loss}, "
                f"max_grad_norm={max_grad_norm}, max_update_ratio={max_update_ratio}"
            )
        self.max_update_ratio = max_update_ratio
        self.max_consecutive_skips, self.max_loss, self.max_grad_norm = (
            max_consecutive_skips,
            max_loss,
            max_grad_norm,
        )
        self.skipped_steps = 0
        self.consecutive_skips = 0

    def check_step(self, step: int, metrics: dict[str, float]) -> GuardVerdict:
        """The verdict on step `step` from the metrics `update` returned (LOSS_KEY, GRAD_NORM_KEY,
        SKIPPED_KEY; a missing key counts as fine). Logs skipped and stopping steps with `step`."""
        loss = float(metrics.get(LOSS_KEY, 0.0))
        norm = float(metrics.get(GRAD_NORM_KEY, 0.0))
        skipped = float(metrics.get(SKIPPED_KEY, 0.0))
        values = f"loss {loss:.6g}, grad norm {norm:.6g}, optimizer skipped {skipped:g}"
        if skipped > 0 or not (math.isfinite(loss) and math.isfinite(norm)):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            action: Action = "skip"
            reason = f"step {step} skipped ({values}): {self.consecutive_skips} in a row"
            if self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
                action = "stop"
                reason += f", the limit (max_consecutive_skips={self.max_consecutive_skips})"
        else:
            self.consecutive_skips = 0
            action, reason = "ok", ""
            if abs(loss) > self.max_loss:
                action, reason = "stop", f"step {step}: |loss| {abs(loss):.6g} > max_loss={self.max_loss:g}"
            elif norm > self.max_grad_norm:
                action = "stop"
                reason = f"step {step}: grad norm {norm:.6g} > max_grad_norm={self.max_grad_norm:g}"
            elif float(metrics.get(UPDATE_RATIO_KEY, 0.0)) > self.max_update_ratio:
                ratio = float(metrics[UPDATE_RATIO_KEY])
                action = "stop"
                reason = (
                    f"step {step}: the update moved the weights by {ratio:.6g} of their norm "
                    f"> max_update_ratio={self.max_update_ratio:g} (is the learning rate too large?)"
                )
            if action == "stop":
                reason += f" ({values}; the update was applied: these weights are not saved)"
        if action == "skip":
            log.warning("%s", reason)
        elif action == "stop":
            log.error("divergence: %s", reason)
        return GuardVerdict(action, reason, self.metrics())

    def metrics(self) -> dict[str, float]:
        return {
            "guard/skipped_steps": float(self.skipped_steps),
            "guard/consecutive_skips": float(self.consecutive_skips),
        }

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])
