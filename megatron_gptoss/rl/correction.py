"""Rollout correction: importance weights between the learner's and the rollout engine's log-probs.

The rollout engine samples tokens from its own distribution (log-probs `rollout_logprobs`); the
learner computes the same tokens' log-probs before the update (`old_logprobs`). Kernel and
routing differences make the two differ; the PPO ratio is taken against `old_logprobs`, and the
weights here correct for the sampling distribution being the engine's:

    log w = old_logprobs - rollout_logprobs          (per token; computed in log space)

Modes (`PPOConfig.correction_mode`), thresholds T = threshold, T_low = threshold_low:
  none      weight 1.
  token-tis weight min(w_t, T) per token.
  token-mis weight w_t per token; a token with w_t outside [T_low, T] is removed from the mask.
  seq-tis   weight min(W_s, T) on every token of sequence s, W_s = exp(sum of its log w_t).
  seq-mis   weight W_s; a sequence with W_s outside [T_low, T] is removed from the mask.
  geo-tis   as seq-tis with the geometric mean G_s = exp(mean of its log w_t).
  geo-mis   as seq-mis with G_s.
Sums and means run over loss tokens only: tool, environment and prompt tokens (mask 0) influence
neither weights nor metrics, whatever their log-probs. Removed (masked) tokens leave the returned
mask, so they also leave the loss denominators when those are counted from it; their weight is 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_gptoss.config.train import CORRECTION_MODES


def _check_inputs(fn: str, old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> None:
    shapes = (tuple(old_logprobs.shape), tuple(rollout_logprobs.shape), tuple(mask.shape))
    if len(shapes[0]) != 2 or len(set(shapes)) != 1:
        raise ValueError(
            f"{fn}: expected old_logprobs, rollout_logprobs and mask of one shape [B, T], got "
            f"old_logprobs {shapes[0]}, rollout_logprobs {shapes[1]}, mask {shapes[2]}"
        )


def _log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, m: Tensor) -> Tensor:
    """float64 old - rollout at loss tokens, exactly 0 elsewhere (no gradient)."""
    diff = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    return torch.where(m, diff, 0.0)


def _mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def _extreme(x: Tensor, m: Tensor, largest: bool) -> Tensor:
    filled = torch.where(m, x, float("-inf") if largest else float("inf"))
    ext = filled.max() if largest else filled.min()
    return torch.where(m.any(), ext, torch.zeros_like(ext))


def _nearest_rank(x: Tensor, m: Tensor, q: float) -> Tensor:
    """The q-quantile of x over the entries where m is True by the nearest-rank rule (the ceil(q n)-th
    smallest of the n entries); 0 when n = 0. No host sync: the rank is a device index into the sorted
    values, the entries outside m sorted first as -inf."""
    flat = torch.where(m, x, float("-inf")).flatten()
    n = m.sum()
    rank = torch.ceil(q * n.double()).long().clamp(min=1)
    value = flat.sort().values.gather(0, (flat.numel() - n + rank - 1).clamp(0, flat.numel() - 1)[None])[0]
    return torch.where(n > 0, value, torch.zeros_like(value))


def _normalized_ess(log_w: Tensor, m: Tensor) -> Tensor:
    """(sum w)^2 / (N sum w^2) over the N entries where m is True, from log-weights (-inf = 0).

    1 when all weights are equal, 1/N when one weight dominates; 0 when no weight is positive,
    1 when N = 0.
    """
    lw = torch.where(m, log_w, float("-inf"))
    n = m.sum()
    lse1 = torch.logsumexp(lw.flatten(), dim=0)
    lse2 = torch.logsumexp(2.0 * lw.flatten(), dim=0)
    ess = torch.exp(2.0 * lse1 - lse2) / n.clamp(min=1)
    ess = torch.where(torch.isfinite(lse1), ess, torch.zeros_like(ess))
    return torch.where(n > 0, ess, torch.ones_like(ess))


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the learner's, over loss tokens only.

    With d = old_logprobs - rollout_logprobs at the loss tokens (computed in float64):
      mismatch/abs_diff_mean   mean |d|
      mismatch/abs_diff_max    max |d|
      mismatch/abs_diff_p99    99th percentile of |d| (nearest rank); over several micro-batches or ranks
                               the token-weighted mean of theirs
      mismatch/kl_k1           mean(-d): KL(rollout || learner) estimated on the rollout's samples
      mismatch/kl_k3           mean(exp(d) - d - 1): the same KL, the non-negative estimator
      mismatch/tokens          number of loss tokens
    Every value is a detached 0-dim float32 tensor; with no loss token they are 0.

    Args:
        old_logprobs, rollout_logprobs: [B, T] floating point.
        mask: [B, T] loss mask (nonzero or True = loss token).
    """
    _check_inputs("mismatch_metrics", old_logprobs, rollout_logprobs, mask)
    with torch.no_grad():
        m = mask.bool()
        d = _log_ratio(old_logprobs, rollout_logprobs, m)
        out = {
            "mismatch/abs_diff_mean": _mean(d.abs(), m),
            "mismatch/abs_diff_max": _extreme(d.abs(), m, largest=True),
            "mismatch/abs_diff_p99": _nearest_rank(d.abs(), m, 0.99),
            "mismatch/kl_k1": _mean(-d, m),
            "mismatch/kl_k3": _mean(torch.expm1(d) - d, m),
            "mismatch/tokens": m.sum(),
        }
    return {k: v.float() for k, v in out.items()}


