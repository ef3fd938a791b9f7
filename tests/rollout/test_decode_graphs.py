"""Decode steps from bucketed static buffers (CUDA graphs on a GPU): padded to the bucket's batch and view
widths, they generate what the eager step generates. On the CPU the buffers run eagerly ("padded"); on a
GPU the captured graphs are replayed."""

import pytest
import torch
from helpers.embedded_engine import spy_on_steps_ahead

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import GPTOSSModel, build_model
from megatron_gptoss.ops import backend_available, batch_invariant
from megatron_gptoss.parallel.loading import materialize
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams, decode_graphs
from megatron_gptoss.rollout.scheduler import Scheduler

PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 61, 7, 7, 30, 1], [11], [8, 8, 8, 8, 8], [70, 1], [3, 1, 4, 1, 5, 9]]
BUDGETS = [12, 3, 20, 7, 1, 9]  # rows leave one by one: the decode batch crosses buckets 8, 4, 2, 1


def generate(
    device, graphs: str, dtype=torch.float32, backend=None, params=None, record=False, ahead=True,
    budgets=None,
):  # fmt: skip
    config = gpt_oss_tiny(attention_backend=backend or ("eager" if device == "cpu" else "auto"))
    learner = build_model(config, seed=4)
    options = EmbeddedEngineConfig(
        max_batch_slots=5, block_size=4, max_step_tokens=8, cuda_graphs=graphs, record_routing=record,
        decode_ahead=ahead,
    )  # fmt: skip
    engine = EmbeddedEngine(config, dtype, device, options=options)
    engine.update_weights(iter_hf_tensors(learner, config))
    params = params or SamplingParams(temperature=0.8, seed=3)
    outs = engine.generate(PROMPTS, params, max_new_tokens=budgets or BUDGETS)
    return engine, outs


def assert_same(outs, ref, tolerance):
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max() <= tolerance


@pytest.mark.parametrize("ahead", [True, False], ids=["launched-ahead", "planned-ahead"])
def test_padded_decode_buffers_equal_the_eager_step(monkeypatch, ahead):
    """The bucketed buffers run eagerly give the unpadded step's tokens, the decode steps planned while the
    step before ran: launched before its tokens are read (`decode_ahead`), or taken where no row stopped."""
    taken, launched = spy_on_steps_ahead(monkeypatch)
    engine, outs = generate("cpu", "padded", ahead=ahead)
    _, ref = generate("cpu", "off")
    assert_same(outs, ref, 1e-6)
    assert engine.take_stats()["engine/graph_frac"] == 0  # the padded check replays no graph
    assert engine._inflight is None  # nothing left on the device after the generation
    ahead_steps = sum(step is not None for step in (launched if ahead else taken))
    assert ahead_steps >= 5 and (ahead or not launched)
    buckets = {batch for batch, _, _ in engine._graphs._buffers}
    assert {8, 4, 2, 1} <= buckets  # 5 rows pad to 8; 3 to 4; ...
    # every row seeded with one temperature: the buckets sampled inside the step (the reference outside it)
    assert {sampling for _, _, sampling in engine._graphs._buffers} == {(0.8, 0, 1.0)}
    assert all(free == cap for free, cap in engine.kv_blocks_free())  # padding wrote only the null block


def test_truncated_sampling_inside_the_padded_step_equals_sampling_outside():
    """top-k and top-p sampled inside the bucketed step (the graph's sampler) draw the tokens the unpadded
    step draws outside it."""
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=5)
    engine, outs = generate("cpu", "padded", params=params)
    _, ref = generate("cpu", "off", params=params)
    assert_same(outs, ref, 1e-6)
    assert {sampling for _, _, sampling in engine._graphs._buffers} == {(1.3, 40, 0.9)}


def test_stop_tokens_drop_the_plan_built_ahead():
    """Rows stopping on a stop token (unknown before the step's sampling) with the next step planned ahead
    during each bucketed step: the tokens and log-probs of the unpadded steps planned one at a time."""
    params = SamplingParams(temperature=1.0, seed=11, stop_token_ids=list(range(0, 512, 9)))
    engine, outs = generate("cpu", "padded", params=params)
    _, ref = generate("cpu", "off", params=params)
    assert_same(outs, ref, 1e-6)
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
    assert all(free == cap for free, cap in engine.kv_blocks_free())


def test_triton_decode_kernel_on_padded_buffers_and_left_padded_chunks():
    """The GPU attention path (the Triton decode kernel: on the GPU where there is one, interpreted on the
    CPU otherwise): padding rows with no key and left-padded prefill chunks give the eager path's tokens and
    log-probs."""
    if not backend_available("triton"):
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, outs = generate(device, "padded", backend="triton")
    _, ref = generate(device, "off", backend="eager")
    assert_same(outs, ref, 1e-5)


def test_steps_with_prefill_tokens_in_the_buffers_record_the_eager_routing():
    """Steps with prefill tokens laid out flat and run in their bucketed buffers (the graphs'): every token's
    experts, read from the buffers' static routing record, equal the eager steps' record; the tokens too."""
    engine, outs = generate("cpu", "padded", record=True)
    _, ref = generate("cpu", "off", record=True)
    assert engine._graphs is not None and engine._graphs._token_buffers
    assert_same(outs, ref, 1e-6)
    for out, want in zip(outs, ref):
        assert out.routing is not None and want.routing is not None
        assert torch.equal(out.routing, want.routing)


