"""Chunked per-token log-probs / entropy against a direct float64 computation; peak memory per chunk."""

import pytest
import torch
from helpers.hf_reference import rel_err

from megatron_gptoss.model import logprobs, token_logprobs


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

    lp, ent = token_logprobs(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk, with_entropy=True
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, temperature)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert rel_err(lp, ref_lp) <= 1e-6
    assert rel_err(ent, ref_ent) <= 1e-6
    assert rel_err(hidden.grad, h64.grad) <= 1e-5
    assert rel_err(weight.grad, w64.grad) <= 1e-5


def test_cpu_chunks_are_capped_by_the_cache_budget(monkeypatch):
    """On the CPU a chunk holds at most CPU_CHUNK_ELEMENTS logits (here 3 rows of a 50-way layer) whatever
    chunk_size asks, in reused buffers: the log-probs, entropy and gradients still match float64, with a
    last chunk shorter than the buffers."""
    monkeypatch.setattr(logprobs, "CPU_CHUNK_ELEMENTS", 3 * 50 + 7)
    seen = []
    real = logprobs._chunk_logp
    monkeypatch.setattr(logprobs, "_chunk_logp", lambda h, *a: seen.append(h.shape[0]) or real(h, *a))
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (10,), generator=gen)
    g_lp, g_ent = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    lp, ent = token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=1024, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert seen == [3, 3, 3, 1] * 2  # forward, then the backward's recomputation
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, 0.9)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert rel_err(lp, ref_lp) <= 1e-6 and rel_err(ent, ref_ent) <= 1e-6
    assert rel_err(hidden.grad, h64.grad) <= 1e-5 and rel_err(weight.grad, w64.grad) <= 1e-5


@pytest.mark.parametrize("read", ["logprobs", "entropy"])
def test_an_output_the_loss_does_not_read_drops_its_gradient_term(read):
    """A loss of the log-probs alone (SFT) or of the entropy alone: the backward skips the other output's term
    and still matches float64."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=gen)
    g = torch.randn(2, 9, generator=gen)
    lp, ent = token_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=5, with_entropy=True)
    ((lp if read == "logprobs" else ent) * g).sum().backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, 0.8)
    ((ref_lp if read == "logprobs" else ref_ent) * g.double()).sum().backward()
    assert rel_err(hidden.grad, h64.grad) <= 1e-5
    assert rel_err(weight.grad, w64.grad) <= 1e-5


_PEAK_SCRIPT = """
import resource, sys, torch
from megatron_gptoss.model import token_logprobs
torch.set_num_threads(1)
tokens, vocab, hidden_size, chunk, mode = 4096, 8192, 8, 128, sys.argv[1]
gen = torch.Generator().manual_seed(1)
h = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
w = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
t = torch.randint(0, vocab, (tokens,), generator=gen)
def step(h, w, t):
    if mode == "chunked":
        lp, ent = token_logprobs(h, w, t, chunk_size=chunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    else:
        logp = torch.log_softmax(h @ w.t(), dim=-1)
        (logp.gather(-1, t[:, None]).sum() - (logp.exp() * logp).sum()).backward()
step(h[:8], w[:64], t[:8] % 64)  # first calls initialise kernels and thread pools: keep them out
def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
try:  # reset the peak to the current resident set: earlier transients (imports) do not hide the step's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kb("VmRSS")
    step(h, w, t)
    print((status_kb("VmHWM") - before) * 1024)
except OSError:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(h, w, t)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def _peak_growth_bytes(mode: str) -> int:
    """Growth of the process's peak resident memory over one forward + backward, in a fresh process."""
    import os
    import subprocess
    import sys

    # Large blocks get their own mappings, so freed memory leaves the resident set at once and the
    # peak measures live tensors rather than glibc's heap growth.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, mode], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_one_chunk_forward_and_backward():
    full_logits_bytes = 4096 * 8192 * 4  # 128 MiB of [tokens, vocab] fp32
    chunk_bytes = 128 * 8192 * 4  # 4 MiB per chunk
    chunked = _peak_growth_bytes("chunked")
    unchunked = _peak_growth_bytes("unchunked")
    # A few [chunk, vocab] temporaries of one chunk (logits, softmax, gradient) and allocator slack:
    # bounded by a constant number of chunks, independent of the token count, far below [tokens, vocab].
    assert chunked <= 12 * chunk_bytes < full_logits_bytes / 2, (chunked, chunk_bytes)
    # The measurement does see a full materialisation (the allocator may reuse some freed memory).
    assert unchunked >= full_logits_bytes / 2 > 12 * chunk_bytes


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 2, 10]))


