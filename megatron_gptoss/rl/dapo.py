"""DAPO's pieces that act on rewards: the soft overlong penalty and the groups dynamic sampling drops.

overlong penalty   L = response length, L_max = rollout.max_new_tokens, b = buffer, f = factor:
                   penalty = min(0, -(L - (L_max - b)) / b * f)   (0 up to L_max - b, -f at L_max)
uniform groups     a group of `group_size` consecutive rows whose rewards are all equal
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """The soft overlong penalty of each response length [N] (float64; all 0 when buffer is 0)."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    return (-(lengths - (max_len - buffer)) / buffer * factor).clamp(max=0.0)


def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[N // group_size] bool: the groups whose rewards are all equal (a non-finite reward makes a group
    non-uniform, so the non-finite guard sees it)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"uniform_groups: rewards {tuple(rewards.shape)} do not split into groups of {group_size}"
        )
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)
