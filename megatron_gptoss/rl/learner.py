"""The learner's side of a PPO step: old/reference log-probs, rollout correction, and the update.

    batch -> prepare(): old log-probs (no grad), reference log-probs, rollout correction -> weights, mask
          -> update(): for epoch, for mini-batch: for micro-batch: forward, loss, backward; optimizer step

On-policy (one epoch, one mini-batch) the ratio's denominator is the current log-probs detached,
so the ratio is exactly 1 and the gradient is the policy gradient; otherwise the old log-probs
computed before the first update are used and clipping engages.
"""

from __future__ import annotations

import torch

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.rl.advantages import grpo_advantages
from megatron_gptoss.rl.batch import RolloutBatch, packed_logprobs
from megatron_gptoss.rl.correction import rollout_correction
from megatron_gptoss.rl.optim import MasterWeightAdamW
from megatron_gptoss.rl.ppo_loss import compute_total_loss, loss_denominators


def is_on_policy(cfg: PPOConfig) -> bool:
    return cfg.ppo_epochs == 1 and cfg.num_mini_batches == 1


@torch.no_grad()
def prepare(
    policy, batch: RolloutBatch, cfg: PPOConfig, temperature: float, group_size: int, reference=None
) -> tuple[RolloutBatch, dict[str, float]]:
    """Advantages, old and reference log-probs, and rollout-correction weights (mask updated for MIS)."""
    advantages = grpo_advantages(batch.rewards, group_size, cfg.norm_adv_by_std, cfg.adv_eps)
    old, _ = packed_logprobs(policy, batch, temperature)
    ref = packed_logprobs(reference, batch, temperature)[0] if reference is not None else None
    weights, mask, metrics = rollout_correction(
        old,
        batch.rollout_logprobs,
        batch.loss_mask,
        cfg.correction_mode,
        cfg.correction_threshold,
        cfg.correction_threshold_low,
    )
    prepared = batch.with_(
        advantages=advantages, old_logprobs=old, ref_logprobs=ref, is_weights=weights, loss_mask=mask.float()
    )
    return prepared, {k: float(v) for k, v in metrics.items()}


def accumulate_gradients(
    policy, mini_batch: RolloutBatch, cfg: PPOConfig, temperature: float, on_policy: bool, dp_group=None
) -> dict[str, float]:
    """Forward and backward over the micro-batches of one mini-batch (gradients accumulate in .grad).
    Each micro-batch's loss is normalised by the whole mini-batch's denominators."""
    micro_batches = [
        mini_batch.select(idx) for idx in torch.arange(len(mini_batch)).chunk(cfg.num_micro_batches)
    ]
    denom = loss_denominators([m.loss_mask for m in micro_batches], dp_group)
    totals: dict[str, float] = {}
    tokens = 0.0
    for micro in micro_batches:
        if micro.advantages is None or (micro.old_logprobs is None and not on_policy):
            raise ValueError("accumulate_gradients needs a batch from prepare() (advantages, old log-probs)")
        logprobs, entropy = packed_logprobs(policy, micro, temperature)
        old = logprobs.detach() if micro.old_logprobs is None or on_policy else micro.old_logprobs
        advantages = micro.advantages[:, None].expand_as(logprobs)
        loss, metrics = compute_total_loss(
            logprobs,
            old,
            advantages,
            micro.loss_mask,
            cfg,
            denom,
            ref_logprobs=micro.ref_logprobs,
            entropy=entropy,
            is_weights=micro.is_weights,
        )
        loss.backward()
        n = float(metrics["pg/tokens"])
        tokens += n
        for key, value in metrics.items():
            if key.startswith("loss/") or key == "pg/loss":
                totals[key] = totals.get(key, 0.0) + float(value)  # shares of the mini-batch value: add
            elif key.endswith("_max"):
                totals[key] = max(totals.get(key, float("-inf")), float(value))
            elif key.endswith("_min"):
                totals[key] = min(totals.get(key, float("inf")), float(value))
            elif key != "pg/tokens":
                totals[key] = totals.get(key, 0.0) + float(value) * n  # token-weighted means
    for key in list(totals):
        if not (key.startswith("loss/") or key == "pg/loss" or key.endswith(("_max", "_min"))):
            totals[key] /= max(tokens, 1.0)
    totals["pg/tokens"] = tokens
    return totals


def update(
    policy,
    optimizer: MasterWeightAdamW,
    batch: RolloutBatch,
    cfg: PPOConfig,
    temperature: float,
    generator=None,
) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch. Returns averaged metrics."""
    on_policy = is_on_policy(cfg)
    history: list[dict[str, float]] = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator) if not on_policy else torch.arange(len(batch))
        for idx in order.chunk(cfg.num_mini_batches):
            metrics = accumulate_gradients(policy, batch.select(idx), cfg, temperature, on_policy)
            metrics.update(optimizer.step())
            history.append(metrics)
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
    out["pg/ratio_max"] = max(h["pg/ratio_max"] for h in history)
    out["pg/ratio_min"] = min(h["pg/ratio_min"] for h in history)
    return out