def test_a_frozen_head_skips_its_weight_gradient():
    """With the weight frozen (LoRA) the backward gives the same hidden-state gradient and runs no
    weight-gradient GEMM (no addmm in its profile; the trainable weight's run has one per chunk)."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(12, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (12,), generator=gen)
    g_lp, g_ent = torch.randn(12, generator=gen), torch.randn(12, generator=gen)
    runs = []
    for trainable in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(trainable)
        lp, ent = token_logprobs(h, w, targets, chunk_size=5, with_entropy=True)
        with profile() as prof:
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        addmm = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::addmm"))
        runs.append((h.grad, w.grad, addmm))
    (h_train, w_train, addmm_train), (h_frozen, w_frozen, addmm_frozen) = runs
    assert torch.equal(h_frozen, h_train)
    assert w_train is not None and w_frozen is None
    assert addmm_train == 3 and addmm_frozen == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pytorch-chunks"])
def test_bf16_half_gemms_match_fp32_gemms_gpu(fused):
    """bf16 hidden states and weights on CUDA (half-precision GEMMs, fp32 accumulation, split logit
    gradient: from the fused kernel or from the PyTorch chunks) against the same bf16 values computed with
    fp32 GEMMs: log-probs and entropy to fp32 rounding, gradients well inside their bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 2880, generator=gen).cuda().bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(4096, 2880, generator=gen)).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, 4096, (2048,), generator=gen).cuda()
    g_lp, g_ent = torch.randn(2048, generator=gen).cuda(), torch.randn(2048, generator=gen).cuda()
    results = []
    for h, w in ((hidden, weight), (hidden.float(), weight.float())):
        lp, ent = token_logprobs(h, w, targets, chunk_size=512, with_entropy=True, fused=fused)
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
        results.append((lp, ent, *grads))
    ours, ref = results
    assert rel_err(ours[0], ref[0]) <= 1e-6 and rel_err(ours[1], ref[1]) <= 1e-6
    assert rel_err(ours[2], ref[2]) <= 3e-3 and rel_err(ours[3], ref[3]) <= 3e-3


def test_negative_targets_skip_the_head_and_read_zero():
    """GPTOSSModel.token_logprobs: positions with target -1 read 0 (log-prob and entropy) and take no part
    in the gradient; the others equal the full computation, values and gradients."""
    from megatron_gptoss.config import gpt_oss_tiny
    from megatron_gptoss.model import build_model

    model = build_model(gpt_oss_tiny(), seed=3)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 9, model.config.hidden_size, generator=gen, requires_grad=True)
    targets = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    skip = torch.rand(2, 9, generator=gen) < 0.5
    w_lp, w_ent = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    grads = []
    for t in (targets, targets.masked_fill(skip, -1)):
        hidden.grad = None
        model.zero_grad()
        lp, ent = model.token_logprobs(hidden, t, temperature=0.7, chunk_size=4)
        lp, ent = lp.masked_fill(skip, 0.0), ent.masked_fill(skip, 0.0)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads.append((lp.detach(), ent.detach(), hidden.grad.clone(), model.output_layer.weight.grad.clone()))
    full, skipped = grads
    assert bool(skip.any()) and bool((~skip).any())
    for ours, ref in zip(skipped, full):
        assert rel_err(ours, ref) <= 1e-6
    lp, ent = model.token_logprobs(hidden.detach(), targets.masked_fill(skip, -1))
    assert bool((lp[skip] == 0).all()) and bool((ent[skip] == 0).all())
