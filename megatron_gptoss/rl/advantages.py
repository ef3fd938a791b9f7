"""Advantage estimators: GRPO, Dr. GRPO, RLOO (sequence level) and REINFORCE++, REINFORCE++ with a group
baseline, GAE (token level).

The rollout batch holds `group_size` consecutive samples per prompt:
rewards[g * group_size : (g + 1) * group_size] all answer prompt g. Per-token tensors are [B, T]; `mask`
marks the tokens the policy wrote. A sequence's outcome reward sits on its last loss token
(`token_rewards`); tool, environment and prompt tokens (mask 0) take no discount step and keep no
advantage of their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gptoss.config.algorithm import AlgorithmConfig


def grpo_advantages(rewards: Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages of a flat batch of sequence rewards.

    advantage_i = (r_i - mean_g) / (std_g + eps) with norm_by_std, else r_i - mean_g, where g is
    the group of sample i. std_g is the unbiased sample standard deviation (divisor
    group_size - 1, `torch.std`'s default): a group whose rewards are all equal has std 0 and
    advantages exactly 0.

    Args:
        rewards: [N] rewards, N = number of prompts x group_size; any real dtype.
        group_size: samples per prompt, >= 2 (a group of one has no baseline and no std).
        norm_by_std: divide by the group's standard deviation (GRPO); False keeps r - mean (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        [N] advantages in the rewards' dtype when it is floating point, float32 otherwise.
        Computed without autograd history.

    Raises:
        ValueError: rewards not 1-D, group_size < 2, or N not divisible by group_size.
    """
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(
            f"grpo_advantages: group_size must be >= 2 (samples per prompt), got {group_size}; "
            "a group of one sample has no baseline"
        )
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(
            f"grpo_advantages: number of rewards N={n} is not divisible by group_size={group_size} "
            f"(N must be number of prompts x group_size; {n % group_size} reward(s) left over)"
        )
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    with torch.no_grad():
        grouped = rewards.detach().to(dtype).view(n // group_size, group_size)
        centered = grouped - grouped.mean(dim=1, keepdim=True)
        if norm_by_std:
            centered = centered / (grouped.std(dim=1, keepdim=True, correction=1) + eps)
        return centered.reshape(n)


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Per-token advantages: every loss token of sequence i gets adv[i], every other token 0.

    Args:
        adv: [N] per-sequence advantages (floating point).
        mask: [N, T] loss mask, nonzero (or True) at response tokens the policy wrote.

    Returns:
        [N, T] tensor in adv's dtype on adv's device.

    Raises:
        ValueError: adv not 1-D, mask not 2-D, or their first dimensions differ.
    """
    if adv.dim() != 1 or mask.dim() != 2 or adv.shape[0] != mask.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens: expected adv [N] and mask [N, T], got adv {tuple(adv.shape)} "
            f"and mask {tuple(mask.shape)}"
        )
    return torch.where(mask.bool(), adv[:, None], torch.zeros((), dtype=adv.dtype, device=adv.device))


def _check_groups(fn: str, rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"{fn}: group_size must be >= 2 (samples per prompt), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{fn}: N={rewards.numel()} rewards do not split into groups of {group_size}")


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: advantage_i = r_i - mean of the other group_size - 1 rewards of i's group
    (= group_size / (group_size - 1) x (r_i - group mean)). [N] in at least float32, no autograd history."""
    _check_groups("rloo_advantages", rewards, group_size)
    with torch.no_grad():
        grouped = _as_float(rewards.detach()).view(-1, group_size)
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - others).reshape(-1)


