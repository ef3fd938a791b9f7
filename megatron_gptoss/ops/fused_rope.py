"""The rollout engine's rotary embedding in one Triton launch per layer: the query and key heads of the fused
QKV projection rotated (`model.rope.apply_rotary`, rotate-half) into contiguous outputs, in place of the
split's copy and the fourteen elementwise kernels of the PyTorch path for queries and keys.

    rotary_qkv(qkv [..., G * (R + 2) * D], cos, sin [..., D / 2], groups G, heads_per_group R, head_dim D)
        -> q [..., G * R, D], k [..., G, D] (new, contiguous), v [..., G, D] (a view of qkv)

With `kv_cache` = (k_pool, v_pool [slots, G, D], slots [tokens]) the rotated keys and the values are also
written to each token's slot of the pools (the paged cache's write, in the same launch).

Bitwise equal to the PyTorch path (`split_qkv` then `apply_rotary`) in every dtype: each product, then the
difference or sum, is rounded to the dtype as the elementwise ops round them, and the launch turns off
fused multiply-adds. Where autograd records (the learner), the backward is the rotation transposed in one
launch (fp32, one rounding: within rounding of PyTorch's autograd of `apply_rotary`, whose every op rounds)
that also writes the values' gradient (the values are then a copy, not a view of qkv).
CUDA, or the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import _pow2


def rotary_qkv(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    groups: int,
    heads_per_group: int,
    head_dim: int,
    kv_cache: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    lead = qkv.shape[:-1]
    width = groups * (heads_per_group + 2) * head_dim
    if qkv.shape[-1] != width or head_dim % 2 or _pow2(head_dim) != head_dim:
        raise ValueError(f"qkv [..., {qkv.shape[-1]}] must be [..., G * (R + 2) * D] = [..., {width}] with "
                         f"head_dim a power of two, got head_dim {head_dim}")  # fmt: skip
    half = head_dim // 2
    tokens = qkv[..., 0].numel()
    cos2, sin2 = (t.expand(*lead, half).reshape(tokens, half) for t in (cos, sin))
    if cos2.dtype != qkv.dtype or sin2.dtype != qkv.dtype:
        raise ValueError(f"cos / sin must be in the activations' dtype {qkv.dtype}, got {cos2.dtype}")
    cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    heads = (groups, heads_per_group, head_dim)
    if kv_cache is None and torch.is_grad_enabled() and qkv.requires_grad:
        # the value copied out too: the backward writes the whole QKV gradient at once (a view's backward
        # would add a zero-filled full-width gradient to it)
        q, k, v = _RotaryQKV.apply(qkv, cos2.detach(), sin2.detach(), heads)
        v = v.view(*lead, groups, head_dim)
    else:
        q, k, _ = _forward(qkv.detach(), cos2, sin2, heads, kv_cache, False)
        v = qkv.view(*lead, groups, heads_per_group + 2, head_dim)[..., heads_per_group + 1, :]
    return q.view(*lead, groups * heads_per_group, head_dim), k.view(*lead, groups, head_dim), v


def _forward(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int, int], kv_cache, copy_v: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    groups, per_group, head_dim = heads
    tokens = cos.shape[0]
    flat = qkv.reshape(tokens, -1)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    q = torch.empty(tokens, groups * per_group, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, groups, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k) if copy_v else None
    k_pool = v_pool = slots = k  # placeholders where nothing is written to a cache
    if kv_cache is not None:
        k_pool, v_pool, slots = kv_cache
        for pool in (k_pool, v_pool):
            if (
                tuple(pool.shape[1:]) != (groups, head_dim)
                or pool.dtype != qkv.dtype
                or not pool.is_contiguous()
            ):
                raise ValueError(f"KV pools must be contiguous [slots, {groups}, {head_dim}] in {qkv.dtype}, "
                                 f"got {tuple(pool.shape)} {pool.dtype}")  # fmt: skip
        if slots.shape != (tokens,):
            raise ValueError(f"slots must be [{tokens}] (one per token), got {tuple(slots.shape)}")
    if tokens:
        kernels = importlib.import_module("megatron_gptoss.ops.rope_kernels")
        kernels.rotary_qkv_kernel[(tokens, groups)](
            flat, cos, sin, q, k, k if v is None else v, k_pool, v_pool, slots, groups, flat.stride(0),
            cos.stride(0), R=per_group, HEADS=_pow2(per_group + 1), HALF=head_dim // 2, WRITE_V=copy_v,
            WRITE_KV=kv_cache is not None, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return q, k, v


class _RotaryQKV(torch.autograd.Function):
    """The rotated queries and keys and a copy of the values, of the learner's forward; backward: the
    rotation transposed and the values' gradient, written into the QKV gradient in one launch."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads):
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.shape = heads, qkv.shape
        return _forward(qkv, cos, sin, heads, None, True)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        groups, per_group, head_dim = ctx.heads
        tokens = cos.shape[0]
        grad = torch.empty(ctx.shape, dtype=grad_q.dtype, device=grad_q.device)
        if tokens:
            kernels = importlib.import_module("megatron_gptoss.ops.rope_kernels")
            gq, gk, gv = (g.contiguous() for g in (grad_q, grad_k, grad_v))
            kernels.rotary_qkv_bwd_kernel[(tokens, groups)](
                gq, gk, gv, cos, sin, grad, groups, grad.shape[-1], cos.stride(0), R=per_group,
                HEADS=_pow2(per_group + 2), HALF=head_dim // 2, num_warps=4,
            )  # fmt: skip
        return grad, None, None, None
