"""Context parallelism against the single-process model (gloo, fp32): the loss, the global gradient norm
and every gradient of two AdamW steps (distributed optimizer), every parameter after them, and the
log-prob pass, on packed micro-batches whose documents cross the zig-zag chunk boundaries, with sinks
(perturbed away from 0) and both attention kinds (window 8 and full). cp2 splits a 32-token micro-batch
into 8-token chunks (the window layers exchange only each chunk's last 7 keys), cp4 into 4-token chunks
(the window reaches back past the previous chunk: all keys are exchanged). One pool per world size runs
every layout of that size in one call."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import pool
from helpers.sharded import rel_err, tiny_config
from test_layouts import DOCS, compare, reference_run, run_layout

from megatron_gptoss.config import ConfigError, ParallelConfig
from megatron_gptoss.parallel import context_parallel
from megatron_gptoss.parallel.context_parallel import ContextParallel, plan_chunk
from megatron_gptoss.parallel.dims import Layout, validate_layout

LAYERS = 2
CP2 = {"context_parallel_size": 2}


def _layouts(cases: list[tuple[dict, dict]]) -> list[dict]:
    """Every (parallel, options) case on this rank, one after the other. Option `drop_sinks`: the
    diagonal blocks run without the sinks (what a CP path that forgets them computes)."""
    out = []
    for parallel, options in cases:
        options = dict(options)
        original = context_parallel.sink_attention
        if options.pop("drop_sinks", False):

            def without_sinks(q, k, v, sinks, original=original, **kwargs):
                return original(q, k, v, torch.full_like(sinks, float("-inf")), **kwargs)

            context_parallel.sink_attention = without_sinks
        try:
            out.append(run_layout(parallel, LAYERS, DOCS[1], options))
        finally:
            context_parallel.sink_attention = original
    return out


def _run(world: int, cases: list[tuple[dict, dict]]) -> list[list[dict]]:
    per_rank = pool(world).run(_layouts, cases)
    return [[rank[i] for rank in per_rank] for i in range(len(cases))]


def test_cp2_alone_with_experts_carved_from_cp_and_dropped_sinks_caught():
    ref = reference_run(LAYERS, DOCS[1])
    cases = [
        (CP2, {}),
        ({**CP2, "expert_model_parallel_size": 2}, {}),  # ep group = the cp group: {0, 1}
        (CP2, {"drop_sinks": True}),
    ]
    plain, experts, sabotaged = _run(2, cases)
    print("cp2", compare(plain, ref))
    print("cp2 x ep2", compare(experts, ref))
    with pytest.raises(AssertionError, match="error"):
        compare(sabotaged, ref)


def test_cp4_cp2_tp2_sp_and_cp2_pp2_equal_single_process():
    ref = reference_run(LAYERS, DOCS[1])
    cases = [
        ({"context_parallel_size": 4}, {}),
        ({**CP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
        ({**CP2, "pipeline_model_parallel_size": 2}, {}),
    ]
    for (parallel, _), per_rank in zip(cases, _run(4, cases)):
        print(parallel, compare(per_rank, ref))


def test_layout_rank_order_and_refused_layouts():
    layout = Layout(world=8, tp=2, pp=1, ep=4, cp=2)  # dp 2
    groups = layout.groups()
    assert groups["cp"][:2] == [[0, 2], [1, 3]] and groups["dp"][0] == [0, 4]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank in range(8):
        c = layout.coords(rank)
        assert rank == c["tp"] + 2 * (c["cp"] + 2 * c["dp"])
    config = tiny_config()
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        validate_layout(ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2), config, 6)
    with pytest.raises(ConfigError, match="data-parallel x context-parallel"):
        validate_layout(ParallelConfig(context_parallel_size=2, expert_model_parallel_size=4), config, 2)
    with pytest.raises(ConfigError, match="multiple of 8"):
        ContextParallel(4, 0).check(12)


def test_zigzag_split_and_chunk_plans():
    cp = ContextParallel(2, 1)
    assert cp.local_index(8).tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
    assert ContextParallel(2, 0).global_order(8).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    bounds = [0, 5, 14, 16]  # documents [0, 5) [5, 14) [14, 16); chunks of 4
    plan = plan_chunk(bounds, 2, 4, None)  # tokens [8, 12): inside the document that starts at 5
    assert (plan.cu, plan.rows, plan.k_lo) == ([0, 4], 4, 5)
    plan = plan_chunk(bounds, 3, 4, 3)  # [12, 16): rows 12, 13 reach back 2 keys; 14 starts a document
    assert (plan.cu, plan.rows, plan.k_lo) == ([0, 2, 4], 2, 10)
    assert plan_chunk(bounds, 1, 4, None).rows == 1  # token 4 reads keys [0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 8])
def test_flex_rectangle_equals_eager_forward_and_backward(window):
    """The CUDA path of the earlier-keys block (flex_attention, its LSE differentiated) against the eager
    reference, rows that see no key included (window 8 from 20 keys back)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (40, 8, 64), "k": (56, 2, 64), "v": (56, 2, 64)}
    inputs = {n: torch.randn(s, generator=gen).cuda() for n, s in shapes.items()}
    weights = torch.randn(40, 8, 64, generator=gen).cuda(), torch.randn(8, 40, generator=gen).cuda()
    results = []
    for fn in (context_parallel.eager_rect_attention, context_parallel.flex_rect_attention):
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        out, lse = fn(leaves["q"], leaves["k"], leaves["v"], 100, 44, window, 0.125)
        seen = torch.isfinite(lse)
        ((out * weights[0]).sum() + (lse.masked_fill(~seen, 0) * weights[1]).sum()).backward()
        results.append((out, lse.masked_fill(~seen, 0), seen, *(leaves[n].grad for n in "qkv")))
    ref, ours = results
    assert torch.equal(ref[2], ours[2])
    for name, a, b in zip(("out", "lse", "seen", "dq", "dk", "dv"), ref, ours):
        if name != "seen":
            assert rel_err(b, a) < 1e-5, name
