"""GSPO (sequence ratio) and GSPO-token against float64 references written from the paper's formulas, verl's
compute_policy_loss_gspo (encoded here) on identical inputs, and the policy-gradient identity on-policy."""

import math

import pytest
import torch

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.config.train import LOSS_AGG_MODES, PPOConfig
from megatron_gptoss.rl.ppo_loss import aggregate, loss_denominators, ppo_policy_loss

B, T, D, V = 6, 8, 5, 11
LENGTHS = [8, 3, 0, 6, 1, 7]


def _mask():
    mask = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    mask[0, 3:5] = 0.0  # a tool span inside a response
    return mask


def _policy(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    w = torch.randn(D, V, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)

    def logprobs(rows=slice(None)):
        return torch.log_softmax(x[rows] @ w, dim=-1).gather(-1, tokens[rows, :, None]).squeeze(-1)

    return w, logprobs


def _inputs(seed, dtype, token_adv=False):
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
    if token_adv:
        adv = adv + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    noise = 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    weights = 0.5 + torch.rand(B, T, generator=gen, dtype=torch.float64)
    return adv.to(dtype), noise.to(dtype), weights.to(dtype)


def _rel_err(ours, ref):
    ours, ref = torch.as_tensor(ours).double(), torch.as_tensor(ref).double()
    return ((ours - ref).norm() / ref.norm()).item()


def _ref_gspo_loss(lp, old, adv, mask, weights, cfg, mode):
    """float64, sequence by sequence: s_i = exp(mean_t (lp - old)), A_i = mean_t A,
    l_i = max(-A_i s_i, -A_i clip(s_i)) on each loss token (times its weight), then the aggregation."""
    n_tok, n_seq = int(mask.sum()), sum(1 for i in range(B) if mask[i].any())
    total = lp.new_zeros(())
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in toks) / len(toks))
        a = math.fsum(float(adv[i, t]) for t in toks) / len(toks)
        low, high = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
        li = torch.maximum(-a * s, -a * s.clamp(low, high))
        per_token = [li * float(weights[i, t]) for t in toks]
        if mode == "token-mean":
            total = total + sum(per_token) / n_tok
        elif mode == "seq-mean-token-sum":
            total = total + sum(per_token) / n_seq
        else:
            total = total + sum(per_token) / len(toks) / n_seq
    return total


