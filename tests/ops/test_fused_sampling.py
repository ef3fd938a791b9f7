"""The fused seeded sampler (`ops.fused_sampling`) against the PyTorch path of
`rollout.sampling.sample_from_logits` on the same uniforms: CPU under the Triton interpreter, and a CUDA GPU
at the vocabulary's width (`gpu`)."""

from __future__ import annotations

import pytest
import torch
from helpers.triton_cpu import needs_triton

from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.ops import fused_sampling
from megatron_gptoss.rollout import sampling
from megatron_gptoss.rollout.sampling import counter_uniform, sample_from_logits


def draws(rows: int, vocab: int, temperature: float, device: str, seed: int = 0):
    """(fused tokens, fused log-probs, reference tokens, reference log-probs) on fresh random logits: the
    reference is the PyTorch path (the CPU, fp32) at the same row seeds and counters."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, vocab // 2 :] -= 8  # most of the mass on the first half, a long tail after it
    logits[0, :-1] = -1e4  # a row with all its mass on the last token (the search's last block)
    seeds, counters = 100 + torch.arange(rows), torch.randint(0, 500, (rows,), generator=g)
    params = SamplingParams(temperature=temperature, seed=100)
    ref = sample_from_logits(logits, params, None, seeds, counters)
    uniforms = counter_uniform(seeds, counters).float()
    ours = fused_sampling.seeded_sample(logits.to(device), uniforms.to(device), temperature)
    return ours[0].cpu(), ours[1].cpu(), ref[0], ref[1]


@needs_triton
@pytest.mark.parametrize("vocab,temperature", [(5000, 1.0), (4096, 0.7), (300, 1.3)])
def test_fused_draws_equal_the_torch_path(vocab, temperature):
    """Same tokens on every row (partial and whole last blocks, one block, a one-token row), log-probs within
    fp32 rounding of the PyTorch log-softmax."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, logp, ref_tokens, ref_logp = draws(48, vocab, temperature, device)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(tokens, ref_tokens)
    assert tokens[0] == vocab - 1
    assert float((logp - ref_logp).abs().max()) < 2e-5
    assert float((logp - ref_logp).norm() / ref_logp.norm()) < 1e-6


@needs_triton
def test_fused_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 1500
    logits = probs.clamp_min(1e-30).log().expand(rows, -1).contiguous()
    uniforms = counter_uniform(7 + torch.arange(rows), 0).float()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, logp = fused_sampling.seeded_sample(logits.to(device), uniforms.to(device), 1.0)
    freq = torch.bincount(tokens.cpu(), minlength=5).double() / rows
    assert float((freq - probs.double()).abs().max()) < 0.04, freq
    assert int(tokens.max()) <= 3  # never the token of zero mass
    assert torch.allclose(logp.cpu(), probs.clamp_min(1e-30).log()[tokens.cpu()], atol=1e-6)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"logits must be \[B, V\] and uniforms \[B\]"):
        fused_sampling.seeded_sample(torch.zeros(3, 10), torch.zeros(2), 1.0)


def test_sample_from_logits_takes_the_kernel_only_where_it_applies(monkeypatch):
    """CUDA, seeded, untruncated, batch-invariant mode off: the kernel; top-k, top-p or unseeded: PyTorch."""
    calls = []

    def fake(logits, uniforms, temperature):
        calls.append(temperature)
        return torch.zeros(logits.shape[0], dtype=torch.long), torch.zeros(logits.shape[0])

    class CudaLike(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(sampling.fused_sampling, "seeded_sample", fake)
    logits = torch.randn(3, 20).as_subclass(CudaLike)
    seeds = torch.arange(3)
    sample_from_logits(logits, SamplingParams(temperature=0.5, seed=1), None, seeds)
    assert calls == [0.5]
    sample_from_logits(logits, SamplingParams(seed=1, top_k=5), None, seeds)
    sample_from_logits(logits, SamplingParams(seed=1, top_p=0.9), None, seeds)
    sample_from_logits(logits, SamplingParams(), torch.Generator().manual_seed(0))
    sample_from_logits(torch.randn(3, 20), SamplingParams(seed=1), None, seeds)  # a CPU tensor
    assert calls == [0.5]
