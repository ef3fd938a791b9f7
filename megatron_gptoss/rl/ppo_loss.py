"""PPO policy loss, KL penalty, entropy bonus and their aggregation over a mini-batch.

Every per-token tensor is [B, T] (sequences x tokens) of one micro-batch. `mask` is the loss mask:
nonzero (or True) at response tokens the policy wrote; prompt, tool and environment tokens are 0.
Values at masked-out positions never reach a loss, a gradient or a metric (they may be anything,
including inf or nan).

Normalisation: each micro-batch divides by the denominators of the whole mini-batch
(`LossNormalizer`, from `loss_denominators`), so the sum of the micro-batch losses over gradient
accumulation and data-parallel ranks equals the loss of the mini-batch as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_gptoss.config.train import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, PPOConfig


@dataclass(frozen=True)
class LossNormalizer:
    """Global denominators of one mini-batch (all its micro-batches on all data-parallel ranks)."""

    # Number of loss tokens (mask nonzero).
    tokens: int
    # Number of sequences with at least one loss token (a sequence with none is not counted).
    seqs: int


def loss_denominators(masks: list[Tensor], dp_group: dist.ProcessGroup | None = None) -> LossNormalizer:
    """Count the loss tokens and the sequences of a mini-batch.

    Args:
        masks: the [B_i, T_i] loss masks of this rank's micro-batches of the mini-batch.
        dp_group: the data-parallel group; the counts are all-reduced (SUM) over it. None means a
            single process: no collective. The count tensor lives on masks[0]'s device, which the
            group's backend must support (gloo: CPU, NCCL: CUDA).

    Returns:
        LossNormalizer with the mini-batch totals (identical on every rank of dp_group).
        Synchronises with the device (the counts become python ints).
    """
    if not masks:
        raise ValueError("loss_denominators: masks is empty; pass the masks of every micro-batch")
    for i, m in enumerate(masks):
        if m.dim() != 2:
            raise ValueError(f"loss_denominators: masks[{i}] must be 2-D [B, T], got shape {tuple(m.shape)}")
    counts = torch.zeros(2, dtype=torch.int64, device=masks[0].device)
    for m in masks:
        b = m.to(counts.device).bool()
        counts[0] += b.sum()
        counts[1] += b.any(dim=-1).sum()
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    tokens, seqs = counts.tolist()
    return LossNormalizer(tokens=int(tokens), seqs=int(seqs))


def _check_per_token(fn: str, **tensors: Tensor | None) -> None:
    """Raise ValueError unless every given tensor is 2-D with the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        listed = ", ".join(f"{name} {s}" for name, s in shapes.items())
        raise ValueError(f"{fn}: expected per-token tensors of one shape [B, T], got {listed}")


