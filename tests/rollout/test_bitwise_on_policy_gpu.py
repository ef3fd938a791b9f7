"""Bitwise on-policy mode on a GPU in bf16: the engine's decode logits (eager steps) and its reported
log-probs (CUDA-graph steps too) equal the learner's packed training forward bit for bit at every sampled
position of a batch of mixed lengths, with more prompts than slots and chunked prefill."""

import pytest
import torch
from test_bitwise_on_policy import OPTIONS, PARAMS, PROMPTS, compare, make_learner

from megatron_gptoss.ops import batch_invariant

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def learner():
    return make_learner("cuda", torch.bfloat16)


def test_decode_logits_equal_training_logits_bf16(learner):
    with batch_invariant.enabled():
        assert all(compare(learner, PROMPTS, PARAMS, True, cuda_graphs="off", **OPTIONS))


def test_graph_decode_logprobs_equal_training_bf16(learner):
    with batch_invariant.enabled():
        assert all(compare(learner, PROMPTS, PARAMS, False, **OPTIONS))
    assert not all(compare(learner, PROMPTS, PARAMS, False, **OPTIONS))
