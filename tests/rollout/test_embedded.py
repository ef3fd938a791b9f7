"""The embedded engine: its log-probs equal the learner's, sampling options, stop tokens, weight updates."""

import pytest
import torch

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model, token_logprobs
from megatron_gptoss.rollout import EmbeddedEngine, RolloutEngine, SamplingParams, sample_from_logits


def learner_and_engine(seed=0, **overrides):
    cfg = gpt_oss_tiny(attention_backend="eager", **overrides)
    learner = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    engine = EmbeddedEngine(cfg, seed=seed)
    engine.update_weights(iter_hf_tensors(learner, cfg))
    return learner, engine


def learner_logprobs(model, generation, temperature):
    ids = torch.tensor(generation.prompt_ids + generation.token_ids)[None]
    hidden = model.hidden_states(ids[:, :-1])
    lp = token_logprobs(hidden, model.output_weight(), ids[:, 1:], temperature=temperature)[0]
    return lp[len(generation.prompt_ids) - 1 :]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_learner_logprobs(temperature):
    learner, engine = learner_and_engine()
    assert isinstance(engine, RolloutEngine)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (3, 9, 5, 14)]
    params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=11)
    outs = engine.generate(prompts, params)
    assert sum(len(o.token_ids) for o in outs) > 40  # long enough to cross the sliding window (8)
    with torch.no_grad():
        for out in outs:
            ref = learner_logprobs(learner, out, temperature)
            diff = (torch.tensor(out.logprobs) - ref).abs().max().item()
            assert diff <= 1e-6, diff


def test_stop_tokens_and_max_tokens():
    _, engine = learner_and_engine(1)
    prompts = [[1, 2, 3], [4, 5]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, seed=0))
    stop = outs[0].token_ids[2]
    outs2 = engine.generate(prompts, SamplingParams(max_new_tokens=30, seed=0, stop_token_ids=[stop]))
    first = outs2[0].token_ids
    assert first[-1] == stop and stop not in first[:-1] and outs2[0].finish_reason == "stop"
    assert first == outs[0].token_ids[: len(first)]  # same seed: same samples until the stop
    assert all(
        len(o.token_ids) == 30 and o.finish_reason == "length" for o in outs if stop not in o.token_ids
    )


def test_top_k_and_top_p_restrict_sampling_but_not_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 10, generator=gen)
    logits[:] = logits[0]  # same distribution on every row
    probs = torch.softmax(logits[0], -1)
    top3 = set(torch.topk(probs, 3).indices.tolist())
    tokens, lp = sample_from_logits(logits, SamplingParams(top_k=3), gen)
    assert set(tokens.tolist()) <= top3 and len(set(tokens.tolist())) == 3
    assert torch.allclose(lp, torch.log(probs)[tokens])  # log-probs of the untruncated distribution
    order = torch.argsort(probs, descending=True)
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    tokens, _ = sample_from_logits(logits, SamplingParams(top_p=0.6), gen)
    assert set(tokens.tolist()) == nucleus


def test_update_weights_changes_generation_and_rejects_bad_tensors():
    learner, engine = learner_and_engine(2)
    prompts = [[5, 6, 7]]
    before = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=4))[0]
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.5)
    engine.update_weights(iter_hf_tensors(learner, learner.config))
    after = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=4))[0]
    assert before.logprobs != after.logprobs
    ref = learner_logprobs(learner, after, 1.0)
    assert (torch.tensor(after.logprobs) - ref).abs().max() <= 1e-6
    bad = [("model.layers.0.self_attn.o_proj.weight", torch.zeros(3, 3))]
    with pytest.raises(CheckpointError, match="o_proj.weight"):
        engine.update_weights(bad, strict=False)


def test_step_stats_count_the_steps_and_reset():
    """Four prompts prefilled in one step, then one decode step per further token; the counts are exact
    and `take_stats` starts them afresh."""
    _, engine = learner_and_engine(4)
    prompts = [[1] * 3, [2] * 9, [3] * 5, [4] * 14]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=0))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = engine.take_stats()
    assert stats["engine/steps"] == 12 and stats["engine/decode_steps"] == 11
    assert stats["engine/decode_rows_mean"] == 4 and stats["engine/prefill_tokens"] == 31
    assert stats["engine/prefill_steps"] == 1
    assert stats["engine/graph_frac"] == 0  # the CPU runs its steps eagerly
    assert stats["engine/graph_captures"] == 0 and stats["time/engine_capture_s"] == 0
    assert 0 < stats["time/engine_prefill_s"] < stats["time/engine_step_s"]
    assert stats["time/engine_decode_step_ms"] * 11 == pytest.approx(
        1e3 * (stats["time/engine_step_s"] - stats["time/engine_prefill_s"])
    )
    assert engine.take_stats() == {}
