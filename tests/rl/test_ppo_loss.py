"""PPO loss against float64 per-token loops; accumulation, on-policy and clipping properties."""

import math
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_gptoss.config.train import LOSS_AGG_MODES, PPOConfig
from megatron_gptoss.rl.ppo_loss import (
    LossNormalizer,
    aggregate,
    compute_total_loss,
    entropy_bonus,
    kl_penalty,
    loss_denominators,
    ppo_policy_loss,
)

B, T, D, V = 6, 9, 5, 11
# Loss tokens per sequence (prefix then tool span then suffix), one empty sequence.
LENGTHS = [9, 3, 0, 6, 1, 7]


def _mask(tool_span=True):
    mask = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    if tool_span:
        mask[0, 3:5] = 0.0  # tokens written by a tool inside a response
        mask[5, 2] = 0.0
    return mask


class TinyPolicy:
    """log_softmax of a linear map: logits = x @ W; the log-prob of the sampled tokens."""

    def __init__(self, seed, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(B, T, D, generator=gen, dtype=dtype)
        self.tokens = torch.randint(0, V, (B, T), generator=gen)
        self.w = torch.randn(D, V, generator=gen, dtype=dtype).requires_grad_(True)

    def logprobs(self, rows=slice(None), cols=slice(None), w=None):
        w = self.w if w is None else w
        logp = torch.log_softmax(self.x[rows, cols].to(w.dtype) @ w, dim=-1)
        return logp.gather(-1, self.tokens[rows, cols, None]).squeeze(-1), logp


def _entropy(full_logp):
    return -(full_logp.exp() * full_logp).sum(-1)


def _ref_aggregate(values, mask, mode, n_tokens, n_seqs):
    """float64 loop: the mini-batch share of one micro-batch."""
    total = 0.0
    for i in range(values.shape[0]):
        toks = [float(values[i, t]) for t in range(values.shape[1]) if mask[i, t]]
        if mode == "token-mean":
            total += math.fsum(toks) / n_tokens
        elif mode == "seq-mean-token-sum":
            total += math.fsum(toks) / n_seqs
        elif toks:
            total += math.fsum(toks) / len(toks) / n_seqs
    return total


def _ref_token_pg(lp, old, a, cfg, w=1.0):
    """float64 per-token PPO loss with the clip branch and dual-clip flags."""
    r = math.exp(min(max(lp - old, -20.0), 20.0))
    loss = max(-a * r, -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high))
    clipped = (a > 0 and r > 1 + cfg.clip_ratio_high) or (a < 0 and r < 1 - cfg.clip_ratio_low)
    dual = bool(cfg.clip_ratio_c) and a < 0 and loss > -a * cfg.clip_ratio_c
    if dual:
        loss = -a * cfg.clip_ratio_c
    return loss * w, clipped, dual


def _ref_pg_tensor(lp, old, adv, cfg, weights=None):
    out = torch.zeros(lp.shape, dtype=torch.float64)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            w = 1.0 if weights is None else float(weights[i, t])
            out[i, t] = _ref_token_pg(float(lp[i, t]), float(old[i, t]), float(adv[i, t]), cfg, w)[0]
    return out


def _rel_err(ours, ref):
    ours, ref = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return ((ours - ref).norm() / ref.norm()).item()


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    adv_seq = torch.randn(B, generator=gen)
    adv = adv_seq[:, None].expand(B, T).clone()
    noise = 0.3 * torch.randn(B, T, generator=gen)
    ref_noise = 0.5 * torch.randn(B, T, generator=gen)
    is_w = 0.5 + torch.rand(B, T, generator=gen)
    return adv, noise, ref_noise, is_w


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_reference(mode):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(B, T, generator=gen)
    mask = _mask()
    denom = loss_denominators([mask])
    ours = aggregate(values, mask, mode, denom)
    ref = _ref_aggregate(values, mask, mode, int(mask.sum()), sum(1 for n in LENGTHS if n))
    assert abs(ours.item() - ref) <= 1e-6 * abs(ref)


