"""PPO's critic on the parallel stack: the clipped value loss, explained variance, and the critic's update.

The critic is a `ParallelPolicy` whose stage models are `model.value.ValueModel`s: its per-token pass
(`ParallelPolicy.logprobs`) answers with the values [B, T] (any layout, every rank the whole batch), and
its packed forward / backward runs the value loss below. It trains on the policy's mini-batches and epochs
(`ppo.*`), with its own distributed optimizer.

    value loss   v' = v_old + clip(v - v_old, -c, c)           (c = critic.value_clip; 0: no clipping)
                 l  = max((v - R)^2, (v' - R)^2)               per loss token, R the GAE return
                 loss = 0.5 * aggregate(l, mask, ppo.loss_agg_mode, mini-batch denominators)
    explained    1 - Var(R - v_old) / Var(R) over the loss tokens (0 when Var(R) = 0 or no token)
    variance
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.rl.batch import RolloutBatch
from megatron_gptoss.rl.learner import MetricTotals, run_epochs
from megatron_gptoss.rl.parallel_learner import ParallelPolicy
from megatron_gptoss.rl.ppo_loss import LossNormalizer, aggregate, loss_denominators
from megatron_gptoss.utils.host import to_device


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    mode: str,
    denom: LossNormalizer,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the clipped value loss (module docstring) and its metrics (detached
    0-dim float32): `loss/value` (the share), `critic/clipfrac` (tokens where the clipped error is the
    larger), `critic/values_mean`, `pg/tokens` (loss tokens, the weight of the means)."""
    m = mask.bool()
    v = values.float()
    old, ret = old_values.detach().float(), returns.detach().float()
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    err = torch.where(m, v - ret, zero).square()
    if clip > 0:
        clipped_v = old + (v - old).clamp(-clip, clip)
        err_clipped = torch.where(m, clipped_v - ret, zero).square()
        clipped = err_clipped > err
        per_token = torch.where(clipped, err_clipped, err)
    else:
        clipped, per_token = torch.zeros_like(m), err
    loss = 0.5 * aggregate(per_token, m, mode, denom)
    with torch.no_grad():
        count = m.sum()
        metrics = {
            "loss/value": loss.detach(),
            "critic/clipfrac": (clipped & m).sum() / count.clamp(min=1),
            "critic/values_mean": torch.where(m, v, zero).sum() / count.clamp(min=1),
            "pg/tokens": count,
        }
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def critic_gradients(critic: ParallelPolicy, mini: RolloutBatch, cfg: PPOConfig, clip: float) -> dict:
    """Forward and backward of the value loss on this replica's rows of `mini`; the mini-batch's metrics
    (collective over the critic's layout, like `ParallelPolicy.accumulate_gradients`)."""
    if mini.values is None or mini.returns is None:
        raise ValueError("the value loss needs a batch prepared with gae (values and returns)")
    mine = mini.select(critic.my_rows(len(mini)))
    denom = loss_denominators([mine.loss_mask.to(critic.runner.comm_device())], critic.dims.group("dp"))
    packed = critic.pack(mine, cfg.num_micro_batches)
    totals = MetricTotals()

    def loss_fn(rows: Tensor, values: Tensor, _unused: Tensor) -> Tensor:
        if not len(rows):  # a filler micro-batch
            return values.sum() * 0.0
        part = mine.select(rows.cpu())
        assert part.values is not None and part.returns is not None
        device = values.device
        loss, metrics = value_loss(
            values,
            to_device(part.values, device),
            to_device(part.returns, device),
            to_device(part.loss_mask, device),
            clip,
            cfg.loss_agg_mode,
            denom,
        )
        totals.add(metrics)
        return loss

    critic.runner.forward_backward(packed, loss_fn)
    return critic._combine(totals)


def critic_update(
    critic: ParallelPolicy, batch: RolloutBatch, cfg: PPOConfig, clip: float, generator=None
) -> dict[str, float]:
    """The critic's epochs over `batch` (the policy's mini-batch split and shuffle: `generator` seeded as
    the policy's), one optimizer step per mini-batch. Metrics on every rank: `critic/value_loss`,
    `critic/clipfrac`, `critic/values_mean`, `critic/grad_norm`, `critic/lr`."""
    if critic.optimizer is None:
        raise ValueError("critic_update needs a critic with an optimizer")
    optimizer = critic.optimizer

    def step(mini: RolloutBatch, on_policy: bool) -> dict[str, float]:
        metrics = critic_gradients(critic, mini, cfg, clip)
        stepped = optimizer.step()
        metrics["critic/grad_norm"] = stepped["train/grad_norm"]
        metrics["critic/lr"] = stepped["train/lr"]
        return metrics

    out = run_epochs(batch, cfg, generator, step)
    return {
        "critic/value_loss": out["loss/value"],
        **{k: v for k, v in out.items() if k.startswith("critic/")},
    }
