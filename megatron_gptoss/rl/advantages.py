"""GRPO advantages: each sample's reward compared with the other samples of its prompt.

The rollout batch holds `group_size` consecutive samples per prompt:
rewards[g * group_size : (g + 1) * group_size] all answer prompt g.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
