"""Partial rollouts in the embedded engine: rows in flight when new weights arrive continue under them.

    recompute   the row's prefix is prefilled again with the new weights: its remainder's log-probs equal
                the new model's log-probs of the whole sequence, teacher-forced (within 1e-6)
    keep        the prefix's cache stays as the old weights computed it: the remainder's log-probs equal a
                reference that fills a contiguous KV cache with the old model up to the switch and runs the
                new model on the rest over that cache (within 1e-6)

Every sampled token records the policy version of the weights that sampled it."""

from __future__ import annotations

import pytest
import torch
from helpers.embedded_engine import CONFIG, engine_of, kept_prefix_logprobs, perturbed_learner

from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors

PROMPTS = [[3, 17, 5, 9, 11], [4, 8, 15, 16, 23, 42, 7]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234)
BEFORE = 5  # engine steps under the old weights (the prompts' prefill, then 4 decode steps)


def _switch(kv: str):
    """Generate PROMPTS, switching from the weights of seed 0 to those of seed 7 after BEFORE steps; the
    generations, the number of tokens each row had in its cache at the switch, and both models."""
    old, new = perturbed_learner(0), perturbed_learner(7)
    engine = engine_of(old)
    engine.policy_version = 3
    rows = engine.start(PROMPTS, PARAMS)
    engine.advance(BEFORE)
    computed = [row.computed for row in rows]
    assert all(0 < c < len(row.tokens) + row.budget for c, row in zip(computed, rows))  # mid-row
    engine.update_weights(iter_hf_tensors(new, CONFIG))
    engine.policy_version = 4
    if kv == "recompute":
        assert engine.recompute_in_flight() == len(rows)
    return engine.finish(rows), computed, old, new


@torch.no_grad()
def _teacher_forced(model, tokens: list[int]) -> list[float]:
    ids = torch.tensor([tokens])
    hidden = model.hidden_states(ids[:, :-1])
    return model.token_logprobs(hidden, ids[:, 1:])[0][0].tolist()


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_row_continues_under_new_weights(kv):
    generations, computed, old, new = _switch(kv)
    for prompt, gen, switch in zip(PROMPTS, generations, computed):
        tokens = prompt + gen.token_ids
        before = switch - len(prompt) + 1  # response tokens sampled before the switch
        assert gen.versions == [3] * before + [4] * (len(gen.token_ids) - before)
        assert len(gen.token_ids) > before, "nothing was sampled under the new weights"
        # what the old weights sampled: their own teacher-forced log-probs
        old_lp = _teacher_forced(old, tokens)[len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(gen.logprobs[:before], old_lp[:before])) <= 1e-6
        if kv == "recompute":
            ref = _teacher_forced(new, tokens)[len(prompt) - 1 :]
        else:
            ref = kept_prefix_logprobs(old, new, tokens, switch)[len(prompt) - 1 :]
            # the kept prefix is not the new weights' own: the remainder differs from a recomputed one
            own = _teacher_forced(new, tokens)[len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(ref[before:], own[before:])) > 1e-4
        assert max(abs(a - b) for a, b in zip(gen.logprobs[before:], ref[before:])) <= 1e-6, kv
