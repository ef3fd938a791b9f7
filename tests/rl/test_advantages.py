"""GRPO advantages against a float64 per-group loop."""

import math
import statistics

import pytest
import torch

from megatron_gptoss.rl.advantages import broadcast_to_tokens, grpo_advantages


def _reference(rewards, group_size, norm_by_std, eps):
    values = [float(r) for r in rewards]
    out = []
    for g in range(0, len(values), group_size):
        group = values[g : g + group_size]
        mean = math.fsum(group) / len(group)
        std = statistics.stdev(group)
        for r in group:
            out.append((r - mean) / (std + eps) if norm_by_std else r - mean)
    return torch.tensor(out, dtype=torch.float64)


def _rel_err(ours, ref):
    return ((ours.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 5, 8])
def test_grpo_matches_reference(norm_by_std, group_size):
    gen = torch.Generator().manual_seed(100 + group_size)
    rewards = torch.randn(4 * group_size, generator=gen) * 3.0 + 1.0
    adv = grpo_advantages(rewards, group_size, norm_by_std=norm_by_std, eps=1e-6)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32
    assert _rel_err(adv, _reference(rewards, group_size, norm_by_std, 1e-6)) <= 1e-6


def test_grpo_binary_rewards_and_constant_groups():
    # Group 0 all equal (advantage exactly 0), group 1 mixed 0/1 rewards, group 2 all equal.
    rewards = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0])
    adv = grpo_advantages(rewards, 4)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:4], torch.zeros(4)) and torch.equal(adv[8:], torch.zeros(4))
    assert _rel_err(adv, _reference(rewards, 4, True, 1e-6)) <= 1e-6
    # Unbiased std of [0, 1, 0, 0] is 0.5: the correct sample gets 0.75 / 0.5 = 1.5.
    assert abs(adv[5].item() - 0.75 / (0.5 + 1e-6)) <= 1e-6


def test_grpo_no_grad_and_float64_kept():
    rewards = torch.randn(6, dtype=torch.float64, requires_grad=True)
    adv = grpo_advantages(rewards, 3)
    assert adv.dtype == torch.float64 and not adv.requires_grad


def test_grpo_errors():
    with pytest.raises(ValueError, match="N=10 is not divisible by group_size=4"):
        grpo_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)


def test_broadcast_to_tokens():
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(3, generator=gen)
    mask = torch.rand(3, 7, generator=gen) > 0.4
    out = broadcast_to_tokens(adv, mask.float())
    for i in range(3):
        for t in range(7):
            assert out[i, t].item() == (adv[i].item() if mask[i, t] else 0.0)
    with pytest.raises(ValueError, match=r"adv \(4,\) and mask \(3, 7\)"):
        broadcast_to_tokens(torch.zeros(4), mask)
