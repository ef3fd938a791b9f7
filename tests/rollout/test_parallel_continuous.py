"""The tensor- and expert-parallel embedded engine under continuous batching, on 2 gloo ranks: with fewer
batch slots than prompts, rows stopping apart, and ranks of one expert-parallel block holding different
prompts (one finishes early and joins the other's steps with padding), every rank's generations equal the
single-process engine's; tp2 sessions extended with outside tokens equal the single-process sessions."""

import pytest
import torch
from helpers.harness import pool

from megatron_gptoss.config import EmbeddedEngineConfig, ParallelConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

CONFIG = gpt_oss_tiny(num_experts=8)
OPTIONS = dict(max_batch_slots=2, block_size=4, max_step_tokens=5)
PROMPTS = (  # per data-parallel coordinate of the ep2 engine: different prompts, different lengths
    [[5, 17, 3], [40, 2, 2, 9, 61, 7, 7, 30, 1], [11], [3, 3, 4, 4, 90, 12, 1]],
    [[8, 8, 8, 8, 8], [70, 1]],
)
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=10, seed=5)
BUDGETS = ([10, 3, 7, 10], [2, 4])
TIMEOUT = 180.0


def model():
    learner = build_model(CONFIG, seed=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return learner


def session_run(engine) -> list:
    sid = engine.open_session([4, 9, 16, 25, 36], SamplingParams(max_new_tokens=4), seed=8)
    first = engine.step_sessions()[0]
    engine.extend_session(sid, [1, 2, 3, 4, 5, 6], max_new_tokens=5)
    second = engine.step_sessions()[0]
    engine.close_session(sid)
    return [(t.token_ids, t.logprobs) for t in (first, second)]


def on_ranks(layout: dict, graphs: str = "auto") -> dict:
    dims = ParallelDims.build(ParallelConfig(**layout), CONFIG)
    options = EmbeddedEngineConfig(**OPTIONS, cuda_graphs=graphs)
    engine = ParallelEmbeddedEngine(CONFIG, dims, options=options)
    engine.update_weights(iter_hf_tensors(model(), CONFIG))
    which = dims.coord("dp") % 2
    outs = engine.generate(PROMPTS[which], PARAMS, max_new_tokens=BUDGETS[which])
    result = {"which": which, "outs": [(o.token_ids, o.logprobs) for o in outs]}
    if dims.tp > 1:
        result["sessions"] = session_run(engine)
    result["free"] = all(free == cap for free, cap in engine.kv_blocks_free())
    if engine._graphs is not None:  # which bucketed steps sampled inside the step (the graphs' head)
        result["sampled_inside"] = {sampling is not None for _, _, sampling in engine._graphs._buffers}
    return result


def close(got, want) -> bool:
    return len(got) == len(want) and all(
        a[0] == b[0] and (torch.tensor(a[1]) - torch.tensor(b[1])).abs().max() <= 1e-5
        for a, b in zip(got, want)
    )


def single_process() -> list:
    single = EmbeddedEngine(CONFIG, options=EmbeddedEngineConfig(schedule="static", max_batch_slots=8))
    single.update_weights(iter_hf_tensors(model(), CONFIG))
    return [
        [(o.token_ids, o.logprobs) for o in single.generate(p, PARAMS, max_new_tokens=b)]
        for p, b in zip(PROMPTS, BUDGETS)
    ]


@pytest.mark.parametrize(
    "layout",
    [dict(expert_model_parallel_size=2), dict(tensor_model_parallel_size=2)],
    ids=["ep2", "tp2"],
)
def test_parallel_engine_continuous_equals_single_process(layout):
    want = single_process()
    results = pool(2).run(on_ranks, layout, timeout=TIMEOUT)
    for r in results:
        assert close(r["outs"], want[r["which"]]) and r["free"]
    if "sessions" in results[0]:
        session_engine = EmbeddedEngine(CONFIG, options=EmbeddedEngineConfig(**OPTIONS))
        session_engine.update_weights(iter_hf_tensors(model(), CONFIG))
        expected = session_run(session_engine)
        assert all(close(r["sessions"], expected) for r in results)
    assert {r["which"] for r in results} == ({0, 1} if "expert" in next(iter(layout)) else {0})


@pytest.mark.parametrize(
    "layout,alone", [({}, True), (dict(expert_model_parallel_size=2), False)], ids=["dp2", "ep2"]
)
def test_bucketed_decode_steps_where_a_rank_steps_alone(layout, alone):
    """The bucketed decode steps (CUDA graphs on a GPU, run eagerly here as "padded"): a rank whose steps
    call no collective (tp 1, ep 1: one replica of the RL step's engine) samples inside the bucketed step as
    the single-device engine does; an ep2 rank samples outside it (its logits follow collectives). Both
    generate the single-process engine's tokens."""
    want = single_process()
    results = pool(2).run(on_ranks, layout, "padded", timeout=TIMEOUT)
    for r in results:
        assert close(r["outs"], want[r["which"]]) and r["free"]
        assert r["sampled_inside"] == {alone}
    assert {r["which"] for r in results} == {0, 1}
