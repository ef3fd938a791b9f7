"""The KL penalty in the reward (float64 loops), its adaptive controller (verl's AdaptiveKLController formula,
encoded here), the KL loss's k2 and k3 bound through compute_total_loss, and prepare with the penalty."""

import math

import pytest
import torch

from megatron_gptoss.config import AlgorithmConfig, ConfigError, PPOConfig, load_config
from megatron_gptoss.rl.advantages import compute_advantages
from megatron_gptoss.rl.batch import RolloutBatch
from megatron_gptoss.rl.kl_control import KLController, reward_kl_penalty
from megatron_gptoss.rl.learner import prepare_with
from megatron_gptoss.rl.ppo_loss import aggregate, compute_total_loss, kl_penalty, loss_denominators

B, T = 8, 7


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -2.0 * torch.rand(B, T, generator=gen)
    ref = old + 0.7 * torch.randn(B, T, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[3] = 0  # a row without loss tokens
    return old, ref, mask


def _ref_kl(old, ref, estimator, k3_max):
    d = float(ref) - float(old)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    k3 = math.exp(max(min(d, 20.0), -20.0)) - max(min(d, 20.0), -20.0) - 1
    return min(k3, k3_max) if k3_max else k3


@pytest.mark.parametrize("estimator,k3_max", [("k1", 0.0), ("k2", 0.0), ("k3", 0.0), ("k3", 0.3)])
def test_reward_penalty_matches_loop(estimator, k3_max):
    old, ref, mask = _data(1)
    penalty, metrics = reward_kl_penalty(old, ref, mask, 0.05, estimator, k3_max)
    expected = torch.zeros(B, T, dtype=torch.float64)
    per_seq = []
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        for t in toks:
            expected[b, t] = -0.05 * _ref_kl(old[b, t], ref[b, t], estimator, k3_max)
        if toks:
            per_seq.append(
                math.fsum(_ref_kl(old[b, t], ref[b, t], estimator, k3_max) for t in toks) / len(toks)
            )
    assert ((penalty.double() - expected).norm() / expected.norm()).item() <= 1e-6
    assert abs(metrics["kl_reward/kl"] - math.fsum(per_seq) / len(per_seq)) <= 1e-6 * abs(
        metrics["kl_reward/kl"]
    )
    assert metrics["kl_reward/coef"] == 0.05


def _verl_adaptive(value, target, horizon, kls, rows):
    """verl.trainer.ppo.core_algos.AdaptiveKLController.update, step by step."""
    out = []
    for kl in kls:
        err = min(max(kl / target - 1, -0.2), 0.2)
        value *= 1 + err * rows / horizon
        out.append(value)
    return out


def test_adaptive_controller_follows_verl_and_fixed_stays():
    cfg = AlgorithmConfig(kl_in_reward_coef=0.2, kl_ctrl="adaptive", kl_target=0.05, kl_horizon=500)
    ctrl = KLController(cfg)
    kls = [0.2, 0.01, 0.06, 0.04, 0.0, float("nan"), 1.0]
    values = []
    for kl in kls:
        ctrl.update(kl, 64)
        values.append(ctrl.value)
    ref = _verl_adaptive(0.2, 0.05, 500, [k for k in kls if not math.isnan(k)], 64)
    assert values[:5] == pytest.approx(ref[:5], rel=1e-12)
    assert values[5] == values[4] and values[6] == pytest.approx(ref[5], rel=1e-12)  # a NaN KL is ignored
    copy = KLController(cfg)
    copy.load_state_dict(ctrl.state_dict())
    assert copy.value == ctrl.value
    fixed = KLController(AlgorithmConfig(kl_in_reward_coef=0.2))
    fixed.update(5.0, 64)
    assert fixed.value == 0.2


def test_prepare_puts_the_penalty_into_the_advantages():
    old, ref, mask = _data(2)
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(B, generator=gen)
    batch = RolloutBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        targets=torch.zeros(B, T, dtype=torch.long),
        valid=torch.ones(B, T, dtype=torch.bool),
        loss_mask=mask,
        rollout_logprobs=old.clone(),
        rewards=rewards,
    )
    ppo = PPOConfig(correction_mode="none")
    for name in ("grpo", "rloo", "reinforce_pp"):
        algo = AlgorithmConfig(advantage=name, kl_in_reward_coef=0.1, kl_in_reward_estimator="k2")
        prepared, metrics = prepare_with(
            lambda b: old, lambda b: ref, batch, ppo, 4, algo, kl_reward_coef=0.3
        )
        assert metrics["kl_reward/coef"] == 0.3
        kl = 0.5 * (ref - old).square() * mask
        expected = compute_advantages(
            AlgorithmConfig(advantage=name), rewards, mask, 4, token_penalty=-0.3 * kl
        )
        assert torch.allclose(prepared.advantages, expected, rtol=0, atol=1e-6), name
        no_penalty = compute_advantages(AlgorithmConfig(advantage=name), rewards, mask, 4)
        assert not torch.allclose(prepared.advantages, no_penalty, atol=1e-3), name  # the penalty matters
    with pytest.raises(ValueError, match="needs reference log-probs"):
        prepare_with(lambda b: old, None, batch, ppo, 4, AlgorithmConfig(kl_in_reward_coef=0.1))


@pytest.mark.parametrize("estimator,k3_max", [("k2", 0.0), ("k3", 0.2)])
def test_kl_loss_uses_estimator_and_bound(estimator, k3_max):
    old, ref, mask = _data(4)
    lp = old.clone().requires_grad_(True)
    cfg = PPOConfig(kl_coef=0.5, kl_estimator=estimator, kl_k3_max=k3_max)
    denom = loss_denominators([mask])
    loss, metrics = compute_total_loss(lp, old, torch.zeros(B, T), mask, cfg, denom, ref_logprobs=ref)
    expected = aggregate(kl_penalty(old, ref, estimator, k3_max=k3_max), mask, cfg.loss_agg_mode, denom)
    assert abs(float(metrics["loss/kl"]) - float(expected)) <= 1e-6 * abs(float(expected))
    unbounded = aggregate(kl_penalty(old, ref, estimator), mask, cfg.loss_agg_mode, denom)
    if k3_max:
        assert float(expected) < float(unbounded)  # the bound is active on these inputs


def test_config_errors_name_the_field():
    cfg = load_config(None, ["algorithm.kl_in_reward_coef=0.1", "algorithm.kl_ctrl=adaptive"])
    assert cfg.algorithm.kl_ctrl == "adaptive"
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl='adaptive' needs algorithm.kl_in_reward_coef"):
        load_config(None, ["algorithm.kl_ctrl=adaptive"])
    with pytest.raises(ConfigError, match="algorithm.kl_in_reward_estimator='k5'"):
        load_config(None, ["algorithm.kl_in_reward_estimator=k5"])
    with pytest.raises(ConfigError, match="ppo.kl_k3_max"):
        load_config(None, ["ppo.kl_k3_max=-1"])