def test_the_batch_invariant_mode_keeps_prefill_steps_in_chunks():
    """Bitwise on-policy RL (the batch-invariant mode): steps with prefill tokens stay in chunks, eager (the
    attention its GPU tests check against the learner); the decode steps still run in their buffers."""
    with batch_invariant.enabled(True):
        engine, outs = generate("cpu", "padded")
    assert engine._graphs is not None and engine._graphs._buffers and not engine._graphs._token_buffers
    assert len(outs) == len(PROMPTS) and all(len(o.token_ids) == b for o, b in zip(outs, BUDGETS))


def test_a_model_built_on_meta_materializes_its_rotary_frequencies():
    """The rotary frequencies of a model built on the meta device (the parallel engines' and learners' path)
    keep their values through `materialize`: equal to those of a model built on the CPU."""
    model = GPTOSSModel(gpt_oss_tiny(), device="meta")
    materialize(model, "cpu")
    assert torch.equal(model.rotary.inv_freq, GPTOSSModel(gpt_oss_tiny()).rotary.inv_freq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_keeps_every_buffer_on_its_device():
    """A captured decode step may not copy from the host: the model built for a GPU holds every parameter
    and buffer (the rotary frequencies included) there, none on the host."""
    model = GPTOSSModel(gpt_oss_tiny(), device="cuda")
    on_host = [
        name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "cuda"
    ]
    assert not on_host, f"left on the host: {on_host}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_graphs_equal_the_eager_step():
    """bf16 (the fused experts are capturable in bf16): the replayed graphs give the tokens and log-probs of
    the same bucketed buffers run eagerly, which equal the unpadded step (the CPU tests above); a float32
    engine is not captured and says why."""
    engine, outs = generate("cuda", "auto", torch.bfloat16)
    _, ref = generate("cuda", "padded", torch.bfloat16)
    assert engine._graphs is not None
    assert engine._graphs.enabled, f"capture failed, decode ran eagerly: {engine._graphs.failure}"
    captured = sum(b.graph is not None for b in engine._graphs._buffers.values())
    assert captured > 0
    # the steps with prefill tokens, laid out flat, replayed too
    assert engine._graphs.token_failure is None, engine._graphs.token_failure
    flat = sum(b.graph is not None for b in engine._graphs._token_buffers.values())
    assert flat > 0
    stats = engine.take_stats()  # every capture counted once, its seconds inside the steps'
    assert stats["engine/graph_captures"] == captured + flat
    assert stats["engine/prefill_graph_frac"] == 1
    assert 0 < stats["time/engine_capture_s"] < stats["time/engine_step_s"]
    assert_same(outs, ref, 1e-6)
    fp32, _ = generate("cuda", "auto")
    assert fp32._graphs is not None and not fp32._graphs.enabled and "float32" in str(fp32._graphs.failure)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_routing_recorded_from_captured_graphs_equals_the_eager_record():
    """Router replay's record with the decode steps replayed (bf16): each row's experts, written by the
    graphs into their static buffers, equal those of the same bucketed buffers run eagerly (whose record the
    CPU tests compare with the learner's routing), and the tokens too."""
    engine, outs = generate("cuda", "auto", torch.bfloat16, record=True)
    _, ref = generate("cuda", "padded", torch.bfloat16, record=True)
    assert engine._graphs is not None
    assert engine._graphs.enabled, f"capture failed, decode ran eagerly: {engine._graphs.failure}"
    assert any(b.graph is not None for b in engine._graphs._buffers.values())
    assert_same(outs, ref, 1e-6)
    for out, want in zip(outs, ref):
        assert out.routing is not None and want.routing is not None
        assert torch.equal(out.routing, want.routing)


def test_steps_launched_ahead_drop_the_rows_that_stopped(monkeypatch):
    """Rows stopping on stop tokens at unforeseen steps while the next step, launched before their tokens
    were read, ran them too: those rows' extra tokens are dropped, their blocks freed, and every row's tokens
    and log-probs equal the eager steps'."""
    dropped = []
    real_computed = Scheduler.computed

    def computed(self, plan, chunks=None):
        dropped.append(chunks is not None and len(chunks) < len(plan.chunks))
        return real_computed(self, plan, chunks)

    monkeypatch.setattr(Scheduler, "computed", computed)
    stops = list(range(0, gpt_oss_tiny().vocab_size, 9))  # a stop about every 9th draw
    params = SamplingParams(temperature=1.0, seed=11, stop_token_ids=stops)
    engine, outs = generate("cpu", "padded", params=params, budgets=[40] * len(PROMPTS))
    _, ref = generate("cpu", "off", params=params, budgets=[40] * len(PROMPTS))
    assert_same(outs, ref, 1e-6)
    assert sum(out.finish_reason == "stop" for out in outs) >= 3 and any(dropped)
    assert engine._inflight is None and all(free == cap for free, cap in engine.kv_blocks_free())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_steps_launched_ahead_equal_the_steps_read_first(monkeypatch):
    """bf16 graphs, rows stopping on stop tokens: decode steps launched before the tokens of the step before
    are read (their token ids copied on the device, that step's draws copied back before the next replay
    reuses its buffers) give the tokens and log-probs of steps whose tokens are read first, and those of the
    bucketed buffers run eagerly."""
    taken, launched = spy_on_steps_ahead(monkeypatch)
    stops = list(range(0, gpt_oss_tiny().vocab_size, 9))
    params = SamplingParams(temperature=1.0, seed=11, stop_token_ids=stops)
    budgets = [40] * len(PROMPTS)
    engine, outs = generate("cuda", "auto", torch.bfloat16, params=params, budgets=budgets)
    assert engine._graphs is not None and engine._graphs.enabled, engine._graphs and engine._graphs.failure
    assert sum(step is not None for step in launched) >= 5
    _, read_first = generate("cuda", "auto", torch.bfloat16, params=params, budgets=budgets, ahead=False)
    _, padded = generate("cuda", "padded", torch.bfloat16, params=params, budgets=budgets)
    assert_same(outs, read_first, 1e-6)
    assert_same(outs, padded, 1e-6)
    assert sum(out.finish_reason == "stop" for out in outs) >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_after_a_sleep_are_captured_without_warm_up(monkeypatch):
    """A sleep drops the cache and its graphs; the next generation captures the same buckets again, with no
    warm-up forward (the model had them captured in this process), and replays the tokens and log-probs of
    the first generation; a capture without warm-up that fails is retried after the warm-ups."""
    engine, first = generate("cuda", "auto", torch.bfloat16)
    graphs = engine._graphs
    assert graphs is not None and graphs.enabled, graphs and graphs.failure
    buckets = len(graphs._buffers) + len(graphs._token_buffers)
    assert buckets > 0 and graphs.warmups == decode_graphs.WARMUP_FORWARDS * buckets
    engine.take_stats()

    def again():
        engine.sleep(1)
        engine.wake_up()
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3), max_new_tokens=BUDGETS)
        graphs = engine._graphs
        assert graphs is not None and graphs.enabled and graphs.token_failure is None
        assert engine.take_stats()["engine/graph_captures"] == buckets
        assert_same(outs, first, 1e-6)
        return graphs

    assert again().warmups == 0
    record = decode_graphs.DecodeGraphs._record
    failed = []

    def record_failing_cold(self, b, warmups):
        if warmups == 0 and not failed:
            failed.append(b)
            raise RuntimeError("an op that needs its warm-up")
        return record(self, b, warmups)

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_record", record_failing_cold)
    assert again().warmups == decode_graphs.WARMUP_FORWARDS and len(failed) == 1


