"""The fused head (`ops.fused_logprobs`): the rows' log-prob, entropy and normaliser, and the logits'
gradient, against float64 on fresh random logits; `token_logprobs` with the fused chunks against float64
and against its PyTorch chunks. CPU tensors under the Triton interpreter, or a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import rel_err
from helpers.triton_cpu import needs_triton

from megatron_gptoss.model import logprobs, token_logprobs
from megatron_gptoss.ops import fused_logprobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_stats(z, targets, inv_temp):
    logp = torch.log_softmax(z.double() * inv_temp, dim=-1)
    lse = torch.logsumexp(z.double() * inv_temp, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1), lse


def logits(rows, vocab, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * scale
    z[0] += 40.0 * torch.nn.functional.one_hot(torch.tensor(3), vocab)  # a peaked row: entropy near 0
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return z.to(DEVICE), targets.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("block", [None, 64])  # 64: several steps per row, the running max rescaled
@pytest.mark.parametrize("vocab,inv_temp,scale", [(300, 1.0, 3.0), (257, 1 / 0.7, 12.0), (50, 1.3, 1.0)])
def test_row_stats_match_float64(monkeypatch, block, vocab, inv_temp, scale):
    if block is not None:
        monkeypatch.setattr(fused_logprobs, "_BLOCK_V", block)
    z, targets = logits(9, vocab, scale, seed=vocab)
    lp, ent, lse = fused_logprobs.row_stats(z, targets, inv_temp)
    ref_lp, ref_ent, ref_lse = reference_stats(z, targets, inv_temp)
    assert rel_err(lp, ref_lp) <= 1e-6
    assert rel_err(lse, ref_lse) <= 1e-6
    assert rel_err(ent, ref_ent) <= 2e-6
    assert float((ent[0] - ref_ent[0]).abs()) <= 1e-6  # the peaked row: no cancellation


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("terms", ["both", "logprob", "entropy"])
def test_logit_grad_matches_float64(monkeypatch, out_dtype, terms):
    monkeypatch.setattr(fused_logprobs, "_BLOCK_V", 64)
    vocab, inv_temp = 200, 1 / 0.8
    z, targets = logits(6, vocab, 4.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    g_lp = torch.randn(6, generator=gen).to(DEVICE) if terms != "entropy" else None
    g_ent = torch.randn(6, generator=gen).to(DEVICE) if terms != "logprob" else None
    z64 = z.double().requires_grad_()
    ref_lp, ref_ent, _ = reference_stats(z64, targets, inv_temp)
    loss = sum((g.double() * v).sum() for g, v in ((g_lp, ref_lp), (g_ent, ref_ent)) if g is not None)
    (ref,) = torch.autograd.grad(loss, z64)
    _, ent, lse = fused_logprobs.row_stats(z, targets, inv_temp)
    width = vocab * (2 if out_dtype == torch.bfloat16 else 1)
    out = torch.empty(6, width, dtype=out_dtype, device=DEVICE)
    fused_logprobs.logit_grad(z, targets, lse, ent, g_lp, g_ent, inv_temp, out)
    ours = out.float() if out_dtype == torch.float32 else out[:, :vocab].float() + out[:, vocab:].float()
    # hi + lo: each term rounded to bf16 (the interpreter's casts truncate: up to 2^-16 relative)
    assert rel_err(ours, ref) <= (2e-6 if out_dtype == torch.float32 else 2e-5)
    if out_dtype == torch.bfloat16:  # hi alone is the bf16 rounding; lo carries the rest
        assert rel_err(out[:, :vocab].float(), ref) > 1e-4


@needs_triton
def test_bad_shapes_are_named():
    z, targets = logits(4, 32, 1.0, seed=0)
    with pytest.raises(ValueError, match="fp32"):
        fused_logprobs.row_stats(z.double(), targets)
    with pytest.raises(ValueError, match="int64"):
        fused_logprobs.row_stats(z, targets.int())
    _, ent, lse = fused_logprobs.row_stats(z, targets)
    with pytest.raises(ValueError, match="out must be"):
        fused_logprobs.logit_grad(
            z, targets, lse, ent, ent, None, 1.0, torch.empty_like(z, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match="needs grad_logprob"):
        fused_logprobs.logit_grad(z, targets, lse, ent, None, None, 1.0, torch.empty_like(z))


@needs_triton
@pytest.mark.parametrize("budget", [None, 5 * 50])  # None: one chunk; 5 rows of 50 logits: 7 chunks
def test_token_logprobs_fused_matches_float64_and_the_torch_chunks(monkeypatch, budget):
    if budget is not None:
        monkeypatch.setattr(logprobs, "GPU_CHUNK_ELEMENTS", budget)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 11, 16, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(50, 16, generator=gen).to(DEVICE).requires_grad_()
    targets = torch.randint(0, 50, (3, 11), generator=gen).to(DEVICE)
    g_lp, g_ent = (torch.randn(3, 11, generator=gen).to(DEVICE) for _ in range(2))
    runs = []
    for fused in (True, False):
        lp, ent = token_logprobs(
            hidden, weight, targets, temperature=0.7, chunk_size=1, with_entropy=True, fused=fused
        )
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        runs.append((lp, ent, *grads))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax((h64 @ w64.t()) / 0.7, dim=-1)
    ref_lp, ref_ent = logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ref = (ref_lp, ref_ent, *torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (h64, w64)))
    for fused_t, torch_t, ref_t, tol in zip(*runs, ref, (1e-6, 1e-6, 1e-5, 1e-5), strict=True):
        assert rel_err(fused_t, ref_t) <= tol
        assert rel_err(fused_t, torch_t) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_token_logprobs_fused_bf16_matches_the_torch_chunks_gpu():
    """bf16 at a gpt-oss width on CUDA: the fused chunks (one chunk here) against the PyTorch chunks of the
    same half GEMMs: log-probs and entropy to fp32 rounding, gradients to their bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4096, 2880, generator=gen).cuda().bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(2048, 2880, generator=gen)).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, 2048, (4096,), generator=gen).cuda()
    g_lp, g_ent = torch.randn(4096, generator=gen).cuda(), torch.randn(4096, generator=gen).cuda()
    runs = []
    for fused in (True, False):
        lp, ent = token_logprobs(hidden, weight, targets, chunk_size=512, with_entropy=True, fused=fused)
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        runs.append((lp, ent, *grads))
    (lp, ent, gh, gw), (lp0, ent0, gh0, gw0) = runs
    assert rel_err(lp, lp0) <= 1e-6 and rel_err(ent, ent0) <= 1e-6
    assert rel_err(gh, gh0) <= 8e-3 and rel_err(gw, gw0) <= 8e-3