def _float(x: Tensor) -> Tensor:
    """x in at least float32 (a float32 tensor is returned as is)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def aggregate(values: Tensor, mask: Tensor, mode: str, denom: LossNormalizer) -> Tensor:
    """This micro-batch's share of a mini-batch mean of per-token values.

    Modes (S = sequences of this micro-batch, n_s = loss tokens of sequence s):
      token-mean:           sum_{s,t} v[s,t] m[s,t] / denom.tokens
      seq-mean-token-sum:   sum_s (sum_t v[s,t] m[s,t]) / denom.seqs
      seq-mean-token-mean:  sum_s (sum_t v[s,t] m[s,t] / n_s) / denom.seqs   (0 when n_s = 0)
    A zero denominator (no loss token anywhere) counts as 1, giving 0.

    Args:
        values: [B, T] floating point, may require grad.
        mask: [B, T] loss mask (nonzero or True = loss token).
        mode: one of LOSS_AGG_MODES.
        denom: the mini-batch denominators from `loss_denominators`.

    Returns:
        0-dim tensor in values' dtype; summing it over the micro-batches of the mini-batch (and
        over data-parallel ranks, through the gradient all-reduce) gives the mini-batch mean.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"aggregate: unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}"
        )
    _check_per_token("aggregate", values=values, mask=mask)
    m = mask.bool()
    masked = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "token-mean":
        return masked.sum() / max(denom.tokens, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(denom.seqs, 1)
    n_s = m.sum(dim=-1).clamp(min=1).to(values.dtype)
    return (masked.sum(dim=-1) / n_s).sum() / max(denom.seqs, 1)


def _masked_mean(x: Tensor, m: Tensor, count: Tensor) -> Tensor:
    return torch.where(m, x, 0.0).sum() / count.clamp(min=1)


def _masked_extreme(x: Tensor, m: Tensor, count: Tensor, largest: bool) -> Tensor:
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(m, x, fill)
    ext = filled.max() if largest else filled.min()
    return torch.where(count > 0, ext, torch.zeros_like(ext))


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PPOConfig,
    denom: LossNormalizer,
    is_weights: Tensor | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate of one micro-batch: PPO's (clip-higher, dual clip) or GSPO's (`cfg.policy_loss`).

    "ppo": per loss token, with r = exp(logprobs - old_logprobs) and A the advantage:
      pg1 = -A r,  pg2 = -A clip(r, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
      pg  = max(pg1, pg2)                         (the clipped branch is active where pg2 > pg1)
      pg  = min(pg, -A c) where A < 0             (dual clip, c = cfg.clip_ratio_c; off when c = 0)
      pg  = pg * is_weights                       (rollout correction, detached)
    loss = aggregate(pg, mask, cfg.loss_agg_mode, denom). Active clip branches carry no gradient.

    "gspo": one ratio per sequence, the length-normalised s_i = exp(mean over its loss tokens of
    (logprobs - old_logprobs)), and one advantage A_i (the mean of its tokens' advantages):
      l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_ratio_low, 1 + clip_ratio_high))
    set on every loss token of sequence i (times is_weights) and aggregated as above; with
    "seq-mean-token-mean" the loss is the mean of l_i over the sequences, GSPO's objective.
    "gspo_token": per token s_{i,t} = sg[s_i] exp(logprobs_t - sg[logprobs_t]) (value s_i) with the token's
    own advantage, clipped per token; with advantages constant over a sequence its loss and gradient equal
    "gspo"'s. No dual clip for either. On-policy both give s = 1 and the gradient of
    aggregate(-A * logprobs, mask, cfg.loss_agg_mode, denom).

    The log-ratio is clamped to [-max_log_ratio, max_log_ratio] before exp (ratios beyond e^20 get
    no gradient). On-policy (old_logprobs = logprobs.detach()) the log-ratio is exactly 0, r is
    exactly 1, no branch is clipped, and (without is_weights) the gradient equals that of
    aggregate(-A * logprobs, mask, cfg.loss_agg_mode, denom) bit for bit.

    Args:
        logprobs: [B, T] current policy log-probs of the sampled tokens (requires grad).
        old_logprobs: [B, T] log-probs of the policy that the update started from (detached here).
        advantages: [B, T] per-token advantages (see `broadcast_to_tokens`), detached here.
        mask: [B, T] loss mask.
        cfg: policy_loss, clip_ratio_low, clip_ratio_high, clip_ratio_c and loss_agg_mode are read.
        denom: mini-batch denominators.
        is_weights: optional [B, T] per-token rollout-correction weights (detached here).
        max_log_ratio: bound of the log-ratio before exp.

    Returns:
        (loss, metrics): loss is this micro-batch's 0-dim share of the mini-batch loss, in at least
        float32. metrics are detached 0-dim float32 tensors, means over this call's loss tokens:
          pg/loss            the returned loss (detached)
          pg/clipfrac        fraction of tokens where the clipped branch is active (gspo: tokens of
                             clipped sequences)
          pg/dual_clipfrac   fraction of tokens where the dual clip is active
          pg/ratio_mean, pg/ratio_max, pg/ratio_min   (gspo*: the sequence ratio on each token)
          pg/approx_kl_k1    mean of old - new          (KL(old || new) on the old policy's samples)
          pg/approx_kl_k3    mean of r - 1 - log r
          pg/tokens          number of loss tokens in this call (to weight means across calls)
    """
    _check_per_token(
        "ppo_policy_loss",
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        is_weights=is_weights,
    )
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(
            f"ppo_policy_loss: unknown policy loss {cfg.policy_loss!r}; expected one of {POLICY_LOSSES}"
        )
    m = mask.bool()
    logprobs = _float(logprobs)
    adv = _float(advantages.detach())
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(m, logprobs - _float(old_logprobs.detach()), zero)
    log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    if cfg.policy_loss == "ppo":
        ratio = torch.exp(log_ratio)
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
        clipped = pg2 > pg1
        pg = torch.where(clipped, pg2, pg1)
        if cfg.clip_ratio_c:
            pg3 = -adv * cfg.clip_ratio_c
            dual = (adv < 0) & (pg > pg3)
            pg = torch.where(dual, pg3, pg)
        else:
            dual = torch.zeros_like(m)
    else:
        ratio, pg, clipped = _gspo(logprobs, log_ratio, adv, m, cfg, max_log_ratio)
        dual = torch.zeros_like(m)
    if is_weights is not None:
        pg = pg * _float(is_weights.detach())
    loss = aggregate(pg, m, cfg.loss_agg_mode, denom)

    with torch.no_grad():
        count = m.sum()
        metrics = {
            "pg/loss": loss.detach(),
            "pg/clipfrac": _masked_mean(clipped.to(ratio.dtype), m, count),
            "pg/dual_clipfrac": _masked_mean(dual.to(ratio.dtype), m, count),
            "pg/ratio_mean": _masked_mean(ratio, m, count),
            "pg/ratio_max": _masked_extreme(ratio, m, count, largest=True),
            "pg/ratio_min": _masked_extreme(ratio, m, count, largest=False),
            "pg/approx_kl_k1": _masked_mean(-log_ratio, m, count),
            "pg/approx_kl_k3": _masked_mean(ratio - 1.0 - log_ratio, m, count),
            "pg/tokens": count,
        }
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def _gspo(
    logprobs: Tensor, log_ratio: Tensor, adv: Tensor, m: Tensor, cfg: PPOConfig, max_log_ratio: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO's per-token ratio, loss and clip flags [B, T] (see `ppo_policy_loss`)."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    n_s = m.sum(dim=-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / n_s).clamp(-max_log_ratio, max_log_ratio)
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    if cfg.policy_loss == "gspo":
        seq_adv = torch.where(m, adv, zero).sum(dim=-1, keepdim=True) / n_s
        seq_ratio = torch.exp(seq_log_ratio)
        pg1, pg2 = -seq_adv * seq_ratio, -seq_adv * seq_ratio.clamp(low, high)
        seq_clipped = pg2 > pg1
        seq_pg = torch.where(seq_clipped, pg2, pg1)
        return seq_ratio.expand_as(logprobs), seq_pg.expand_as(logprobs), seq_clipped.expand_as(m)
    own = torch.where(m, logprobs, zero)  # masked positions may hold inf / nan
    ratio = torch.exp(seq_log_ratio.detach() + own - own.detach())
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(low, high)
    clipped = pg2 > pg1
    return ratio, torch.where(clipped, pg2, pg1), clipped


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str,
    max_log_ratio: float = 20.0,
    k3_max: float = 0.0,
) -> Tensor:
    """Per-token estimate of KL(policy || reference) on the policy's own samples.

    With d = ref_logprobs - logprobs:
      k1 = -d = logprobs - ref_logprobs                 (unbiased, can be negative)
      k2 = d^2 / 2                                      (biased, >= 0; its gradient is KL's in expectation)
      k3 = exp(d) - d - 1                               (unbiased, >= 0)
    For k3, d is clamped to [-max_log_ratio, max_log_ratio] first, so k3 <= e^20 - 21 and its
    gradient stay finite in float32 (a token beyond the bound gets no gradient); then, when k3_max > 0,
    k3 is clamped to at most k3_max (a token above it gets no gradient).

    Args:
        logprobs: [B, T] current policy log-probs (may require grad).
        ref_logprobs: [B, T] reference policy log-probs (detached here).
        estimator: "k1", "k2" or "k3".
        k3_max: upper bound of k3 (0: none).

    Returns:
        [B, T] in at least float32; reduce with `aggregate` and a mask.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    _check_per_token("kl_penalty", logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = _float(ref_logprobs.detach()) - _float(logprobs)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    d = d.clamp(-max_log_ratio, max_log_ratio)
    k3 = torch.exp(d) - d - 1.0
    return k3.clamp(max=k3_max) if k3_max > 0 else k3


def entropy_bonus(entropy: Tensor, mask: Tensor, mode: str, denom: LossNormalizer) -> Tensor:
    """Mean policy entropy of the loss tokens: aggregate(entropy, mask, mode, denom), 0-dim.

    entropy: [B, T] per-token entropy of the policy's distribution (may require grad).
    """
    return aggregate(_float(entropy), mask, mode, denom)


def compute_total_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PPOConfig,
    denom: LossNormalizer,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor loss of one micro-batch:

        loss = pg_loss + cfg.kl_coef * aggregate(kl_penalty) - cfg.entropy_coef * aggregate(entropy)

    all three aggregated with cfg.loss_agg_mode and the same mini-batch denominators, so the sum
    over micro-batches and data-parallel ranks is the mini-batch loss.

    Args:
        logprobs, old_logprobs, advantages, mask, cfg, denom, is_weights: as in `ppo_policy_loss`.
        ref_logprobs: [B, T] reference log-probs; required when cfg.kl_coef != 0.
        entropy: [B, T] per-token policy entropy; required when cfg.entropy_coef != 0.

    Returns:
        (loss, metrics): the 0-dim loss and `ppo_policy_loss`'s metrics plus
        loss/total, loss/kl and loss/entropy (detached shares of the mini-batch values; loss/kl and
        loss/entropy appear when their input is given).
    """
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError(f"compute_total_loss: ppo.kl_coef={cfg.kl_coef} needs ref_logprobs, got None")
    if cfg.entropy_coef and entropy is None:
        raise ValueError(f"compute_total_loss: ppo.entropy_coef={cfg.entropy_coef} needs entropy, got None")
    loss, metrics = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cfg, denom, is_weights)
    if ref_logprobs is not None:
        per_token = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator, k3_max=cfg.kl_k3_max)
        kl = aggregate(per_token, mask, cfg.loss_agg_mode, denom)
        metrics["loss/kl"] = kl.detach().float()
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        _check_per_token("compute_total_loss", entropy=entropy, mask=mask)
        ent = entropy_bonus(entropy, mask, cfg.loss_agg_mode, denom)
        metrics["loss/entropy"] = ent.detach().float()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
    metrics["loss/total"] = loss.detach().float()
    return loss, metrics
