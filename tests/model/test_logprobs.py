"""Chunked per-token log-probs / entropy against a direct float64 computation; peak memory per chunk."""

import pytest
import torch
from hf_reference import rel_err

from megatron_gptoss.model import token_logprobs


def reference(hidden, weight, targets, temperature):
    logits = (hidden.double() @ weight.double().t()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 64), (1.3, 1)])
def test_logprobs_entropy_and_grads_match_float64(temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    g_lp, g_ent = torch.randn(3, 11, generator=gen), torch.randn(3, 11, generator=gen)

    lp, ent = token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, temperature)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert rel_err(lp, ref_lp) <= 1e-6
    assert rel_err(ent, ref_ent) <= 1e-6
    assert rel_err(hidden.grad, h64.grad) <= 1e-5
    assert rel_err(weight.grad, w64.grad) <= 1e-5


def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU bytes allocated inside `fn`, from the profiler's allocation timeline."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    # Ops report what they allocate as self memory, frees come as "[memory]" events; replay in time order.
    for e in sorted(prof.profiler.function_events, key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_peak_memory_is_one_chunk_forward_and_backward():
    tokens, vocab, hidden_size, chunk = 1024, 4096, 8, 64
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    full_logits_bytes = tokens * vocab * 4
    chunk_bytes = chunk * vocab * 4

    def chunked():
        lp, ent = token_logprobs(hidden, weight, targets, chunk_size=chunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()

    def unchunked():
        logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
        (logp.gather(-1, targets[:, None]).sum() - (logp.exp() * logp).sum()).backward()

    peak = _peak_cpu_bytes(chunked)
    baseline = _peak_cpu_bytes(unchunked)
    # A handful of [chunk, vocab] temporaries may be alive at once; never anything of [tokens, vocab] size.
    assert peak <= 8 * chunk_bytes < full_logits_bytes, (peak, chunk_bytes)
    assert baseline >= full_logits_bytes  # the measurement sees a full materialisation when there is one


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 2, 10]))
