"""Per-token log-probs and entropy of given tokens, chunked so that at most one [chunk, vocab] block of
logits exists at a time, in the forward and in the backward (which recomputes each chunk).

Convention (docs/architecture.md): logprob_t = log_softmax(logits_t / T)[token_t] with T the sampling
temperature, before any top-k/top-p truncation; entropy_t is that of softmax(logits_t / T). Computed in fp32.

GEMMs of bf16/fp16 hidden states and weights on CUDA run on the half-precision tensor cores with fp32
accumulation and fp32 output: the logits are those of the fp32 GEMM (products of half values are exact
in fp32). The backward's fp32 logit gradient is split into two half-precision terms (hi + lo, relative
residual below 2^-17) for its two GEMMs; elsewhere every GEMM runs in fp32.

On CUDA (with Triton, outside the batch-invariant mode) the elementwise work of a chunk is two kernels
(`ops.fused_logprobs`: the rows' statistics in the forward, the logits' gradient in the backward) and a chunk
holds up to `GPU_CHUNK_ELEMENTS` logits, so a small vocabulary takes the whole batch in one chunk.
"""

from __future__ import annotations

import functools

import torch

from megatron_gptoss.ops import batch_invariant, fused_logprobs, fused_moe


@functools.cache
def _mm_out_dtype_supported() -> bool:
    """Whether this torch has `torch.mm(a, b, out_dtype)` for half inputs on CUDA."""
    try:
        a = torch.zeros(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def _half_gemms(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype_supported()


def fp32_logits(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """h [n, H] @ weight[V, H]^T in fp32 (the rollout engines' logits are computed the same way);
    batch-invariant while that mode is on. `out` (fp32 [n, V], optional): written there on the fp32 path."""
    if batch_invariant.active():
        return batch_invariant.invariant_linear(h, weight, out_dtype=torch.float32)
    if _half_gemms(h) and weight.dtype == h.dtype:
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return torch.mm(h.float(), weight.float().t(), out=out)


def normaliser(z: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """log sum exp over each row of z [n, V] fp32 -> [n, 1]: log_softmax(z) = z - normaliser(z) (the learner
    and, in bitwise on-policy mode, the engine's sampling); batch-invariant while that mode is on.
    `scratch` (z's shape, optional) holds exp(z - max) instead of a fresh temporary: torch.logsumexp's
    steps (max, with infinite maxima read as 0; exp of the difference; sum; log; + max) in place."""
    if batch_invariant.active():
        return batch_invariant.logsumexp_rows(z)[:, None]
    if scratch is None:
        return torch.logsumexp(z, dim=-1, keepdim=True)
    top = z.amax(dim=-1, keepdim=True)
    top.masked_fill_(top.abs() == float("inf"), 0.0)
    torch.sub(z, top, out=scratch).exp_()
    return scratch.sum(dim=-1, keepdim=True).log_().add_(top)


def split_logit_grad(dz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 dz [n, V] -> hi | lo [n, 2V] in dtype, hi + lo = dz up to a relative 2^-17: the half GEMMs'
    operand (`ops.fused_logprobs.logit_grad` writes the same layout)."""
    hi = dz.to(dtype)
    return torch.cat([hi, (dz - hi.float()).to(dtype)], 1)


def half_gemms(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the backward's GEMMs of these hidden states and weight run in half precision (CUDA, both in one
    16-bit dtype), the fp32 logit gradient split in two terms."""
    return _half_gemms(hidden) and weight.dtype == hidden.dtype


def backward_weight(weight: torch.Tensor, half: bool) -> torch.Tensor:
    """The weight as the backward's hidden-gradient GEMM reads it: [W; W] for the two half terms, else
    fp32."""
    return torch.cat([weight, weight]) if half else weight.float()


def accumulate_logit_grads(
    dz: torch.Tensor,
    h: torch.Tensor,
    wf: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """From one chunk's logit gradient, fp32 dz [n, V] or, for the half GEMMs, hi | lo [n, 2V] in h's dtype
    (`split_logit_grad`): write dz @ W into `grad_hidden` [n, H] and add dz^T @ h to the fp32 `grad_weight`
    [V, H], each when given (a frozen weight's GEMM is skipped). The half terms run on the half-precision
    tensor cores with fp32 accumulation: dz @ W = [hi, lo] @ [W; W] (`wf` from `backward_weight`) and
    dz^T @ h = [hi; lo]^T @ [h; h], one GEMM each."""
    if dz.dtype == torch.float32:
        if grad_hidden is not None:
            grad_hidden.copy_(dz @ wf)
        if grad_weight is not None:
            grad_weight.addmm_(dz.t(), h.float())
        return
    if grad_hidden is not None:
        grad_hidden.copy_(torch.mm(dz, wf, out_dtype=torch.float32))
    if grad_weight is not None:
        vocab = dz.shape[1] // 2
        stacked = torch.cat([dz[:, :vocab], dz[:, vocab:]])
        grad_weight += torch.mm(stacked.t(), torch.cat([h, h]), out_dtype=torch.float32)


def _chunk_logp(
    h: torch.Tensor,
    weight: torch.Tensor,
    inv_temp: float,
    lse: torch.Tensor | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """One chunk's (log_softmax [n, V], its normaliser [n, 1], scratch), fp32; `lse` given (the forward's):
    not recomputed. The log-softmax is written over the logits' own buffer: `buffers[0]` where given, with
    `buffers[1]` as the normaliser's scratch (both [n, V] fp32 of the chunk's rows); scratch is the chunk's
    rows of `buffers[1]` for the caller's next [n, V] temporary, or None."""
    out, scratch = (None, None) if buffers is None else (b[: h.shape[0]] for b in buffers)
    z = fp32_logits(h, weight, out)
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    if lse is None:
        lse = normaliser(z, scratch)
    return z.sub_(lse), lse, scratch


def _entropy(logp: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """-sum_v p log p per row of logp [n, V] -> [n]; p written into `out` (logp's shape) where given."""
    return torch.exp(logp, out=out).mul_(logp).sum(-1).neg_()


# On the CPU a chunk of at most this many logits (16 MB in fp32) stays in the last-level cache through the
# passes over it, and its buffers are allocated once per call (a fresh 16 MB temporary per pass costs its page
# faults): 2 cores, 484 rows of a 201,088-way layer of width 64, forward + backward 2.1 s at chunks of 1024
# rows with temporaries, 0.9 s at 20 rows in reused buffers.
CPU_CHUNK_ELEMENTS = 1 << 22


def _cpu_buffers(hidden: torch.Tensor, vocab: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two reusable fp32 [chunk, vocab] buffers for the chunks of a CPU call (logits, scratch), else None."""
    if hidden.device.type != "cpu" or batch_invariant.active() or not hidden.shape[0]:
        return None
    rows = min(chunk, hidden.shape[0])
    return tuple(torch.empty(rows, vocab, dtype=torch.float32) for _ in range(2))  # type: ignore[return-value]


# Logits per chunk of the fused path (512 MB in fp32; the backward holds a second block of that size).
GPU_CHUNK_ELEMENTS = 1 << 27


def _chunk_rows(chunk: int, hidden: torch.Tensor, vocab: int, fused: bool) -> int:
    if fused:
        return max(chunk, GPU_CHUNK_ELEMENTS // max(vocab, 1))
    if hidden.device.type != "cpu":
        return chunk
    return max(1, min(chunk, CPU_CHUNK_ELEMENTS // max(vocab, 1)))


def fused_available(hidden: torch.Tensor) -> bool:
    """Whether the head's chunks run `ops.fused_logprobs` by default: CUDA with Triton, outside the
    batch-invariant mode (whose reductions are its own)."""
    return hidden.is_cuda and not batch_invariant.active() and fused_moe.triton_available()


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk, fused):
        n = hidden.shape[0]
        chunk = _chunk_rows(chunk, hidden, weight.shape[0], fused)
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, 1, dtype=torch.float32)
        buffers = None if fused else _cpu_buffers(hidden, weight.shape[0], chunk)
        for s in range(0, n, chunk):
            if fused:
                z = fp32_logits(hidden[s : s + chunk], weight)
                stats = fused_logprobs.row_stats(z, targets[s : s + chunk], inv_temp)
                for out, value in zip((logprobs, entropy, lse), stats):
                    out[s : s + chunk] = value.view(out[s : s + chunk].shape)
                continue
            logp, lse[s : s + chunk], scratch = _chunk_logp(
                hidden[s : s + chunk], weight, inv_temp, None, buffers
            )
            logprobs[s : s + chunk] = logp.gather(1, targets[s : s + chunk, None]).squeeze(1)
            entropy[s : s + chunk] = _entropy(logp, scratch)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temp, ctx.chunk, ctx.fused = inv_temp, chunk, fused
        ctx.mark_non_differentiable(targets)
        ctx.set_materialize_grads(False)  # an output the loss does not read gets None: its term is skipped
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # a frozen head (LoRA) skips the weight's GEMM and its fp32 buffer
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        half = half_gemms(hidden, weight)
        wf = backward_weight(weight, half)
        buffers = None if ctx.fused else _cpu_buffers(hidden, weight.shape[0], chunk)
        for s in range(0, hidden.shape[0], chunk):
            rows = None if grad_hidden is None else grad_hidden[s : s + chunk]
            if ctx.fused:  # inv_temp applied; hi | lo [rows, 2V] for the half GEMMs, else fp32
                dz = _fused_chunk_grad(
                    ctx.saved_tensors, s, chunk, inv_temp, grad_logprobs, grad_entropy, half
                )
            else:
                dz = _chunk_grad(ctx.saved_tensors, s, chunk, inv_temp, grad_logprobs, grad_entropy, buffers)
                dz = split_logit_grad(dz.mul_(inv_temp), hidden.dtype) if half else dz.mul_(inv_temp)
            accumulate_logit_grads(dz, hidden[s : s + chunk], wf, rows, grad_weight)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _fused_chunk_grad(saved, s, chunk, inv_temp, grad_logprobs, grad_entropy, half):
    """The fused path's gradient w.r.t. the raw logits of one chunk (`fused_logprobs.logit_grad`): as hi | lo
    [rows, 2V] in the hidden states' dtype where `half`, else fp32 [rows, V] over the recomputed logits."""
    hidden, weight, targets, lse, entropy = saved
    z = fp32_logits(hidden[s : s + chunk], weight)
    out = torch.empty(z.shape[0], 2 * z.shape[1], dtype=hidden.dtype, device=z.device) if half else z
    grads = [None if g is None else g[s : s + chunk] for g in (grad_logprobs, grad_entropy)]
    rows = slice(s, s + chunk)
    return fused_logprobs.logit_grad(
        z, targets[rows], lse[rows].view(-1), entropy[rows], grads[0], grads[1], inv_temp, out
    )


def _chunk_grad(saved, s, chunk, inv_temp, grad_logprobs, grad_entropy, buffers):
    """Gradient w.r.t. the tempered logits z of one chunk: g_lp (onehot - p) - g_ent p (log p + entropy)
    (z - E_p[z] equals log p + entropy), from the forward's saved (hidden, weight, targets, normaliser,
    entropy). A gradient that is None (an output the loss does not read) drops its term. `buffers`: as in
    `_chunk_logp`; dz is written over the first."""
    hidden, weight, targets, lse, entropy = saved
    h, t = hidden[s : s + chunk], targets[s : s + chunk]
    logp, _, scratch = _chunk_logp(h, weight, inv_temp, lse[s : s + chunk], buffers)
    if grad_entropy is None:  # p = exp(log p) over the same buffer
        g_lp = grad_logprobs[s : s + chunk].float()
        dz = logp.exp_().mul_(-g_lp[:, None])
        return dz.scatter_add_(1, t[:, None], g_lp[:, None])
    p = torch.exp(logp, out=scratch)
    g_ent = grad_entropy[s : s + chunk].float()
    dz = logp.add_(entropy[s : s + chunk, None]).mul_(p).mul_(-g_ent[:, None])
    if grad_logprobs is not None:
        g_lp = grad_logprobs[s : s + chunk].float()
        dz.addcmul_(p, g_lp[:, None], value=-1.0)
        dz.scatter_add_(1, t[:, None], g_lp[:, None])
    return dz


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Targets must lie in [0, vocab): checked on the device for CUDA tensors (no host sync; a violation
    fails the asynchronous assert), else on the host with a ValueError."""
    if not targets.numel():
        return
    if targets.is_cuda:
        torch._assert_async(((targets >= 0) & (targets < vocab)).all(), "targets outside the vocabulary")
    elif int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise ValueError(f"targets outside the vocabulary [0, {vocab})")


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    fused: bool | None = None,
):
    """hidden [..., H], weight [V, H] (real vocabulary rows), targets [...] int64 ->
    logprobs [...] fp32 (and entropy [...] fp32 when `with_entropy`). Differentiable in hidden and weight.
    `fused`: the chunks' elementwise work as `ops.fused_logprobs`' kernels (None: `fused_available`)."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but targets has {t.shape[0]}")
    check_targets(t, weight.shape[0])
    if fused is None:
        fused = fused_available(h)
    logprobs, entropy = _ChunkedLogprobs.apply(h, weight, t, 1.0 / temperature, chunk_size, fused)
    logprobs = logprobs.view(lead)
    return (logprobs, entropy.view(lead)) if with_entropy else logprobs
