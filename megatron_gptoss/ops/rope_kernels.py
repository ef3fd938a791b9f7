"""Triton kernel of the rollout engine's rotary embedding over the fused QKV projection. Launched only from
`megatron_gptoss.ops.fused_rope`, which states the contract."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_qkv_kernel(
    qkv, cos, sin, q_out, k_out, groups, stride_token, stride_cos, R: tl.constexpr, HEADS: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """One program per (token, KV group): the group's R query heads and its key head (rows of a [HEADS, HALF]
    tile, HEADS = R + 1 rounded up to a power of two) rotated by the token's cos / sin. Each product, then
    the difference or sum, is rounded to the output dtype as PyTorch's elementwise ops round them."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    head = tl.arange(0, HEADS)
    col = tl.arange(0, HALF)
    real = head < R + 1
    src = qkv + token * stride_token + (group * (R + 2) + head)[:, None] * (2 * HALF) + col[None, :]
    first = tl.load(src, mask=real[:, None], other=0.0)
    second = tl.load(src + HALF, mask=real[:, None], other=0.0)
    c = tl.load(cos + token * stride_cos + col)[None, :]
    s = tl.load(sin + token * stride_cos + col)[None, :]
    dtype = first.dtype
    out_first = ((first * c).to(dtype) - (second * s).to(dtype)).to(dtype)
    out_second = ((second * c).to(dtype) + (first * s).to(dtype)).to(dtype)
    is_q = head < R
    q_dst = q_out + (token * groups * R + group * R + head)[:, None] * (2 * HALF) + col[None, :]
    tl.store(q_dst, out_first, mask=is_q[:, None])
    tl.store(q_dst + HALF, out_second, mask=is_q[:, None])
    k_dst = k_out + (token * groups + group + 0 * head)[:, None] * (2 * HALF) + col[None, :]
    is_k = (head == R)[:, None]
    tl.store(k_dst, out_first, mask=is_k)
    tl.store(k_dst + HALF, out_second, mask=is_k)
