"""Sessions of the embedded engine (multi-turn trajectories keeping their KV cache), the routing record for
router replay, and sleep / wake freeing the cache and the weights."""

import pytest
import torch
from helpers.embedded_engine import CONFIG, engine_of, perturbed_learner, spy_on_steps_ahead

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.engine_api import SessionEngine
from megatron_gptoss.errors import EngineError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model, token_logprobs
from megatron_gptoss.model.moe import no_route, routing_dtype
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams


@pytest.fixture(scope="module")
def learner():
    return perturbed_learner(11)


def learner_logprobs(model, sequence: list[int], start: int) -> torch.Tensor:
    """The learner's log-probs of sequence[start:] given what precedes each token."""
    ids = torch.tensor(sequence)[None]
    with torch.no_grad():
        lp = token_logprobs(model.hidden_states(ids[:, :-1]), model.output_weight(), ids[:, 1:])[0]
    return lp[start - 1 :]


def step_until(engine, sid):
    while True:
        turns = {t.session_id: t for t in engine.step_sessions()}
        if sid in turns:
            return turns[sid]


def test_an_extended_session_equals_a_session_on_the_concatenation(learner):
    engine = engine_of(learner, max_batch_slots=2, block_size=4, max_step_tokens=5)
    assert isinstance(engine, SessionEngine)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=None)
    prompt, other = [3, 14, 15, 92, 65, 35, 89], [2, 71, 82, 81]
    sid = engine.open_session(prompt, params, seed=40)
    busy = engine.open_session(other, SamplingParams(max_new_tokens=9), seed=41)  # shares the steps
    turns = engine.step_sessions()
    assert [t.session_id for t in turns] == [sid]  # the other session is still sampling its 9 tokens
    first = turns[0]
    assert len(first.token_ids) == 6 and first.finish_reason == "length"
    tool = [7, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # written outside the model
    with pytest.raises(EngineError, match="not paused"):
        engine.extend_session(busy, tool, 3)
    engine.extend_session(sid, tool, max_new_tokens=8)
    second = step_until(engine, sid)
    history = prompt + first.token_ids + tool

    fresh = engine_of(learner, max_batch_slots=1, block_size=8, max_step_tokens=32)
    again = fresh.open_session(history, SamplingParams(max_new_tokens=8), seed=40)
    expected = step_until(fresh, again)
    assert second.token_ids == expected.token_ids and second.finish_reason == expected.finish_reason
    assert (torch.tensor(second.logprobs) - torch.tensor(expected.logprobs)).abs().max() <= 1e-6
    full = history + second.token_ids
    ref = learner_logprobs(learner, full, len(history))
    assert (torch.tensor(second.logprobs) - ref).abs().max() <= 1e-6
    ref_first = learner_logprobs(learner, prompt + first.token_ids, len(prompt))
    assert (torch.tensor(first.logprobs) - ref_first).abs().max() <= 1e-6

    for s in (sid, busy):
        engine.close_session(s)
    fresh.close_session(again)
    for e in (engine, fresh):
        assert all(free == cap for free, cap in e.kv_blocks_free())
    with pytest.raises(EngineError, match="no open session"):
        engine.extend_session(sid, [1], 1)


def test_a_session_stops_on_its_stop_token_and_resumes(learner):
    engine = engine_of(learner, max_batch_slots=4, block_size=4)
    probe = engine.open_session([5, 6, 7], SamplingParams(max_new_tokens=8), seed=3)
    sampled = step_until(engine, probe).token_ids
    engine.close_session(probe)
    stop = sampled[3]
    cut = sampled[: sampled.index(stop) + 1]
    sid = engine.open_session([5, 6, 7], SamplingParams(max_new_tokens=8, stop_token_ids=[stop]), seed=3)
    turn = step_until(engine, sid)
    assert turn.token_ids == cut and turn.finish_reason == "stop"
    engine.extend_session(sid, [], max_new_tokens=2)  # resume without outside tokens
    assert len(step_until(engine, sid).token_ids) >= 1
    engine.close_session(sid)
    assert engine.step_sessions() == []


@pytest.mark.parametrize("graphs", ["off", "padded"])
def test_routing_record_equals_the_learners_routing(learner, graphs):
    """Eager steps record through the routers' hooks; bucketed decode steps ("padded": the graphs' buffers
    run eagerly) through the buckets' static buffers, which a replayed graph writes."""
    engine = engine_of(
        learner, record_routing=True, max_batch_slots=2, block_size=4, max_step_tokens=6, cuda_graphs=graphs
    )
    prompts = [[4, 8, 15, 16, 23, 42, 9, 1, 33], [2, 7]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=7, seed=2))
    if graphs == "padded":  # decode-only steps ran bucketed, each bucket with its routing buffers
        assert engine._graphs is not None and engine._graphs._buffers
        assert all(b.routing is not None for b in engine._graphs._buffers.values())
    routers = [layer.mlp.router for layer in learner.decoder.layers.values()]
    for out in outs:
        seq = torch.tensor(out.prompt_ids + out.token_ids[:-1])[None]
        seen: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o[2])) for r in routers]
        with torch.no_grad():
            learner.hidden_states(seq)
        for h in hooks:
            h.remove()
        expected = torch.stack(seen, dim=1)  # [tokens, layers, k]
        assert out.routing is not None and out.routing.dtype == torch.uint8
        assert out.routing.shape == (len(out.prompt_ids) + len(out.token_ids) - 1, CONFIG.num_layers, 2)
        assert torch.equal(out.routing.long(), expected)
    assert engine_of(learner).generate(prompts, SamplingParams(max_new_tokens=2))[0].routing is None