def test_captures_after_a_sleep_skip_the_warm_up_cpu(monkeypatch):
    """The warm-up bookkeeping on the CPU, where no graph is captured: `_record` stands in for the capture
    (its warm-ups counted, the graph's replay the bucket's forward). The first generation warms up every
    bucket, the one after a sleep none and replays the same tokens; a capture without warm-up that fails
    is retried after the warm-ups, and the model's record is its own (a second engine warms up again)."""

    class Replay:
        def __init__(self, graphs, b):
            self.graphs, self.b = graphs, b

        def replay(self):
            self.b.hidden, self.b.drawn = self.graphs._forward(self.b)

    failing = []

    def record(self, b, warmups):
        if failing and warmups == 0:
            failing.pop()
            raise RuntimeError("an op that needs its warm-up")
        for _ in range(warmups):
            self._forward(b)
        self.warmups += warmups
        b.graph = Replay(self, b)
        b.hidden, b.drawn = self._forward(b)

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_record", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(EmbeddedEngine, "_graph_mode", lambda self: "capture")
    engine, first = generate("cpu", "auto", torch.bfloat16)
    graphs = engine._graphs
    assert graphs is not None and graphs.enabled, graphs and graphs.failure
    buckets = len(graphs._buffers) + len(graphs._token_buffers)
    assert buckets > 1 and graphs.warmups == decode_graphs.WARMUP_FORWARDS * buckets
    _, padded = generate("cpu", "padded", torch.bfloat16)
    assert_same(first, padded, 0.0)  # the stand-in replays the buckets' own forwards

    def again(fail: int) -> int:
        failing.extend([True] * fail)
        engine.sleep(1)
        engine.wake_up()
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3), max_new_tokens=BUDGETS)
        assert engine._graphs is not None and engine._graphs is not graphs and engine._graphs.enabled
        assert len(engine._graphs._buffers) + len(engine._graphs._token_buffers) == buckets
        assert_same(outs, first, 0.0)
        return engine._graphs.warmups

    assert again(0) == 0
    assert again(1) == decode_graphs.WARMUP_FORWARDS and not failing
    other, _ = generate("cpu", "auto", torch.bfloat16)
    assert other._graphs is not None and other._graphs.warmups == decode_graphs.WARMUP_FORWARDS * buckets
