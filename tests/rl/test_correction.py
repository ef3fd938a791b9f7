"""Rollout correction against float64 per-sequence loops; tool tokens stay out of every statistic."""

import math

import pytest
import torch

from megatron_gptoss.config.train import CORRECTION_MODES
from megatron_gptoss.rl.correction import mismatch_metrics, rollout_correction

B, T = 8, 10
THRESHOLD, THRESHOLD_LOW = 2.0, 0.5


def _inputs(seed, scale=0.4):
    gen = torch.Generator().manual_seed(seed)
    rollout = -4.0 * torch.rand(B, T, generator=gen)
    # A per-sequence offset (a drifted expert, say) on top of per-token noise.
    offset = 0.6 * torch.randn(B, 1, generator=gen)
    old = rollout + offset + scale * torch.randn(B, T, generator=gen)
    mask = torch.zeros(B, T)
    for i in range(B):
        n = int(torch.randint(1, T + 1, (1,), generator=gen))
        mask[i, :n] = 1.0
    mask[1, 2:4] = 0.0  # a tool call's output inside the response
    mask[3, 0] = 0.0
    mask[6] = 0.0  # a sequence without loss tokens
    return old, rollout, mask


def _ref_mismatch(old, rollout, mask):
    d = [float(old[i, t]) - float(rollout[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    n = len(d)
    return {
        "mismatch/abs_diff_mean": math.fsum(abs(x) for x in d) / n,
        "mismatch/abs_diff_max": max(abs(x) for x in d),
        "mismatch/abs_diff_p99": sorted(abs(x) for x in d)[math.ceil(0.99 * n) - 1],
        "mismatch/kl_k1": math.fsum(-x for x in d) / n,
        "mismatch/kl_k3": math.fsum(math.exp(x) - x - 1 for x in d) / n,
        "mismatch/tokens": n,
    }


def _ref_correction(old, rollout, mask, mode, hi, lo):
    """float64 loops: weights, new mask and the correction/* metrics."""
    weights = torch.zeros(B, T, dtype=torch.float64)
    new_mask = torch.zeros(B, T, dtype=torch.bool)
    units = []  # (applied weight, 0 when removed; truncated; removed)
    seq_level = mode.startswith(("seq", "geo"))
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        lw = {t: float(old[i, t]) - float(rollout[i, t]) for t in toks}
        if seq_level:
            if not toks:
                continue
            s = math.fsum(lw.values())
            if mode.startswith("geo"):
                s /= len(toks)
            w = math.exp(s)
            token_w = dict.fromkeys(toks, w)
            groups = [toks]
        else:
            token_w = {t: (1.0 if mode == "none" else math.exp(lw[t])) for t in toks}
            groups = [[t] for t in toks]
        for group in groups:
            w = token_w[group[0]]
            truncated = mode.endswith("tis") and w > hi
            removed = mode.endswith("mis") and not lo <= w <= hi
            w = min(w, hi) if truncated else w
            units.append((0.0 if removed else w, truncated, removed))
            for t in group:
                if not removed:
                    weights[i, t] = w
                    new_mask[i, t] = True
    n = len(units)
    ws = [u[0] for u in units]
    kept = [weights[i, t].item() for i in range(B) for t in range(T) if new_mask[i, t]]
    n_tokens = int(mask.sum())
    metrics = {
        "correction/truncated_frac": sum(u[1] for u in units) / n,
        "correction/masked_frac": sum(u[2] for u in units) / n,
        "correction/masked_token_frac": (n_tokens - int(new_mask.sum())) / n_tokens,
        "correction/ess": math.fsum(ws) ** 2 / (n * math.fsum(w * w for w in ws)),
        "correction/weight_mean": math.fsum(kept) / len(kept),
        "correction/weight_max": max(kept),
        "correction/weight_min": min(kept),
    }
    return weights, new_mask, metrics


@pytest.mark.parametrize("seed", [1, 2])
def test_mismatch_metrics_match_reference(seed):
    old, rollout, mask = _inputs(seed=seed)
    ours = mismatch_metrics(old, rollout, mask)
    ref = _ref_mismatch(old, rollout, mask)
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert ours[key].dtype == torch.float32 and ours[key].dim() == 0
        assert abs(ours[key].item() - value) <= 1e-6 * abs(value), key


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_correction_matches_reference(mode):
    old, rollout, mask = _inputs(seed=13, scale=0.3)
    weights, new_mask, metrics = rollout_correction(old, rollout, mask, mode, THRESHOLD, THRESHOLD_LOW)
    ref_w, ref_mask, ref_metrics = _ref_correction(old, rollout, mask, mode, THRESHOLD, THRESHOLD_LOW)

    assert weights.dtype == torch.float32 and new_mask.dtype == torch.bool and not weights.requires_grad
    assert torch.equal(new_mask, ref_mask)
    assert ((weights.double() - ref_w).norm() / ref_w.norm()).item() <= 1e-6
    for key, value in ref_metrics.items():
        assert abs(metrics[key].item() - value) <= 1e-6 * max(abs(value), 1e-30), key
    for key, value in _ref_mismatch(old, rollout, mask).items():
        assert abs(metrics[key].item() - value) <= 1e-6 * abs(value), key
    # Each mode's mechanism is exercised by these inputs.
    if mode.endswith("tis"):
        assert 0 < ref_metrics["correction/truncated_frac"] < 1
    if mode.endswith("mis"):
        assert 0 < ref_metrics["correction/masked_frac"] < 1


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_masked_tokens_do_not_affect_correction(mode):
    old, rollout, mask = _inputs(seed=30)
    weights, new_mask, metrics = rollout_correction(old, rollout, mask, mode, THRESHOLD, THRESHOLD_LOW)
    off = mask == 0
    gen = torch.Generator().manual_seed(31)
    wild = 1e4 * torch.randn(B, T, generator=gen)
    old_bad = torch.where(off, wild, old)
    old_bad[1, 2] = float("nan")
    rollout_bad = rollout.masked_fill(off, float("-inf"))
    weights_bad, new_mask_bad, metrics_bad = rollout_correction(
        old_bad, rollout_bad, mask, mode, THRESHOLD, THRESHOLD_LOW
    )
    assert torch.equal(weights, weights_bad) and torch.equal(new_mask, new_mask_bad)
    assert metrics.keys() == metrics_bad.keys()
    assert all(torch.equal(metrics[k], metrics_bad[k]) for k in metrics)
    assert torch.all(weights[off] == 0) and not new_mask[off].any()


def test_identical_logprobs_give_unit_weights():
    old, _, mask = _inputs(seed=40)
    for mode in CORRECTION_MODES:
        weights, new_mask, metrics = rollout_correction(
            old, old.clone(), mask, mode, THRESHOLD, THRESHOLD_LOW
        )
        assert torch.equal(new_mask, mask.bool())
        assert torch.equal(weights, mask)
        assert metrics["correction/ess"].item() == 1.0 and metrics["mismatch/abs_diff_max"].item() == 0.0


def test_long_sequence_stays_finite():
    """A sequence-level log-ratio far beyond float range is truncated or masked, never inf."""
    old = torch.zeros(2, 200)
    rollout = torch.full((2, 200), -5.0)  # sum of log-ratios 1000: exp overflows even float64
    mask = torch.ones(2, 200)
    w, m, metrics = rollout_correction(old, rollout, mask, "seq-tis", THRESHOLD, THRESHOLD_LOW)
    assert torch.equal(w, torch.full_like(w, THRESHOLD)) and m.all()
    w, m, metrics = rollout_correction(old, rollout, mask, "seq-mis", THRESHOLD, THRESHOLD_LOW)
    assert not m.any() and torch.equal(w, torch.zeros_like(w))
    assert metrics["correction/ess"].item() == 0.0 and metrics["correction/masked_frac"].item() == 1.0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_no_loss_tokens_gives_zero_metrics():
    old, rollout, _ = _inputs(seed=50)
    mask = torch.zeros(B, T)
    _, new_mask, metrics = rollout_correction(old, rollout, mask, "seq-mis", THRESHOLD, THRESHOLD_LOW)
    assert not new_mask.any()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert metrics["mismatch/kl_k3"].item() == 0.0 and metrics["mismatch/tokens"].item() == 0.0


def test_bad_inputs_raise_clear_errors():
    old, rollout, mask = _inputs(seed=60)
    with pytest.raises(ValueError, match=r"rollout_logprobs \(8, 9\)"):
        rollout_correction(old, rollout[:, :9], mask, "token-tis", THRESHOLD, THRESHOLD_LOW)
    with pytest.raises(ValueError, match=r"mask \(10,\)"):
        mismatch_metrics(old, rollout, mask[0])
    with pytest.raises(ValueError, match="unknown correction mode 'tis'"):
        rollout_correction(old, rollout, mask, "tis", THRESHOLD, THRESHOLD_LOW)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        rollout_correction(old, rollout, mask, "token-tis", 0.0, THRESHOLD_LOW)
    with pytest.raises(ValueError, match="geo-mis needs 0 <= threshold_low < threshold"):
        rollout_correction(old, rollout, mask, "geo-mis", 2.0, 3.0)


def test_mismatch_p99_small_and_empty_masks():
    """The nearest-rank 99th percentile: one loss token gives its own |d|; 150 tokens give the 149th
    smallest; no loss token gives 0."""
    d = torch.arange(1, 151, dtype=torch.float64).reshape(3, 50) / 1000
    d = d[torch.randperm(3, generator=torch.Generator().manual_seed(0))]
    zero = torch.zeros_like(d)
    full = torch.ones_like(d)
    assert mismatch_metrics(d, zero, full)["mismatch/abs_diff_p99"].item() == pytest.approx(0.149)
    one = torch.zeros_like(d)
    one[1, 7] = 1
    single = mismatch_metrics(-d, zero, one)["mismatch/abs_diff_p99"].item()
    assert single == pytest.approx(abs(d[1, 7].item()))
    assert mismatch_metrics(d, zero, torch.zeros_like(d))["mismatch/abs_diff_p99"].item() == 0.0
