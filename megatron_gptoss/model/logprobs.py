"""Per-token log-probs and entropy of given tokens, chunked so that at most one [chunk, vocab] block of
logits exists at a time, in the forward and in the backward (which recomputes each chunk).

Convention (docs/architecture.md): logprob_t = log_softmax(logits_t / T)[token_t] with T the sampling
temperature, before any top-k/top-p truncation; entropy_t is that of softmax(logits_t / T). Computed in fp32.

GEMMs of bf16/fp16 hidden states and weights on CUDA run on the half-precision tensor cores with fp32
accumulation and fp32 output: the logits are those of the fp32 GEMM (products of half values are exact
in fp32). The backward's fp32 logit gradient is split into two half-precision terms (hi + lo, relative
residual below 2^-17) for its two GEMMs; elsewhere every GEMM runs in fp32.
"""

from __future__ import annotations

import functools

import torch

from megatron_gptoss.ops import batch_invariant


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


def fp32_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [n, H] @ weight[V, H]^T in fp32 (the rollout engines' logits are computed the same way);
    batch-invariant while that mode is on."""
    if batch_invariant.active():
        return batch_invariant.invariant_linear(h, weight, out_dtype=torch.float32)
    if _half_gemms(h) and weight.dtype == h.dtype:
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return h.float() @ weight.float().t()


def normaliser(z: torch.Tensor) -> torch.Tensor:
    """log sum exp over each row of z [n, V] fp32 -> [n, 1]: log_softmax(z) = z - normaliser(z) (the learner
    and, in bitwise on-policy mode, the engine's sampling); batch-invariant while that mode is on."""
    if batch_invariant.active():
        return batch_invariant.logsumexp_rows(z)[:, None]
    return torch.logsumexp(z, dim=-1, keepdim=True)


def _split(dz: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 dz -> (hi, lo) in dtype with hi + lo = dz up to a relative 2^-17."""
    hi = dz.to(dtype)
    return hi, (dz - hi.float()).to(dtype)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """One chunk: (log_softmax [n, V], softmax [n, V], logprob of target [n], entropy [n]), fp32."""
    logp = fp32_logits(h, weight).mul_(inv_temp)
    logp -= normaliser(logp)
    p = torch.exp(logp)
    entropy = -(p * logp).sum(-1)
    return logp, p, logp.gather(1, targets[:, None]).squeeze(1), entropy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            _, _, lp, ent = _chunk_stats(hidden[s : s + chunk], weight, targets[s : s + chunk], inv_temp)
            logprobs[s : s + chunk] = lp
            entropy[s : s + chunk] = ent
        ctx.save_for_backward(hidden, weight, targets)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.mark_non_differentiable(targets)
        ctx.set_materialize_grads(False)  # an output the loss does not read gets None: its term is skipped
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        half = _half_gemms(hidden) and weight.dtype == hidden.dtype
        wf = torch.cat([weight, weight]) if half else weight.float()
        for s in range(0, hidden.shape[0], chunk):
            dz = _chunk_grad(hidden, weight, targets, s, chunk, inv_temp, grad_logprobs, grad_entropy)
            dz.mul_(inv_temp)
            h = hidden[s : s + chunk]
            if half:  # dz @ W = [hi, lo] @ [W; W] and dz^T @ h = [hi; lo]^T @ [h; h]: fp32 accumulation
                hi, lo = _split(dz, hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[s : s + chunk] = torch.mm(torch.cat([hi, lo], 1), wf, out_dtype=torch.float32)
                grad_weight += torch.mm(torch.cat([hi, lo]).t(), torch.cat([h, h]), out_dtype=torch.float32)
                continue
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = (dz @ wf).to(hidden.dtype)
            grad_weight.addmm_(dz.t(), h.float())
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def _chunk_grad(hidden, weight, targets, s, chunk, inv_temp, grad_logprobs, grad_entropy):
    """Gradient w.r.t. the tempered logits z of one chunk: g_lp (onehot - p) - g_ent p (log p + entropy)
    (z - E_p[z] equals log p + entropy). A gradient that is None (an output the loss does not read) drops
    its term."""
    h, t = hidden[s : s + chunk], targets[s : s + chunk]
    logp, p, _, entropy = _chunk_stats(h, weight, t, inv_temp)
    dz = None
    if grad_entropy is not None:
        g_ent = grad_entropy[s : s + chunk].float()
        dz = logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None])
    if grad_logprobs is not None:
        g_lp = grad_logprobs[s : s + chunk].float()
        dz = p.mul_(-g_lp[:, None]) if dz is None else dz.addcmul_(p, g_lp[:, None], value=-1.0)
        dz.scatter_add_(1, t[:, None], g_lp[:, None])
    return dz


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
):
    """hidden [..., H], weight [V, H] (real vocabulary rows), targets [...] int64 ->
    logprobs [...] fp32 (and entropy [...] fp32 when `with_entropy`). Differentiable in hidden and weight."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but targets has {t.shape[0]}")
    if t.numel() and t.is_cuda:  # checked on the device: no host sync (a violation fails the assert)
        torch._assert_async(((t >= 0) & (t < weight.shape[0])).all(), "targets outside the vocabulary")
    elif t.numel() and (int(t.min()) < 0 or int(t.max()) >= weight.shape[0]):
        raise ValueError(f"targets outside the vocabulary [0, {weight.shape[0]})")
    logprobs, entropy = _ChunkedLogprobs.apply(h, weight, t, 1.0 / temperature, chunk_size)
    logprobs = logprobs.view(lead)
    return (logprobs, entropy.view(lead)) if with_entropy else logprobs
