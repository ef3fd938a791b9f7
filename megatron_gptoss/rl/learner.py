"""The layout-independent pieces of the PPO step, which `rl.parallel_learner` runs on the parallel policy
(any layout, world size 1 included):

    prepare_with   advantages, old / reference log-probs from a log-prob function, rollout correction
    micro_loss     the PPO loss of a micro-batch normalised by the whole mini-batch's denominators
    MetricTotals   micro-batch metrics combined into the mini-batch's
    run_epochs     PPO epochs over (shuffled) mini-batches, one optimizer step each

On-policy (one epoch, one mini-batch) the ratio's denominator is the current log-probs detached,
so the ratio is exactly 1 and the gradient is the policy gradient; otherwise the old log-probs
computed before the first update are used and clipping engages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.rl.advantages import (
    compute_advantages,
    explained_variance,
    gae,
    masked_whiten,
    token_rewards,
)
from megatron_gptoss.rl.batch import RolloutBatch
from megatron_gptoss.rl.correction import rollout_correction
from megatron_gptoss.rl.kl_control import reward_kl_penalty
from megatron_gptoss.rl.ppo_loss import LossNormalizer, compute_total_loss
from megatron_gptoss.utils.host import to_device

# batch -> per-token log-probs [B, T] of its targets (0 at padding)
LogprobFn = Callable[[RolloutBatch], torch.Tensor]


def is_on_policy(cfg: PPOConfig) -> bool:
    return cfg.ppo_epochs == 1 and cfg.num_mini_batches == 1


@torch.no_grad()
def prepare_with(
    logprobs_of: LogprobFn,
    ref_logprobs_of: LogprobFn | None,
    batch: RolloutBatch,
    cfg: PPOConfig,
    group_size: int,
    algorithm: AlgorithmConfig | None = None,
    kl_reward_coef: float | None = None,
    values_of: LogprobFn | None = None,
) -> tuple[RolloutBatch, dict[str, float]]:
    """`prepare` with the log-probs of the whole batch from `logprobs_of(batch)` (a single model, or a
    parallel policy whose ranks each compute their rows). `algorithm` picks the advantage estimator and the
    KL penalty in the reward (None: the defaults of `AlgorithmConfig`: GRPO, no penalty); `kl_reward_coef`
    is the penalty's coefficient now (None: `algorithm.kl_in_reward_coef`; an adaptive controller's value).
    `values_of(batch)`: the critic's values [B, T], required by gae (the batch then carries `values` and
    `returns`, and the metrics `critic/explained_var`)."""
    algorithm = algorithm if algorithm is not None else AlgorithmConfig()
    coef = algorithm.kl_in_reward_coef if kl_reward_coef is None else kl_reward_coef
    old = logprobs_of(batch)
    ref = ref_logprobs_of(batch) if ref_logprobs_of is not None else None
    penalty: torch.Tensor | None = None
    penalty_metrics: dict[str, float] = {}
    if algorithm.kl_in_reward_coef:
        if ref is None:
            raise ValueError("algorithm.kl_in_reward_coef > 0 needs reference log-probs (a reference policy)")
        penalty, penalty_metrics = reward_kl_penalty(
            old, ref, batch.loss_mask, coef, algorithm.kl_in_reward_estimator, cfg.kl_k3_max
        )
    values = returns = None
    if algorithm.advantage == "gae":
        if values_of is None:
            raise ValueError("algorithm.advantage='gae' needs the critic's values (values_of)")
        values = values_of(batch)
        rewards = token_rewards(batch.rewards, batch.loss_mask)
        if penalty is not None:
            rewards = rewards + penalty
        raw, returns = gae(rewards, values, batch.loss_mask, algorithm.gamma, algorithm.lam)
        advantages = masked_whiten(raw, batch.loss_mask)
        penalty_metrics["critic/explained_var"] = explained_variance(returns, values, batch.loss_mask)
    else:
        advantages = compute_advantages(
            algorithm, batch.rewards, batch.loss_mask, group_size, cfg.norm_adv_by_std, cfg.adv_eps, penalty
        )
    weights, mask, metrics = rollout_correction(
        old,
        batch.rollout_logprobs,
        batch.loss_mask,
        cfg.correction_mode,
        cfg.correction_threshold,
        cfg.correction_threshold_low,
    )
    prepared = batch.with_(
        advantages=advantages,
        old_logprobs=old,
        ref_logprobs=ref,
        is_weights=weights,
        loss_mask=mask.float(),
        values=values,
        returns=returns,
    )
    return prepared, {**{k: float(v) for k, v in metrics.items()}, **penalty_metrics}


class MetricTotals:
    """Metrics of micro-batches combined into the mini-batch's: loss shares add up, extremes combine,
    the rest are token-weighted means (weights: each micro-batch's `pg/tokens`).

    `add` keeps the micro-batch's values as they are (device tensors, detached) and reading them
    waits for `sums` / `tokens` / `result`: a loss function that records its metrics makes no host
    sync between the forward and the backward."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._tokens = 0.0
        self._pending: list[dict] = []

    @property
    def sums(self) -> dict[str, float]:
        self._fold()
        return self._sums

    @property
    def tokens(self) -> float:
        self._fold()
        return self._tokens

    @tokens.setter
    def tokens(self, value: float) -> None:
        self._fold()
        self._tokens = value

    @staticmethod
    def kind(key: str) -> str:
        if key.startswith("loss/") or key == "pg/loss" or key == "pg/tokens":
            return "sum"
        if key.endswith("_max"):
            return "max"
        if key.endswith("_min"):
            return "min"
        return "mean"

    def add(self, metrics: dict) -> None:
        if "pg/tokens" not in metrics:
            raise KeyError("micro-batch metrics need 'pg/tokens' (the weight of their means)")
        kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self._pending.append(kept)

    def _fold(self) -> None:
        """Read the pending micro-batches' values (in the order added) into the totals."""
        pending, self._pending = self._pending, []
        for metrics in pending:
            n = float(metrics["pg/tokens"])
            self._tokens += n
            for key, value in metrics.items():
                kind, value = self.kind(key), float(value)
                if kind == "max":
                    self._sums[key] = max(self._sums.get(key, float("-inf")), value)
                elif kind == "min":
                    self._sums[key] = min(self._sums.get(key, float("inf")), value)
                else:
                    self._sums[key] = self._sums.get(key, 0.0) + value * (n if kind == "mean" else 1.0)

    def result(self) -> dict[str, float]:
        """The combined metrics (means divided by the tokens, `pg/tokens` their total)."""
        out = dict(self.sums)
        for key in out:
            if self.kind(key) == "mean":
                out[key] /= max(self.tokens, 1.0)
        return out


def micro_loss(
    micro: RolloutBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    cfg: PPOConfig,
    denom: LossNormalizer,
    on_policy: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of a micro-batch's rows given their current log-probs and entropy [R, T]."""
    if micro.advantages is None or (micro.old_logprobs is None and not on_policy):
        raise ValueError("the PPO loss needs a batch from prepare() (advantages, old log-probs)")
    old = logprobs.detach() if micro.old_logprobs is None or on_policy else micro.old_logprobs
    adv = micro.advantages
    advantages = adv[:, None].expand_as(logprobs) if adv.dim() == 1 else adv
    device = logprobs.device
    return compute_total_loss(
        logprobs,
        to_device(old, device),
        to_device(advantages, device),
        to_device(micro.loss_mask, device),
        cfg,
        denom,
        ref_logprobs=None if micro.ref_logprobs is None else to_device(micro.ref_logprobs, device),
        entropy=entropy,
        is_weights=None if micro.is_weights is None else to_device(micro.is_weights, device),
    )


def run_epochs(
    batch: RolloutBatch,
    cfg: PPOConfig,
    generator,
    step: Callable[[RolloutBatch, bool], dict[str, float]],
) -> dict[str, float]:
    """`cfg.ppo_epochs` passes over `batch` in `cfg.num_mini_batches` mini-batches (shuffled by `generator`
    unless on-policy); `step(mini_batch, on_policy)` trains on one and returns its metrics. Returns the
    metrics averaged over the mini-batches (extremes, `*_max` / `*_min`, over all of them)."""
    on_policy = is_on_policy(cfg)
    history: list[dict[str, float]] = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator) if not on_policy else torch.arange(len(batch))
        for idx in order.chunk(cfg.num_mini_batches):
            history.append(step(batch.select(idx), on_policy))
    out = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
    for key in out:
        if MetricTotals.kind(key) in ("max", "min"):
            pick = max if MetricTotals.kind(key) == "max" else min
            out[key] = pick(h[key] for h in history)
    return out
