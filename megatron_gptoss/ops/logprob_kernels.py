"""Triton kernels of the fused head: per-row log-prob, entropy and normaliser of fp32 logits, and the
logits' gradient. Launched only from `megatron_gptoss.ops.fused_logprobs`, which states the contract."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_stats_kernel(
    Z, stride_z, Targets, LogProb, Entropy, Lse, vocab, inv_temp, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One program per row, one pass over its logits z * inv_temp: running max m, s = sum exp(z - m) and
    t = sum exp(z - m) (z - m), both rescaled when m grows. lse = m + log s; the entropy lse - E_p[z] is
    log s - t / s (relative to m: no cancellation between two large numbers)."""
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    t = 0.0
    for start in range(0, vocab, BLOCK_V):
        ok = start + cols < vocab
        z = tl.load(base + start + cols, mask=ok, other=-float("inf")) * inv_temp
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp(m - m_new)
        shifted = tl.where(ok, z - m_new, 0.0)
        w = tl.where(ok, tl.exp(shifted), 0.0)
        t = alpha * (t + s * tl.where(s > 0, m - m_new, 0.0)) + tl.sum(w * shifted, 0)
        s = alpha * s + tl.sum(w, 0)
        m = m_new
    log_s = tl.log(s)
    target = tl.load(Targets + row)
    z_t = tl.load(base + target) * inv_temp
    tl.store(Lse + row, m + log_s)
    tl.store(LogProb + row, (z_t - m) - log_s)
    tl.store(Entropy + row, log_s - t / s)


@triton.jit
def logit_grad_kernel(
    Z, stride_z, Targets, Lse, Entropy, GradLogProb, GradEntropy, Out, stride_out, vocab, inv_temp,
    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One program per row: dz = inv_temp * (g_lp (onehot - p) - g_ent p (log p + H)) with log p =
    z * inv_temp - lse, in fp32. SPLIT: written as two half-precision terms, hi = dz rounded and lo = dz - hi
    rounded, at columns [0, V) and [V, 2V) of the row of Out; else fp32 dz at columns [0, V)."""
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    dst = Out + row * stride_out
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(Lse + row)
    target = tl.load(Targets + row)
    g_lp = 0.0
    g_ent = 0.0
    ent = 0.0
    if HAS_LP:
        g_lp = tl.load(GradLogProb + row)
    if HAS_ENT:
        g_ent = tl.load(GradEntropy + row)
        ent = tl.load(Entropy + row)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        ok = idx < vocab
        logp = tl.load(base + idx, mask=ok, other=0.0) * inv_temp - lse
        p = tl.exp(logp)
        dz = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_LP:
            dz = tl.where(idx == target, g_lp, 0.0) - g_lp * p
        if HAS_ENT:
            dz -= g_ent * p * (logp + ent)
        dz = dz * inv_temp
        if SPLIT:
            hi = dz.to(Out.dtype.element_ty)
            lo = (dz - hi.to(tl.float32)).to(Out.dtype.element_ty)
            tl.store(dst + idx, hi, mask=ok)
            tl.store(dst + vocab + idx, lo, mask=ok)
        else:
            tl.store(dst + idx, dz, mask=ok)
