"""The sampled softmax of supervised steps (model.sampled_softmax): with every row drawn it is the full
softmax; its normaliser estimates the full one; the gradient stays on the sampled rows; bad input fails."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gptoss.model.logprobs import token_logprobs
from megatron_gptoss.model.sampled_softmax import VocabSample, draw_vocab_sample, sampled_token_logprobs

V, H = 50, 8


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, H, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (2, 5), generator=g)
    targets[0, 0] = -1  # a position nobody reads
    return hidden, weight, targets


def test_draw_keeps_every_target_and_draws_the_rest_uniformly():
    targets = torch.tensor([[3, 7, -1], [7, 40, 3]])
    sample = draw_vocab_sample(targets, V, 10, torch.Generator().manual_seed(0))
    ids = sample.ids.tolist()
    assert ids == sorted(ids) and len(set(ids)) == 13 and {3, 7, 40} <= set(ids)
    drawn = sample.log_weight != 0
    assert drawn.sum() == 10 and not drawn[sample.ids == 3].any()
    assert torch.allclose(sample.log_weight[drawn], torch.tensor(math.log(47 / 10)))
    again = draw_vocab_sample(targets, V, 10, torch.Generator().manual_seed(0))
    assert torch.equal(again.ids, sample.ids)  # a pure function of the generator's state


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_every_row_drawn_is_the_full_softmax(temperature):
    hidden, weight, targets = _inputs()
    sample = draw_vocab_sample(targets, V, V, torch.Generator().manual_seed(1))
    assert sample.ids.tolist() == list(range(V)) and not sample.log_weight.any()
    lp, ent = sampled_token_logprobs(hidden, weight, targets, sample, temperature)
    ref_lp, ref_ent = token_logprobs(
        hidden, weight, targets.clamp_min(0), temperature=temperature, with_entropy=True
    )
    keep = targets >= 0
    assert torch.allclose(lp[keep], ref_lp[keep], atol=1e-5) and (lp[~keep] == 0).all()
    assert torch.allclose(ent[keep], ref_ent[keep], atol=1e-5)
    (g_lp,) = torch.autograd.grad(lp.sum(), weight)
    (g_ref,) = torch.autograd.grad((ref_lp * keep).sum(), weight)
    assert torch.allclose(g_lp, g_ref, atol=1e-5)


def test_normaliser_estimates_the_full_one_and_gradient_stays_on_the_sample():
    hidden, weight, targets = _inputs()
    full = token_logprobs(hidden, weight, targets.clamp_min(0))
    g = torch.Generator().manual_seed(2)
    draws = [draw_vocab_sample(targets, V, 12, g) for _ in range(400)]
    # E over draws of exp(-log q) = E[Z_sampled] / exp(z_t) = Z / exp(z_t) = exp(-log p)
    mean = torch.stack([sampled_token_logprobs(hidden, weight, targets, s)[0].neg().exp() for s in draws])
    keep = targets >= 0
    ratio = mean.mean(0)[keep] / full.neg().exp()[keep]
    assert ((ratio - 1).abs() < 0.1).all(), ratio
    lp, _ = sampled_token_logprobs(hidden, weight, targets, draws[0])
    (grad,) = torch.autograd.grad(lp.sum(), weight)
    outside = torch.ones(V, dtype=torch.bool)
    outside[draws[0].ids] = False
    assert (grad[outside] == 0).all() and grad[draws[0].ids].abs().sum() > 0


def test_bad_input_is_named():
    hidden, weight, targets = _inputs()
    missing = VocabSample(torch.tensor([0, 1]), torch.zeros(2))
    with pytest.raises(ValueError, match="not in the vocabulary sample"):
        sampled_token_logprobs(hidden, weight, targets, missing)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draw_vocab_sample(torch.tensor([V]), V, 3, torch.Generator())
    with pytest.raises(ValueError, match="at least one row"):
        draw_vocab_sample(targets, V, 0, torch.Generator())


def test_config_refuses_a_sampled_softmax_under_tensor_parallel():
    from megatron_gptoss.config import load_config
    from megatron_gptoss.errors import ConfigError

    assert load_config(None, ["model.preset=gpt_oss_tiny", "sft.sampled_vocab=8"]).sft.sampled_vocab == 8
    with pytest.raises(ConfigError, match="sampled_vocab"):
        load_config(None, ["model.preset=gpt_oss_tiny", "sft.sampled_vocab=-1"])
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=1"):
        load_config(
            None,
            ["model.preset=gpt_oss_tiny", "sft.sampled_vocab=8", "parallel.tensor_model_parallel_size=2"],
        )
