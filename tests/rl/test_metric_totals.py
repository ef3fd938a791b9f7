"""MetricTotals: recording a micro-batch's metrics reads none of them (no host sync inside the loss
function, checked with meta tensors, which cannot be read), and the totals equal the combination
written out from its definition (sums, extremes, token-weighted means)."""

import pytest
import torch

from megatron_gptoss.rl.learner import MetricTotals


def test_add_reads_no_value():
    totals = MetricTotals()
    meta = torch.empty((), device="meta")
    totals.add({"pg/tokens": meta, "loss/total": meta, "pg/ratio_max": meta, "pg/clipfrac": meta})
    with pytest.raises(RuntimeError, match="meta"):  # read here, where meta values cannot be
        totals.result()
    with pytest.raises(KeyError, match="pg/tokens"):
        MetricTotals().add({"loss/total": torch.tensor(1.0)})


def test_combination_matches_the_definition():
    gen = torch.Generator().manual_seed(11)
    micro = []
    for _ in range(3):
        v = torch.rand(4, generator=gen)
        micro.append(
            {
                "pg/tokens": torch.tensor(float(torch.randint(1, 50, (), generator=gen))),
                "loss/total": v[0],
                "pg/ratio_max": v[1],
                "pg/ratio_min": v[2],
                "pg/clipfrac": v[3],
            }
        )
    totals = MetricTotals()
    for m in micro:
        totals.add(m)
    got = totals.result()
    n = [float(m["pg/tokens"]) for m in micro]
    assert got["pg/tokens"] == sum(n)
    assert got["loss/total"] == pytest.approx(sum(float(m["loss/total"]) for m in micro), rel=1e-12)
    assert got["pg/ratio_max"] == max(float(m["pg/ratio_max"]) for m in micro)
    assert got["pg/ratio_min"] == min(float(m["pg/ratio_min"]) for m in micro)
    mean = sum(float(m["pg/clipfrac"]) * k for m, k in zip(micro, n)) / sum(n)
    assert got["pg/clipfrac"] == pytest.approx(mean, rel=1e-12)
    totals.tokens = 5.0  # the parallel combine overwrites the token total
    assert totals.tokens == 5.0
