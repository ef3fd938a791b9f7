"""Decoupled PPO (asynchronous rollouts): the loss of `rollout_correction` + `ppo_policy_loss`, with the
engine's log-probs as the behaviour policy and the learner's recomputed ones as the proximal policy,
equals AReaL's decoupled objective written out in float64 (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning", the decoupled PPO objective):

    J(theta) = sum_t m_t w_t min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t) / sum_t m_t
    u_t = pi_theta(a_t) / pi_prox(a_t)                  the clipped ratio: target over proximal
    w_t = pi_prox(a_t) / pi_behav(a_t)                  the behaviour importance weight, then
          token-tis: min(w_t, C)                        (verl's token-level truncated IS)
          token-mis: w_t, m_t = 0 where w_t outside [C_low, C]   (AReaL's behav_imp_weight_cap: C_low = 0)
          seq-tis:   min(prod over the row's loss tokens of w_t, C) on every token of the row
    plus the dual clip: for A_t < 0 the term is at least c A_t. The loss is -J; loss and gradient within
    1e-6 of the float64 formula. AReaL divides by every loss token, masked or not; ours by the tokens left:
    the two differ by that ratio exactly, which the test checks too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.rl.correction import rollout_correction
from megatron_gptoss.rl.ppo_loss import loss_denominators, ppo_policy_loss

B, T = 4, 7


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3  # the engine, versions ago
    proximal = behaviour + 0.6 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # the learner now
    target = proximal + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # after some updates
    advantages = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[:, 0] = True
    return target, proximal, behaviour, advantages, mask


def _decoupled_objective(target, proximal, behaviour, adv, mask, cfg: PPOConfig, mode: str):
    """-J(theta) of the module docstring in float64, and the mask of the tokens it keeps."""
    C, low = cfg.correction_threshold, cfg.correction_threshold_low
    u = torch.exp(target - proximal)
    w = torch.exp(proximal - behaviour)
    keep = mask.clone()
    if mode == "token-tis":
        w = torch.clamp(w, max=C)
    elif mode == "token-mis":
        keep = mask & (w >= low) & (w <= C)
    else:  # seq-tis
        row = torch.exp(torch.where(mask, proximal - behaviour, 0.0).sum(1, keepdim=True))
        w = torch.clamp(row, max=C).expand_as(w)
    surrogate = torch.minimum(u * adv, torch.clamp(u, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high) * adv)
    surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.clip_ratio_c * adv), surrogate)
    terms = torch.where(keep, w * surrogate, 0.0)
    return -terms.sum() / keep.sum(), keep, -terms.sum().detach() / mask.sum()


@pytest.mark.parametrize("mode", ["token-tis", "token-mis", "seq-tis"])
def test_decoupled_loss_is_the_formula(mode):
    cfg = dataclasses.replace(
        PPOConfig(), correction_mode=mode, correction_threshold=1.5, correction_threshold_low=0.6
    )
    target, proximal, behaviour, adv, mask = _inputs(seed=3)
    weights, kept, _ = rollout_correction(
        proximal.float(),
        behaviour.float(),
        mask,
        mode,
        cfg.correction_threshold,
        cfg.correction_threshold_low,
    )
    logp = target.float().requires_grad_()
    loss, metrics = ppo_policy_loss(
        logp, proximal.float(), adv.float(), kept, cfg, loss_denominators([kept]), is_weights=weights
    )
    loss.backward()
    ref_logp = target.clone().requires_grad_()
    expected, keep, areal = _decoupled_objective(ref_logp, proximal, behaviour, adv, mask, cfg, mode)
    expected.backward()
    assert torch.equal(kept, keep)
    got, want = float(loss.detach()), float(expected.detach())
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want))
    assert torch.allclose(logp.grad.double(), ref_logp.grad, rtol=1e-5, atol=1e-6)
    assert float(metrics["pg/clipfrac"]) > 0  # the proximal ratio is clipped somewhere: clipping is tested
    if mode == "token-mis":
        assert 0 < int(kept.sum()) < int(mask.sum())  # some tokens were masked
        # AReaL (behav_imp_weight_cap, C_low = 0 there) divides by every loss token
        assert abs(float(loss.detach()) * int(kept.sum()) / int(mask.sum()) - float(areal)) <= 1e-6
    else:
        assert float(weights.max()) == pytest.approx(cfg.correction_threshold)  # truncation engaged