def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    threshold: float,
    threshold_low: float,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights correcting for the rollout engine's sampling distribution.

    Args:
        old_logprobs: [B, T] learner log-probs before the update (float32; detached here).
        rollout_logprobs: [B, T] rollout engine log-probs of the same tokens.
        mask: [B, T] loss mask (nonzero or True = token the policy wrote).
        mode: one of CORRECTION_MODES (see the module docstring).
        threshold: truncation bound (TIS) or upper acceptance bound (MIS) of the weight, > 0.
        threshold_low: lower acceptance bound of the weight (MIS only), 0 <= threshold_low < threshold.

    Returns:
        weights: [B, T] float32, detached; 0 wherever new_mask is False. Pass as
            `ppo_policy_loss(..., is_weights=weights)`.
        new_mask: [B, T] bool: the mask less the tokens (token-mis) or sequences (seq-mis,
            geo-mis) outside [threshold_low, threshold]; equal to mask.bool() in the other modes.
        metrics: `mismatch_metrics` plus detached 0-dim float32 tensors over units (tokens for
            none/token-*, sequences with at least one loss token for seq-*/geo-*):
              correction/truncated_frac   fraction of units whose weight was truncated (TIS)
              correction/masked_frac      fraction of units removed from the mask (MIS)
              correction/masked_token_frac fraction of loss tokens removed from the mask
              correction/ess              normalised effective sample size of the weights
                                          applied, removed units counting as weight 0
              correction/weight_mean, correction/weight_max, correction/weight_min
                                          over the tokens of new_mask

    Raises:
        ValueError: shapes differ or are not 2-D, unknown mode, thresholds out of range.
    """
    _check_inputs("rollout_correction", old_logprobs, rollout_logprobs, mask)
    if mode not in CORRECTION_MODES:
        raise ValueError(
            f"rollout_correction: unknown correction mode {mode!r}; expected one of {CORRECTION_MODES}"
        )
    if not threshold > 0:
        raise ValueError(f"rollout_correction: threshold must be > 0, got {threshold}")
    if mode.endswith("-mis") and not 0 <= threshold_low < threshold:
        raise ValueError(
            f"rollout_correction: {mode} needs 0 <= threshold_low < threshold, got "
            f"threshold_low={threshold_low}, threshold={threshold}"
        )
    with torch.no_grad():
        m = mask.bool()
        log_w = _log_ratio(old_logprobs, rollout_logprobs, m)
        log_hi = math.log(threshold)
        log_lo = math.log(threshold_low) if threshold_low > 0 else float("-inf")

        if mode in ("none", "token-tis", "token-mis"):
            unit_mask = m
            unit_log_w = log_w
        else:
            n_s = m.sum(dim=-1)
            unit_mask = n_s > 0
            unit_log_w = log_w.sum(dim=-1)
            if mode.startswith("geo"):
                unit_log_w = unit_log_w / n_s.clamp(min=1)

        if mode == "none":
            keep = unit_mask
            unit_log_w = torch.zeros_like(unit_log_w)
            truncated = torch.zeros_like(unit_mask)
        elif mode.endswith("-tis"):
            keep = unit_mask
            truncated = unit_mask & (unit_log_w > log_hi)
            unit_log_w = unit_log_w.clamp(max=log_hi)
        else:
            keep = unit_mask & (unit_log_w >= log_lo) & (unit_log_w <= log_hi)
            truncated = torch.zeros_like(unit_mask)

        if unit_log_w.dim() == 1:
            new_mask = m & keep[:, None]
            token_log_w = unit_log_w[:, None].expand_as(log_w)
        else:
            new_mask = m & keep
            token_log_w = unit_log_w
        weights = torch.where(new_mask, torch.exp(token_log_w), 0.0)

        n_units = unit_mask.sum().clamp(min=1)
        applied_log_w = torch.where(keep, unit_log_w, float("-inf"))
        metrics = mismatch_metrics(old_logprobs, rollout_logprobs, m)
        metrics.update(
            {
                "correction/truncated_frac": truncated.sum() / n_units,
                "correction/masked_frac": (unit_mask & ~keep).sum() / n_units,
                "correction/masked_token_frac": (m & ~new_mask).sum() / m.sum().clamp(min=1),
                "correction/ess": _normalized_ess(applied_log_w, unit_mask),
                "correction/weight_mean": _mean(weights, new_mask),
                "correction/weight_max": _extreme(weights, new_mask, largest=True),
                "correction/weight_min": _extreme(weights, new_mask, largest=False),
            }
        )
    return weights.float(), new_mask, {k: v.float() for k, v in metrics.items()}


def staleness_metrics(
    versions: Tensor,
    version: int,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    new_mask: Tensor,
    weights: Tensor,
) -> dict[str, float]:
    """Version gaps of asynchronous rollouts, and the mismatch and correction split by gap.

    The gap of a token is `version` (the learner's, the proximal policy's) minus `versions` (the policy
    that sampled it, the behaviour policy). Over the trained tokens (`new_mask`, the loss mask after the
    rollout correction):
      staleness/max, staleness/mean
    and for every gap g among the loss tokens (`mask`, before the correction):
      mismatch/staleness{g}/*         `mismatch_metrics` over the loss tokens of gap g
      correction/staleness{g}/weight_mean        mean weight over its trained tokens
      correction/staleness{g}/masked_token_frac  share of its loss tokens the correction removed
    With no trained token staleness/* are 0.

    Args:
        versions: [B, T] int64, the sampling policy's version of each target (-1 at non-response positions).
        old_logprobs, rollout_logprobs: [B, T] proximal (learner) and behaviour (engine) log-probs.
        mask, new_mask: [B, T] the loss mask before and after the correction; weights: [B, T] its weights.
    """
    _check_inputs("staleness_metrics", old_logprobs, rollout_logprobs, mask)
    m, kept = mask.bool(), new_mask.bool()
    gaps = version - versions.long()
    if bool(((gaps < 0) & m).any()):
        raise ValueError(f"staleness_metrics: a token's version is newer than the learner's ({version})")
    trained = gaps[kept].double()
    out = {
        "staleness/max": float(trained.max()) if trained.numel() else 0.0,
        "staleness/mean": float(trained.mean()) if trained.numel() else 0.0,
    }
    for gap in sorted(set(gaps[m].tolist())):
        of_gap = m & (gaps == gap)
        for key, value in mismatch_metrics(old_logprobs, rollout_logprobs, of_gap).items():
            out[key.replace("mismatch/", f"mismatch/staleness{gap}/")] = float(value)
        out[f"correction/staleness{gap}/weight_mean"] = float(_mean(weights.double(), of_gap & kept))
        out[f"correction/staleness{gap}/masked_token_frac"] = float((of_gap & ~kept).sum() / of_gap.sum())
    return out