def test_routing_record_of_256_experts_keeps_expert_255_apart_from_the_no_route_mark():
    config = gpt_oss_tiny(num_experts=256)
    model = build_model(config, seed=5)
    with torch.no_grad():
        for layer in model.decoder.layers.values():
            layer.mlp.router.bias[255] = 100.0  # expert 255 is every token's first choice
    engine = EmbeddedEngine(config, seed=0, options=EmbeddedEngineConfig(record_routing=True))
    engine.update_weights(iter_hf_tensors(model, config))
    (out,) = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=3, seed=0))
    assert out.routing is not None and out.routing.dtype == routing_dtype(256) == torch.int16
    assert (out.routing[..., 0] == 255).all() and no_route(out.routing.dtype) == -1


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_cache_and_wake_restores_generation(learner, level):
    engine = engine_of(learner, max_batch_slots=2, block_size=4)
    params = SamplingParams(max_new_tokens=5, seed=9)
    before = engine.generate([[1, 2, 3], [4, 5]], params)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    cache = engine._cache  # a stray reference (e.g. a stored traceback's frames) must not keep its memory
    released = engine.sleep(level)
    assert released["weight_bytes"] == weight_bytes and released["kv_cache_bytes"] > 0
    assert cache is not None and cache.storage_bytes() == 0
    assert engine.kv_blocks_free() == []
    if level == 2:
        assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineError, match="sleeps"):
        engine.generate([[1]], params)
    engine.wake_up()
    if level == 2:
        with pytest.raises(EngineError, match="update_weights"):
            engine.generate([[1]], params)
        engine.update_weights(iter_hf_tensors(learner, CONFIG))
    after = engine.generate([[1, 2, 3], [4, 5]], params)
    assert [a.token_ids for a in after] == [b.token_ids for b in before]
    engine.open_session([1, 2], params, seed=0)
    with pytest.raises(EngineError, match="open session"):
        engine.sleep()


def run_sessions(learner, graphs: str, ahead: bool = True) -> list[tuple]:
    """Three sessions with stop tokens, each extended twice with tool tokens, then closed: every turn."""
    engine = engine_of(
        learner, max_batch_slots=3, block_size=4, max_step_tokens=8, cuda_graphs=graphs, decode_ahead=ahead
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=7, stop_token_ids=[5, 17, 33, 60])
    prompts = [[3, 14, 15, 92], [2, 71, 82, 81, 8, 28], [1, 61, 80]]
    turns_of = {engine.open_session(p, params, seed=50 + i): 0 for i, p in enumerate(prompts)}
    record = []
    while turns_of:
        for turn in engine.step_sessions():
            record.append((turn.session_id, turn.token_ids, turn.logprobs, turn.finish_reason))
            turns_of[turn.session_id] += 1
            if turns_of[turn.session_id] < 3:
                engine.extend_session(turn.session_id, [9, 9, 4 + turns_of[turn.session_id]], 5)
            else:
                engine.close_session(turn.session_id)
                del turns_of[turn.session_id]
    assert all(free == cap for free, cap in engine.kv_blocks_free())
    return record


@pytest.mark.parametrize("launch", [True, False], ids=["launched-ahead", "planned-ahead"])
def test_sessions_planned_ahead_in_bucketed_steps_equal_sessions_planned_each_step(
    learner, monkeypatch, launch
):
    """Decode steps in bucketed buffers plan the next step while they run (the path of decode graphs on a
    GPU), and launch it before their tokens are read (`decode_ahead`: a row that paused meanwhile has its
    extra token dropped) or take it where no row stopped; turns ending on stop tokens, extensions and closes
    drop such plans. Every turn equals the one of steps planned one at a time."""
    taken, launched = spy_on_steps_ahead(monkeypatch)
    ahead = run_sessions(learner, "padded", launch)
    assert sum(step is not None for step in (launched if launch else taken)) >= 5
    assert launch or not launched
    eager = run_sessions(learner, "off")
    assert [r[0] for r in ahead] == [r[0] for r in eager]
    assert any(r[3] == "stop" for r in ahead) and any(r[3] == "length" for r in ahead)
    for (_, tokens, logprobs, reason), (_, ref_tokens, ref_logprobs, ref_reason) in zip(ahead, eager):
        assert tokens == ref_tokens and reason == ref_reason
        assert (torch.tensor(logprobs) - torch.tensor(ref_logprobs)).abs().max() <= 1e-6