def _verl_gspo(old_log_prob, log_prob, advantages, response_mask, cfg, rollout_is_weights):
    """verl.trainer.ppo.core_algos.compute_policy_loss_gspo: the token form, seq-mean-token-mean over the
    batch, log-ratio clamped above at 10."""
    neg_kl = log_prob - old_log_prob
    lengths = response_mask.sum(-1).clamp(min=1)
    seq = (neg_kl * response_mask).sum(-1) / lengths
    log_ratio = (log_prob - log_prob.detach() + seq.detach()[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(
        -advantages * ratio, -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    )
    pg = pg * rollout_is_weights
    per_seq = (pg * response_mask).sum(-1) / lengths
    has = response_mask.sum(-1) > 0
    return per_seq[has].sum() / has.sum()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_gspo_matches_formula(mode, dtype, tol):
    cfg = PPOConfig(policy_loss="gspo", loss_agg_mode=mode, clip_ratio_low=0.01, clip_ratio_high=0.015)
    mask = _mask()
    adv, noise, weights = _inputs(1, dtype, token_adv=True)
    w, logprobs = _policy(2, dtype)
    with torch.no_grad():
        old = logprobs() + noise
    loss, metrics = ppo_policy_loss(logprobs(), old, adv, mask, cfg, loss_denominators([mask]), weights)
    (grad,) = torch.autograd.grad(loss, w)
    w64, logprobs64 = _policy(2, torch.float64)
    ref = _ref_gspo_loss(logprobs64(), old.double(), adv.double(), mask, weights.double(), cfg, mode)
    (ref_grad,) = torch.autograd.grad(ref, w64)
    assert _rel_err(loss.detach(), ref.detach()) <= tol and _rel_err(grad, ref_grad) <= tol
    assert 0 < metrics["pg/clipfrac"] < 1  # some sequences clipped, some not: both branches tested


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_token_equals_gspo_with_sequence_advantages(mode):
    mask = _mask()
    adv, noise, weights = _inputs(3, torch.float64)
    results = []
    for name in ("gspo", "gspo_token"):
        cfg = PPOConfig(policy_loss=name, loss_agg_mode=mode, clip_ratio_low=0.01, clip_ratio_high=0.015)
        w, logprobs = _policy(4, torch.float64)
        with torch.no_grad():
            old = logprobs() + noise
        seq_weights = weights[:, :1].expand(B, T)  # a sequence-level correction weight
        denom = loss_denominators([mask])
        loss, metrics = ppo_policy_loss(logprobs(), old, adv, mask, cfg, denom, seq_weights)
        results.append((loss.detach(), torch.autograd.grad(loss, w)[0], metrics))
    (loss_a, grad_a, met_a), (loss_b, grad_b, met_b) = results
    assert _rel_err(loss_b, loss_a) <= 1e-12 and _rel_err(grad_b, grad_a) <= 1e-12
    for key in ("pg/clipfrac", "pg/ratio_mean", "pg/ratio_max", "pg/ratio_min"):
        assert abs(float(met_a[key]) - float(met_b[key])) <= 1e-6, key


def test_gspo_token_equals_verl():
    cfg = PPOConfig(policy_loss="gspo_token", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.01)
    mask = _mask()
    adv, noise, weights = _inputs(5, torch.float64, token_adv=True)
    w, logprobs = _policy(6, torch.float64)
    with torch.no_grad():
        old = logprobs() + noise
    ours, _ = ppo_policy_loss(logprobs(), old, adv, mask, cfg, loss_denominators([mask]), weights)
    (grad,) = torch.autograd.grad(ours, w)
    verl = _verl_gspo(old, logprobs(), adv, mask.double(), cfg, weights)
    (verl_grad,) = torch.autograd.grad(verl, w)
    assert _rel_err(ours.detach(), verl.detach()) <= 1e-12 and _rel_err(grad, verl_grad) <= 1e-12


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_on_policy_gradient_is_the_policy_gradient(name, mode):
    """On-policy s = 1 and the gradient is that of aggregate(-A log pi): for seq-mean-token-mean,
    -1/S sum_i A_i / n_i sum_t grad log pi_t (the policy-gradient identity), written out in float64."""
    cfg = PPOConfig(policy_loss=name, loss_agg_mode=mode)
    mask = _mask()
    adv = _inputs(7, torch.float64)[0]
    w, logprobs = _policy(8, torch.float64)
    lp = logprobs()
    loss, metrics = ppo_policy_loss(lp, lp.detach(), adv, mask, cfg, loss_denominators([mask]))
    assert metrics["pg/ratio_max"] == 1.0 and metrics["pg/ratio_min"] == 1.0 and metrics["pg/clipfrac"] == 0
    (grad,) = torch.autograd.grad(loss, w)
    denom = loss_denominators([mask])
    (reinforce,) = torch.autograd.grad(aggregate(-adv * logprobs(), mask, mode, denom), w)
    assert _rel_err(grad, reinforce) <= 1e-12
    if mode == "seq-mean-token-mean":
        seqs = [i for i in range(B) if mask[i].any()]
        expected = torch.zeros_like(w)
        for i in seqs:
            toks = [t for t in range(T) if mask[i, t]]
            for t in toks:
                (g,) = torch.autograd.grad(logprobs()[i, t], w)
                expected -= float(adv[i, t]) / len(toks) / len(seqs) * g
        assert _rel_err(grad, expected) <= 1e-12


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_micro_batches_sum_and_masked_garbage(name):
    """Sequences are whole in each micro-batch: the micro-batch losses sum to the batch loss; inf / nan
    log-probs at masked positions reach neither the loss nor the gradient."""
    cfg = PPOConfig(policy_loss=name, loss_agg_mode="token-mean", clip_ratio_low=0.01, clip_ratio_high=0.01)
    mask = _mask()
    adv, noise, weights = _inputs(9, torch.float64, token_adv=True)
    w, logprobs = _policy(10, torch.float64)
    with torch.no_grad():
        old = logprobs() + noise
    denom = loss_denominators([mask])
    whole, _ = ppo_policy_loss(logprobs(), old, adv, mask, cfg, denom, weights)
    (grad_whole,) = torch.autograd.grad(whole, w)
    total, grad_sum = 0.0, torch.zeros_like(w)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        garbage = torch.where(mask[rows].bool(), 0.0, float("nan"))
        lp = logprobs(rows) + garbage
        part, _ = ppo_policy_loss(lp, old[rows], adv[rows], mask[rows], cfg, denom, weights[rows])
        total += float(part.detach())
        grad_sum += torch.autograd.grad(part, w)[0]
    assert math.isfinite(total) and torch.isfinite(grad_sum).all()
    assert _rel_err(torch.tensor(total, dtype=torch.float64), whole.detach()) <= 1e-12
    assert _rel_err(grad_sum, grad_whole) <= 1e-12


def test_policy_loss_config():
    assert load_config(None, ["ppo.policy_loss=gspo"]).ppo.policy_loss == "gspo"
    with pytest.raises(ConfigError, match="ppo.policy_loss='grpo'"):
        load_config(None, ["ppo.policy_loss=grpo"])
    mask = _mask()
    with pytest.raises(ValueError, match="unknown policy loss 'gspo2'"):
        z = torch.zeros(B, T)
        ppo_policy_loss(z, z, z, mask, PPOConfig(policy_loss="gspo2"), loss_denominators([mask]))