def test_loss_denominators_counts():
    mask = _mask()
    denom = loss_denominators([mask[:2], mask[2:4].bool(), mask[4:, :5]])
    loss_tokens = sum(int(mask[i, t]) for i in range(B) for t in range(5 if i >= 4 else T))
    assert denom == LossNormalizer(tokens=loss_tokens, seqs=5)  # the empty sequence is not counted
    with pytest.raises(ValueError, match="masks is empty"):
        loss_denominators([])
    with pytest.raises(ValueError, match=r"masks\[1\] must be 2-D"):
        loss_denominators([mask, mask[0]])


def test_loss_denominators_all_reduce_over_two_ranks():
    """Two gloo ranks (threads sharing a store) each hold half of the micro-batches."""
    mask = _mask()
    per_rank = {0: [mask[:2], mask[2:3]], 1: [mask[3:5], mask[5:]]}
    store = dist.HashStore()
    results, errors = {}, []

    def rank_fn(rank):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("denominators", store), rank, 2)
            results[rank] = loss_denominators(per_rank[rank], dp_group=group)
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=20)
    assert not errors and all(not th.is_alive() for th in threads)
    expected = LossNormalizer(tokens=int(mask.sum().item()), seqs=sum(1 for n in LENGTHS if n))
    assert results == {0: expected, 1: expected}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_equal_one_batch(mode):
    """3 micro-batches (each trimmed to its own length) summed == the batch of 6 as one."""
    cfg = PPOConfig(loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01, kl_estimator="k3")
    policy = TinyPolicy(seed=11)
    adv, noise, ref_noise, is_w = _inputs(seed=12)
    mask = _mask()
    with torch.no_grad():
        old = policy.logprobs()[0] + noise
    ref_lp = old + ref_noise

    denom = loss_denominators([mask])
    lp, full = policy.logprobs()
    loss_one, metrics = compute_total_loss(
        lp, old, adv, mask, cfg, denom, ref_logprobs=ref_lp, entropy=_entropy(full), is_weights=is_w
    )
    loss_one.backward()
    grad_one = policy.w.grad.clone()
    policy.w.grad = None
    assert metrics["pg/clipfrac"] > 0  # off-policy enough for the clip to matter

    chunks = []
    for k in range(3):
        rows = slice(2 * k, 2 * k + 2)
        length = max(1, int(mask[rows].nonzero()[:, 1].max()) + 1)
        chunks.append((rows, slice(0, length)))
    denom_mb = loss_denominators([mask[r, c] for r, c in chunks])
    assert denom_mb == denom
    loss_sum = 0.0
    for rows, cols in chunks:
        lp_mb, full_mb = policy.logprobs(rows, cols)
        loss_mb, _ = compute_total_loss(
            lp_mb,
            old[rows, cols],
            adv[rows, cols],
            mask[rows, cols],
            cfg,
            denom_mb,
            ref_logprobs=ref_lp[rows, cols],
            entropy=_entropy(full_mb),
            is_weights=is_w[rows, cols],
        )
        loss_mb.backward()
        loss_sum = loss_sum + loss_mb.detach()
    assert _rel_err(loss_sum, loss_one.detach()) <= 1e-6
    assert _rel_err(policy.w.grad, grad_one) <= 1e-6

    # The whole composition against float64 loops.
    n_tok, n_seq = int(mask.sum()), sum(1 for n in LENGTHS if n)
    with torch.no_grad():
        lp64, full64 = policy.logprobs(w=policy.w.double())
    old64, ref64 = old.double(), ref_lp.double()
    pg = _ref_pg_tensor(lp64, old64, adv.double(), cfg, is_w)
    d = ref64 - lp64
    k3 = torch.exp(d) - d - 1
    ref_total = (
        _ref_aggregate(pg, mask, mode, n_tok, n_seq)
        + cfg.kl_coef * _ref_aggregate(k3, mask, mode, n_tok, n_seq)
        - cfg.entropy_coef * _ref_aggregate(_entropy(full64), mask, mode, n_tok, n_seq)
    )
    assert _rel_err(loss_one.detach(), ref_total) <= 1e-6


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_on_policy_ratio_one_and_reinforce_gradient(mode):
    cfg = PPOConfig(loss_agg_mode=mode)
    policy = TinyPolicy(seed=21)
    adv = _inputs(seed=22)[0]
    mask = _mask()
    denom = loss_denominators([mask])

    lp = policy.logprobs()[0]
    loss, metrics = ppo_policy_loss(lp, lp.detach(), adv, mask, cfg, denom)
    assert metrics["pg/ratio_max"].item() == 1.0 and metrics["pg/ratio_min"].item() == 1.0
    assert metrics["pg/ratio_mean"].item() == 1.0
    assert metrics["pg/clipfrac"].item() == 0.0 and metrics["pg/dual_clipfrac"].item() == 0.0
    assert metrics["pg/approx_kl_k1"].item() == 0.0 and metrics["pg/approx_kl_k3"].item() == 0.0
    (grad_ppo,) = torch.autograd.grad(loss, policy.w)

    # REINFORCE through the same aggregation: identical bit for bit.
    lp = policy.logprobs()[0]
    (grad_reinforce,) = torch.autograd.grad(aggregate(-adv * lp, mask, mode, denom), policy.w)
    assert torch.equal(grad_ppo, grad_reinforce)

    # REINFORCE written independently in float64.
    w64 = policy.w.detach().double().requires_grad_(True)
    lp64 = policy.logprobs(w=w64)[0]
    n_tok, n_seq = int(mask.sum()), sum(1 for n in LENGTHS if n)
    ref = 0.0
    for i in range(B):
        toks = [-adv[i, t].double() * lp64[i, t] for t in range(T) if mask[i, t]]
        if not toks:
            continue
        s = torch.stack(toks).sum()
        ref = ref + {"token-mean": s / n_tok, "seq-mean-token-sum": s / n_seq}.get(
            mode, s / len(toks) / n_seq
        )
    (grad_ref,) = torch.autograd.grad(ref, w64)
    assert _rel_err(grad_ppo, grad_ref) <= 1e-6


