"""Advantage estimators (Dr. GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, GAE) against float64
references written from their formulas, element by element in Python, and against verl's definitions
(verl.trainer.ppo.core_algos, encoded here independently of our code) on identical inputs."""

import math

import pytest
import torch

from megatron_gptoss.config import AlgorithmConfig, ConfigError, load_config
from megatron_gptoss.rl.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    masked_whiten,
    rloo_advantages,
    token_rewards,
)


def _rel_err(ours, ref):
    ref = torch.as_tensor(ref, dtype=torch.float64)
    return ((ours.double() - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def _batch(seed, rows=8, width=12, holes=False):
    """rewards [B], values [B, T] and a loss mask: a prompt of 1-3 tokens, a response of 1..width-3
    tokens, padding; `holes` zeroes a few response tokens inside (tool output)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for b in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=gen))
        length = int(torch.randint(1, width - start, (1,), generator=gen))
        mask[b, start : start + length] = 1
        if holes and length > 3:
            mask[b, start + 1 : start + 3] = 0
    rewards = torch.randn(rows, generator=gen, dtype=torch.float64)
    values = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    return rewards, values, mask


def _loss_tokens(mask_row):
    return [t for t in range(len(mask_row)) if mask_row[t] > 0]


# ---------------------------------------------------------------------------------------------------
# references from the formulas (python floats, float64)
def _ref_gae(rewards, values, mask, gamma, lam):
    adv = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b in range(mask.shape[0]):
        steps = _loss_tokens(mask[b])
        following_adv, following_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * following_value - float(values[b, t])
            adv[b][t] = delta + gamma * lam * following_adv
            following_adv, following_value = adv[b][t], float(values[b, t])
    return adv


def _ref_whiten(x, mask):
    xs = [float(x[b, t]) for b in range(mask.shape[0]) for t in _loss_tokens(mask[b])]
    mean = math.fsum(xs) / len(xs)
    var = math.fsum((v - mean) ** 2 for v in xs) / (len(xs) - 1)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in _loss_tokens(mask[b]):
            out[b, t] = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8)
    return out


# verl's definitions, re-encoded: compute_gae_advantage_return (advantages whitened by masked_whiten, returns
# = raw advantages + values), compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
# compute_reinforce_plus_plus_baseline_outcome_advantage. Inputs: token_level_rewards and response_mask of
# the response (a contiguous mask here, where verl's and ours coincide).
def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, rev = 0.0, 0.0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    advantages = torch.stack(rev[::-1], dim=1)
    return _verl_whiten(advantages, response_mask), advantages + values


def _verl_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i].item())
    for i, g in enumerate(index):
        n, mean = len(groups[g]), sum(groups[g]) / len(groups[g])
        scores[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return scores[:, None] * response_mask


def _verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running = 0.0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return _verl_whiten(returns, response_mask) * response_mask


def _verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i].item())
    for i, g in enumerate(index):
        scores[i] = scores[i] - sum(groups[g]) / len(groups[g])
    tiled = scores[:, None].tile([1, response_mask.shape[1]]) * response_mask
    return _verl_whiten(tiled, response_mask) * response_mask


def _response_view(rewards, mask):
    """verl's layout of our rows: the response only (from the first loss token), reward on the last."""
    rows, width = mask.shape
    starts = [_loss_tokens(mask[b])[0] for b in range(rows)]
    resp_mask = torch.zeros(rows, width, dtype=torch.float64)
    for b, s in enumerate(starts):
        resp_mask[b, : width - s] = mask[b, s:].double()
    return starts, token_rewards(rewards, resp_mask), resp_mask


def _to_response(x, starts):
    out = torch.zeros_like(x)
    for b, s in enumerate(starts):
        out[b, : x.shape[1] - s] = x[b, s:]
    return out


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo_and_dr_grpo_match_formulas(group_size):
    rewards = torch.randn(4 * group_size, generator=torch.Generator().manual_seed(group_size)).double()
    mask = torch.ones(len(rewards), 3)
    rloo = rloo_advantages(rewards, group_size)
    ref = []
    for i in range(len(rewards)):
        first = i - i % group_size
        others = [float(rewards[j]) for j in range(first, first + group_size) if j != i]
        ref.append(float(rewards[i]) - math.fsum(others) / (group_size - 1))
    assert rloo.dtype == torch.float64 and _rel_err(rloo, ref) <= 1e-12
    rloo_cfg = compute_advantages(AlgorithmConfig(advantage="rloo"), rewards, mask, group_size)
    assert _rel_err(rloo_cfg, ref) <= 1e-12
    dr = compute_advantages(AlgorithmConfig(advantage="dr_grpo"), rewards, mask, group_size)
    starts = range(0, len(rewards), group_size)
    means = [math.fsum(rewards[g : g + group_size].tolist()) / group_size for g in starts]
    ref_dr = [float(rewards[i]) - means[i // group_size] for i in range(len(rewards))]
    assert _rel_err(dr, ref_dr) <= 1e-12
    index = [i // group_size for i in range(len(rewards))]
    verl = _verl_rloo(token_rewards(rewards, mask), mask.double(), index)
    assert _rel_err(rloo[:, None] * mask, verl) <= 1e-12


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_formula(gamma, lam, holes):
    rewards, values, mask = _batch(1, holes=holes)
    dense = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    adv, ret = gae(dense, values, mask, gamma, lam)
    ref = torch.tensor(_ref_gae(dense, values, mask, gamma, lam), dtype=torch.float64)
    assert _rel_err(adv, ref) <= 1e-12
    assert _rel_err(ret, torch.where(mask.bool(), ref + values, 0.0)) <= 1e-12
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_hand_computed_trajectory():
    # one row: prompt, three policy tokens, a tool token (skipped), one policy token; reward 1 at the end
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 7.0, 0.75, 9.0]], dtype=torch.float64)
    rewards = token_rewards(torch.tensor([1.0], dtype=torch.float64), mask)
    gamma, lam = 0.5, 0.5
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # t=4: delta = 1 - 0.75 = 0.25, A = 0.25
    # t=2: delta = 0 + 0.5 * 0.75 - 0.25 = 0.125, A = 0.125 + 0.25 * 0.25 = 0.1875 (t=3 is a tool token)
    # t=1: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375, A = -0.375 + 0.25 * 0.1875 = -0.328125
    assert adv.tolist() == [[0.0, -0.328125, 0.1875, 0.0, 0.25, 0.0]]
    assert ret.tolist() == [[0.0, 0.171875, 0.4375, 0.0, 1.0, 0.0]]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9)])
