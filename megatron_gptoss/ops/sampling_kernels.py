"""Triton kernel of the seeded sampler over the vocabulary. Launched only from
`megatron_gptoss.ops.fused_sampling`, which states the contract."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seeded_sample_kernel(
    logits, uniforms, tokens, logprobs, V, stride, inv_temperature, BLOCK: tl.constexpr
):  # fmt: skip
    """One program per row. Pass 1: the running max and sum of exp of the tempered logits (online
    rescaling). Pass 2: the cumulative mass block by block; the token is the first whose cumulative mass
    reaches uniform * sum (the last token of positive mass where rounding leaves the target unreached)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    offs = tl.arange(0, BLOCK)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    target = tl.load(uniforms + row) * total
    mass = tl.zeros((), tl.float32)
    first = tl.full((), V, tl.int32)
    last = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        p = tl.exp(x - top)
        reached = (mass + tl.cumsum(p, axis=0) >= target) & (cols < V)
        first = tl.minimum(first, tl.min(tl.where(reached, cols, V), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0, cols, 0), axis=0))
        mass += tl.sum(p, axis=0)
    token = tl.where(first < V, first, last)
    picked = tl.load(base + token).to(tl.float32) * inv_temperature
    tl.store(tokens + row, token.to(tl.int64))
    tl.store(logprobs + row, picked - (top + tl.log(total)))