def _leaf_logprobs(seed):
    gen = torch.Generator().manual_seed(seed)
    return (-3.0 * torch.rand(B, T, generator=gen)).requires_grad_(True), gen


def test_off_policy_clipping_engages():
    cfg = PPOConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=0.0)
    lp, gen = _leaf_logprobs(31)
    adv = torch.randn(B, T, generator=gen)
    # Log-ratios of +-0.5 (ratio 1.65 / 0.61, both outside [0.8, 1.28]) or small (inside).
    choice = torch.randint(0, 3, (B, T), generator=gen)
    log_ratio = torch.tensor([0.5, -0.5, 0.05])[choice]
    old = lp.detach() - log_ratio
    mask = _mask()
    denom = loss_denominators([mask])
    loss, metrics = ppo_policy_loss(lp, old, adv, mask, cfg, denom)
    loss.backward()
    grad, lp = lp.grad, lp.detach()

    flags = [
        _ref_token_pg(float(lp[i, t]), float(old[i, t]), float(adv[i, t]), cfg)[1]
        for i in range(B)
        for t in range(T)
        if mask[i, t]
    ]
    assert 0 < sum(flags) < len(flags)
    assert abs(metrics["pg/clipfrac"].item() - sum(flags) / len(flags)) <= 1e-6
    ref = _ref_aggregate(_ref_pg_tensor(lp, old, adv, cfg), mask, cfg.loss_agg_mode, len(flags), 5)
    assert _rel_err(loss.detach(), ref) <= 1e-6
    for i in range(B):
        for t in range(T):
            clipped = (
                bool(mask[i, t])
                and _ref_token_pg(float(lp[i, t]), float(old[i, t]), float(adv[i, t]), cfg)[1]
            )
            if clipped or not mask[i, t]:
                assert grad[i, t].item() == 0.0
            else:
                expected = -float(adv[i, t]) * math.exp(float(lp[i, t]) - float(old[i, t])) / len(flags)
                assert abs(grad[i, t].item() - expected) <= 1e-6 * abs(expected)
    assert metrics["pg/ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["pg/ratio_min"].item() == pytest.approx(math.exp(-0.5), rel=1e-6)


def test_dual_clip_caps_negative_advantages():
    lp, gen = _leaf_logprobs(41)
    adv = -(0.5 + torch.rand(B, T, generator=gen))  # all advantages negative
    adv[1] = -adv[1]  # one positive sequence
    log_ratio = torch.where(torch.rand(B, T, generator=gen) < 0.5, 1.5, 0.6)  # ratios 4.48 or 1.82
    old = lp.detach() - log_ratio
    mask = _mask()
    denom = loss_denominators([mask])
    cfg = PPOConfig(clip_ratio_c=3.0)
    loss, metrics = ppo_policy_loss(lp, old, adv, mask, cfg, denom)
    loss.backward()

    capped = (mask > 0) & (adv < 0) & (log_ratio == 1.5)
    assert capped.any()
    assert abs(metrics["pg/dual_clipfrac"].item() - capped.sum().item() / mask.sum().item()) <= 1e-6
    assert torch.all(lp.grad[capped] == 0.0)
    uncapped_neg = (mask > 0) & (adv < 0) & (log_ratio == 0.6)
    assert torch.all(lp.grad[uncapped_neg] != 0.0)
    ref = _ref_aggregate(_ref_pg_tensor(lp.detach(), old, adv, cfg), mask, "token-mean", int(mask.sum()), 5)
    assert _rel_err(loss.detach(), ref) <= 1e-6
    # Only the capped tokens: each contributes c * |A|, less than |A| * ratio without dual clip.
    only = capped.float()
    capped_loss, _ = ppo_policy_loss(lp, old, adv, only, cfg, loss_denominators([only]))
    expected = (3.0 * adv.abs() * only).sum() / only.sum()
    assert _rel_err(capped_loss.detach(), expected) <= 1e-6
    uncapped_loss, m = ppo_policy_loss(
        lp, old, adv, only, PPOConfig(clip_ratio_c=0.0), loss_denominators([only])
    )
    assert uncapped_loss.item() > capped_loss.item() and m["pg/dual_clipfrac"].item() == 0.0


def test_log_ratio_bound():
    """Log-ratios beyond +-20 are clamped: the ratio stays e^20 and that token gets no gradient."""
    lp = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[-30.0, -0.1, 0.1]])
    adv = -torch.ones(1, 3)
    mask = torch.ones(1, 3)
    loss, metrics = ppo_policy_loss(
        lp, old, adv, mask, PPOConfig(clip_ratio_c=0.0), loss_denominators([mask])
    )
    loss.backward()
    expected = (math.exp(20.0) + math.exp(0.1) + math.exp(-0.1)) / 3
    assert abs(loss.item() - expected) <= 1e-6 * expected
    assert metrics["pg/ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() != 0.0


def test_is_weights_scale_tokens_and_stay_detached():
    lp, gen = _leaf_logprobs(51)
    adv = torch.randn(B, T, generator=gen)
    old = lp.detach() + 0.1 * torch.randn(B, T, generator=gen)
    weights = (0.2 + torch.rand(B, T, generator=gen)).requires_grad_(True)
    mask = _mask()
    cfg = PPOConfig(loss_agg_mode="seq-mean-token-mean")
    loss, _ = ppo_policy_loss(lp, old, adv, mask, cfg, loss_denominators([mask]), is_weights=weights)
    loss.backward()
    assert weights.grad is None
    ref = _ref_aggregate(
        _ref_pg_tensor(lp.detach(), old, adv, cfg, weights.detach()), mask, cfg.loss_agg_mode, 0, 5
    )
    assert _rel_err(loss.detach(), ref) <= 1e-6


def test_masked_positions_never_reach_loss_or_gradient():
    lp, gen = _leaf_logprobs(61)
    adv = torch.randn(B, T, generator=gen)
    old = lp.detach() + 0.2 * torch.randn(B, T, generator=gen)
    mask = _mask()
    cfg = PPOConfig(kl_coef=0.2, entropy_coef=0.1)
    denom = loss_denominators([mask])
    ent = torch.rand(B, T, generator=gen)
    loss, metrics = compute_total_loss(lp, old, adv, mask, cfg, denom, ref_logprobs=old - 0.3, entropy=ent)
    (grad,) = torch.autograd.grad(loss, lp)

    off = mask == 0
    lp_bad = lp.detach().masked_fill(off, float("-inf")).requires_grad_(True)
    old_bad, adv_bad = old.masked_fill(off, float("nan")), adv.masked_fill(off, 1e30)
    ent_bad, ref_bad = ent.masked_fill(off, float("inf")), (old - 0.3).masked_fill(off, 1e4)
    loss_bad, metrics_bad = compute_total_loss(
        lp_bad, old_bad, adv_bad, mask, cfg, denom, ref_logprobs=ref_bad, entropy=ent_bad
    )
    (grad_bad,) = torch.autograd.grad(loss_bad, lp_bad)
    assert torch.equal(loss, loss_bad) and torch.equal(grad, grad_bad)
    assert all(torch.equal(metrics[k], metrics_bad[k]) for k in metrics)


@pytest.mark.parametrize("estimator,k3_max", [("k1", 0.0), ("k2", 0.0), ("k3", 0.0), ("k3", 1.5)])
def test_kl_penalty_matches_reference(estimator, k3_max):
    gen = torch.Generator().manual_seed(71)
    lp = -3.0 * torch.rand(B, T, generator=gen)
    ref_lp = lp + torch.randn(B, T, generator=gen)
    ref_lp[0, 0] = lp[0, 0] + 50.0  # beyond the documented log-ratio bound of 20
    lp.requires_grad_(True)
    ours = kl_penalty(lp, ref_lp, estimator, k3_max=k3_max)
    (grad,) = torch.autograd.grad(ours.sum(), lp)
    expected = torch.zeros(B, T, dtype=torch.float64)
    expected_grad = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            d = float(ref_lp[i, t]) - float(lp[i, t].detach())
            if estimator == "k1":
                expected[i, t], expected_grad[i, t] = -d, 1.0
            elif estimator == "k2":
                expected[i, t], expected_grad[i, t] = 0.5 * d * d, -d
            else:
                inside = -20.0 <= d <= 20.0
                d = min(max(d, -20.0), 20.0)
                expected[i, t] = math.exp(d) - d - 1.0
                expected_grad[i, t] = (1.0 - math.exp(d)) if inside else 0.0
                if k3_max and expected[i, t] > k3_max:
                    expected[i, t], expected_grad[i, t] = k3_max, 0.0
    assert torch.isfinite(ours).all()
    assert _rel_err(ours, expected) <= 1e-6 and _rel_err(grad, expected_grad) <= 1e-6
    if estimator != "k1":
        assert (ours >= 0).all()
    if k3_max:
        assert ours.max().item() == k3_max and (expected > k3_max - 1e-9).sum() >= 2  # the clamp bit


def test_entropy_bonus_is_aggregate():
    gen = torch.Generator().manual_seed(81)
    ent = torch.rand(B, T, generator=gen)
    mask = _mask()
    denom = loss_denominators([mask])
    ref = _ref_aggregate(ent, mask, "seq-mean-token-mean", 0, 5)
    assert abs(entropy_bonus(ent, mask, "seq-mean-token-mean", denom).item() - ref) <= 1e-6 * ref


def test_bad_inputs_raise_clear_errors():
    mask = _mask()
    denom = loss_denominators([mask])
    x = torch.zeros(B, T)
    with pytest.raises(ValueError, match=r"old_logprobs \(6, 8\)"):
        ppo_policy_loss(x, torch.zeros(B, 8), x, mask, PPOConfig(), denom)
    with pytest.raises(ValueError, match=r"is_weights \(6,\)"):
        ppo_policy_loss(x, x, x, mask, PPOConfig(), denom, is_weights=torch.ones(B))
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'seq-sum'"):
        aggregate(x, mask, "seq-sum", denom)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'token-sum'"):
        ppo_policy_loss(x, x, x, mask, PPOConfig(loss_agg_mode="token-sum"), denom)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        compute_total_loss(x, x, x, mask, PPOConfig(kl_coef=0.1), denom)
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
        compute_total_loss(x, x, x, mask, PPOConfig(entropy_coef=0.1), denom)