def test_gae_equals_verl(gamma, lam):
    rewards, values, mask = _batch(2)
    starts, verl_rewards, resp_mask = _response_view(rewards, mask)
    resp_values = _to_response(values, starts)
    verl_adv, verl_ret = _verl_gae(verl_rewards, resp_values, resp_mask, gamma, lam)
    adv, ret = gae(token_rewards(rewards, mask), values, mask, gamma, lam)
    whitened = masked_whiten(adv, mask)
    # verl's masked mean divides by (count + 1e-8): a relative difference of about 1e-9 / count
    assert _rel_err(_to_response(whitened, starts) * resp_mask, verl_adv * resp_mask) <= 1e-8
    assert _rel_err(_to_response(ret, starts) * resp_mask, verl_ret * resp_mask) <= 1e-12


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_formula_and_verl(gamma):
    rewards, _, mask = _batch(3, holes=True)
    adv = compute_advantages(AlgorithmConfig(advantage="reinforce_pp", gamma=gamma), rewards, mask, 2)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        steps = _loss_tokens(mask[b])
        for k, t in enumerate(steps):  # G_t = gamma^(policy tokens after t) * reward
            returns[b, t] = gamma ** (len(steps) - 1 - k) * float(rewards[b])
    assert _rel_err(adv, _ref_whiten(returns, mask)) <= 1e-9
    # verl on contiguous masks
    rewards, _, mask = _batch(4)
    ours = compute_advantages(AlgorithmConfig(advantage="reinforce_pp", gamma=gamma), rewards, mask, 2)
    starts, verl_rewards, resp_mask = _response_view(rewards, mask)
    verl = _verl_reinforce_pp(verl_rewards, resp_mask, gamma)
    assert _rel_err(_to_response(ours, starts), verl) <= 1e-8  # verl's count + 1e-8


def test_reinforce_pp_baseline_matches_formula_and_verl():
    rewards, _, mask = _batch(6)
    ours = compute_advantages(AlgorithmConfig(advantage="reinforce_pp_baseline"), rewards, mask, 4)
    centered = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        g = b // 4 * 4
        mean = math.fsum(rewards[g : g + 4].tolist()) / 4
        for t in _loss_tokens(mask[b]):
            centered[b, t] = float(rewards[b]) - mean
    assert _rel_err(ours, _ref_whiten(centered, mask)) <= 1e-9
    starts, verl_rewards, resp_mask = _response_view(rewards, mask)
    verl = _verl_reinforce_pp_baseline(verl_rewards, resp_mask, [b // 4 for b in range(mask.shape[0])])
    assert _rel_err(_to_response(ours, starts), verl) <= 1e-8  # verl's count + 1e-8


def test_token_penalty_enters_every_estimator():
    rewards, _, mask = _batch(7)
    penalty = -0.1 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sums = rewards + (penalty * mask).sum(1)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        cfg = AlgorithmConfig(advantage=name)
        with_penalty = compute_advantages(cfg, rewards, mask, 4, token_penalty=penalty)
        assert _rel_err(with_penalty, compute_advantages(cfg, sums, mask, 4)) <= 1e-12, name
    cfg = AlgorithmConfig(advantage="reinforce_pp", gamma=1.0)
    dense = token_rewards(rewards, mask) + penalty * mask
    ref = _ref_whiten(discounted_returns(dense, mask, 1.0), mask)
    assert _rel_err(compute_advantages(cfg, rewards, mask, 4, token_penalty=penalty), ref) <= 1e-12


def test_uniform_rewards_give_finite_zero_advantages():
    rewards = torch.ones(8)
    mask = torch.ones(8, 4)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = compute_advantages(AlgorithmConfig(advantage=name), rewards, mask, 4)
        assert torch.all(adv == 0), name
    one = torch.zeros(1, 4)
    one[0, 2] = 1
    assert masked_whiten(torch.full((1, 4), 3.0), one).tolist() == [[0.0] * 4]


def test_token_rewards_and_errors():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 4, 0]]
    with pytest.raises(ValueError, match="rewards \\[B\\] and mask"):
        token_rewards(torch.zeros(2), mask)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        rloo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="gae: expected"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_config_names_the_field():
    assert load_config(None, ["algorithm.advantage=rloo"]).algorithm.advantage == "rloo"
    with pytest.raises(ConfigError, match="algorithm.advantage='ppo'"):
        load_config(None, ["algorithm.advantage=ppo"])
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        load_config(None, ["algorithm.gamma=1.5"])