def _as_float(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: rewards[b] on row b's last loss token, 0 elsewhere (a row without loss tokens gets none).
    In at least float32."""
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"token_rewards: expected rewards [B] and mask [B, T], got {tuple(rewards.shape)} and "
            f"{tuple(mask.shape)}"
        )
    m = mask.bool()
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).max(dim=1).values
    out = torch.zeros(m.shape, dtype=_as_float(rewards).dtype, device=rewards.device)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = _as_float(rewards.detach())[rows]
    return out


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps), mean and unbiased variance over the tokens where mask is set
    (a single token has variance 0); 0 outside the mask. Equal values whiten to exactly 0."""
    m = mask.bool()
    n = m.sum()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    mean = torch.where(m, values, zero).sum() / n.clamp(min=1)
    centered = torch.where(m, values - mean, zero)
    var = centered.square().sum() / (n - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ returns: G_t = r_t + gamma G_next over the loss tokens of each row, G_next the return of
    the row's next loss token (0 after its last); tokens outside the mask take no discount step and hold
    0. rewards, mask: [B, T]."""
    m = mask.bool()
    r = _as_float(rewards.detach())
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(m[:, t], running, 0.0)
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the loss tokens of each row.

    For loss token t with next loss token t' of the same row (none after the last):
      delta_t = r_t + gamma V_t' - V_t      (V_t' = 0 after the last)
      A_t     = delta_t + gamma lam A_t'    (A_t' = 0 after the last)
      R_t     = A_t + V_t                   (the value target)
    Tokens outside the mask (tools, environment, prompt, padding) take no step: neither their value nor
    their reward enters, and they hold 0. Returns (advantages, returns), [B, T] in at least float32,
    not whitened."""
    _check_tokens("gae", rewards=rewards, values=values, mask=mask)
    m = mask.bool()
    r, v = _as_float(rewards.detach()), _as_float(values.detach())
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        next_adv = torch.where(m[:, t], a, next_adv)
        next_value = torch.where(m[:, t], v[:, t], next_value)
        adv[:, t] = torch.where(m[:, t], a, 0.0)
    return adv, torch.where(m, adv + v, 0.0)


@torch.no_grad()
def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the loss tokens, in float64; 0 when Var(R) = 0 or no loss token
    (never NaN or infinite)."""
    m = mask.bool()
    if int(m.sum()) == 0:
        return 0.0
    r, d = returns.double()[m], (returns.double() - values.double())[m]
    var_r = float(r.var(correction=0))
    if var_r <= 0.0:
        return 0.0
    return 1.0 - float(d.var(correction=0)) / var_r


def _check_tokens(fn: str, **tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"{fn}: expected [B, T] tensors of one shape, got {shapes}")


@torch.no_grad()
def compute_advantages(
    cfg: AlgorithmConfig,
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    token_penalty: Tensor | None = None,
) -> Tensor:
    """The advantages of `cfg.advantage` (not gae, which needs values: `gae`).

    Args:
        rewards: [B] sequence (outcome) rewards.
        mask: [B, T] loss mask.
        group_size: samples per prompt (consecutive rows).
        norm_by_std, eps: GRPO's division by the group's standard deviation and its epsilon.
        token_penalty: optional [B, T] per-token reward added to the outcome reward (the KL penalty in the
            reward, negative); sequence estimators add its sum over the loss tokens to the row's reward.

    Returns:
        [B] for grpo, dr_grpo, rloo (one advantage per sequence); [B, T] for reinforce_pp and
        reinforce_pp_baseline (0 outside the mask). At least float32.
    """
    m = mask.bool()
    penalty = None if token_penalty is None else torch.where(m, _as_float(token_penalty), 0.0)
    scores = _as_float(rewards.detach())
    if penalty is not None:
        scores = scores + penalty.sum(dim=1)
    name = cfg.advantage
    if name == "grpo":
        return grpo_advantages(scores, group_size, norm_by_std, eps)
    if name == "dr_grpo":
        return grpo_advantages(scores, group_size, norm_by_std=False)
    if name == "rloo":
        return rloo_advantages(scores, group_size)
    if name == "reinforce_pp":
        per_token = token_rewards(rewards, mask)
        if penalty is not None:
            per_token = per_token + penalty
        return masked_whiten(discounted_returns(per_token, mask, cfg.gamma), mask)
    if name == "reinforce_pp_baseline":
        centered = grpo_advantages(scores, group_size, norm_by_std=False)
        return masked_whiten(broadcast_to_tokens(centered, mask), mask)
    raise ValueError(f"compute_advantages: unknown estimator {name!r}")
