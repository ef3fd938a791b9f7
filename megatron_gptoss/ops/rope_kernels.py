"""Triton kernel of the rollout engine's rotary embedding over the fused QKV projection. Launched only from
`megatron_gptoss.ops.fused_rope`, which states the contract."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_qkv_kernel(
    qkv, cos, sin, q_out, k_out, v_out, k_pool, v_pool, slots, groups, stride_token, stride_cos,
    R: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, WRITE_V: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    """One program per (token, KV group): the group's R query heads and its key head (rows of a [HEADS, HALF]
    tile, HEADS = R + 1 rounded up to a power of two) rotated by the token's cos / sin. Each product, then
    the difference or sum, is rounded to the output dtype as PyTorch's elementwise ops round them. With
    WRITE_KV the rotated key and the value also go to the token's slot of the KV pools [slots, groups, D];
    with WRITE_V the value is copied to v_out [tokens, groups, D]."""
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
    if WRITE_V or WRITE_KV:  # the value head, read once for either copy
        v_src = qkv + token * stride_token + (group * (R + 2) + R + 1) * (2 * HALF) + col
        v_first = tl.load(v_src)
        v_second = tl.load(v_src + HALF)
    if WRITE_V:
        v_dst = v_out + (token * groups + group) * (2 * HALF) + col
        tl.store(v_dst, v_first)
        tl.store(v_dst + HALF, v_second)
    if WRITE_KV:
        slot = tl.load(slots + token).to(tl.int64)
        at = (slot * groups + group + 0 * head)[:, None] * (2 * HALF) + col[None, :]
        tl.store(k_pool + at, out_first, mask=is_k)
        tl.store(k_pool + at + HALF, out_second, mask=is_k)
        v_dst = v_pool + (slot * groups + group) * (2 * HALF) + col
        tl.store(v_dst, v_first)
        tl.store(v_dst + HALF, v_second)


@triton.jit
def rotary_qkv_bwd_kernel(
    grad_q, grad_k, grad_v, cos, sin, grad_qkv, groups, stride_token, stride_cos, R: tl.constexpr,
    HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """The forward's transpose, one program per (token, KV group): the gradients of the group's query heads
    and key head rotated back (d first = g1 c + g2 s, d second = g2 c - g1 s, in fp32, one rounding) and the
    value head's gradient as it is, each into its place of the QKV gradient."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    head = tl.arange(0, HEADS)
    col = tl.arange(0, HALF)
    is_q = head < R
    is_k = head == R
    q_src = grad_q + (token * groups * R + group * R + head)[:, None] * (2 * HALF) + col[None, :]
    k_src = grad_k + (token * groups + group + 0 * head)[:, None] * (2 * HALF) + col[None, :]
    is_v = (head == R + 1)[:, None]
    v_src = grad_v + (token * groups + group + 0 * head)[:, None] * (2 * HALF) + col[None, :]
    g1 = tl.load(q_src, mask=is_q[:, None], other=0.0).to(tl.float32)
    g1 += tl.load(k_src, mask=is_k[:, None], other=0.0).to(tl.float32)
    g2 = tl.load(q_src + HALF, mask=is_q[:, None], other=0.0).to(tl.float32)
    g2 += tl.load(k_src + HALF, mask=is_k[:, None], other=0.0).to(tl.float32)
    v1 = tl.load(v_src, mask=is_v, other=0.0)
    v2 = tl.load(v_src + HALF, mask=is_v, other=0.0)
    c = tl.load(cos + token * stride_cos + col).to(tl.float32)[None, :]
    s = tl.load(sin + token * stride_cos + col).to(tl.float32)[None, :]
    dtype = grad_qkv.dtype.element_ty
    dst = grad_qkv + token * stride_token + (group * (R + 2) + head)[:, None] * (2 * HALF) + col[None, :]
    keep = (head < R + 2)[:, None]
    tl.store(dst, tl.where(is_v, v1.to(dtype), (g1 * c + g2 * s).to(dtype)), mask=keep)
    tl.store(dst + HALF, tl.where(is_v, v2.to(dtype), (g2 * c - g1 * s).to(dtype)), mask=keep)
