"""Self-attention of GPT-OSS: fused per-KV-group QKV with the input norm, YaRN RoPE, sinks, window."""

from __future__ import annotations

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.lora import LoRA, LoRALinear, active, make_adapter
from megatron_gptoss.model.norm import rms_norm
from megatron_gptoss.model.rope import apply_rotary
from megatron_gptoss.ops import (
    backend_available,
    batch_invariant,
    fused_moe,
    fused_rope,
    sink_attention,
    sink_decode,
    sink_paged_decode,
)
from megatron_gptoss.ops.cached_attention import cached_sink_attention
from megatron_gptoss.ops.sink_attention import resolve_backend


class LayerNormLinear(nn.Module):
    """RMSNorm followed by a linear layer (Megatron's fused `linear_qkv`): holds
    `layer_norm_weight` [in], `weight` [out, in], `bias` [out] and an optional adapter `lora` on the
    normalised input."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        eps: float,
        dtype=None,
        device=None,
        lora: LoRA | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=dtype, device=device))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.layer_norm_weight, self.eps)
        y = batch_invariant.linear(h, self.weight, self.bias)
        lora = active(self.lora)
        return y if lora is None else y + lora(h)


class CoreAttention(nn.Module):
    """Holds the sinks (`softmax_offset`, one per query head, used in fp32) and calls the kernel."""

    def __init__(self, num_heads: int, window: int | None, backend: str, dtype=None, device=None):
        super().__init__()
        self.window = window
        self.backend = backend
        self.softmax_offset = nn.Parameter(torch.zeros(num_heads, dtype=dtype, device=device))

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        backend = None if self.backend == "auto" else self.backend
        return sink_attention(
            q,
            k,
            v,
            self.softmax_offset.float(),
            window=self.window,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            backend=backend,
        )


class SelfAttention(nn.Module):
    """x [B, T, H] -> [B, T, H]. QKV rows are grouped per KV head: [its q heads, k, v] x head_dim.
    `num_heads` / `num_groups` are the heads this instance computes (tensor parallel holds a slice)."""

    def __init__(self, config: ModelConfig, layer: int, dtype=None, device=None):
        super().__init__()
        c = config
        self.num_heads, self.num_groups, self.head_dim = c.num_attention_heads, c.num_query_groups, c.head_dim
        self.heads_per_group = self.num_heads // self.num_groups
        qkv_out = (self.num_heads + 2 * self.num_groups) * self.head_dim
        proj_in = self.num_heads * self.head_dim
        qkv_lora = make_adapter(c.lora, "linear_qkv", c.hidden_size, qkv_out, None, dtype, device)
        self.linear_qkv = LayerNormLinear(
            c.hidden_size, qkv_out, c.add_bias_linear, c.norm_epsilon, dtype, device, qkv_lora
        )
        self.core_attention = CoreAttention(
            self.num_heads, c.window_of(layer), c.attention_backend, dtype, device
        )
        proj_lora = make_adapter(c.lora, "linear_proj", proj_in, c.hidden_size, None, dtype, device)
        self.linear_proj = LoRALinear(proj_in, c.hidden_size, c.add_bias_linear, proj_lora, dtype, device)
        self.layer = layer

    def split_qkv(self, qkv: torch.Tensor):
        """[..., (q + 2kv) d] grouped per KV head -> q [..., Hq, d], k [..., Hkv, d], v [..., Hkv, d]."""
        lead = qkv.shape[:-1]
        r, d = self.heads_per_group, self.head_dim
        grouped = qkv.view(*lead, self.num_groups, r + 2, d)
        q = grouped[..., :r, :].reshape(*lead, self.num_groups * r, d)
        return q, grouped[..., r, :], grouped[..., r + 1, :]

    @staticmethod
    def _fused_rotary(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether queries and keys are rotated in one kernel (`ops.fused_rope`: bitwise the PyTorch path's
        forward; its backward one launch): CUDA with Triton."""
        return qkv.is_cuda and cos.dtype == qkv.dtype and fused_moe.triton_available()

    def _uses_triton(self, q: torch.Tensor) -> bool:
        """Whether cached attention runs the Triton kernels: where the training forward runs Triton (its
        decode rows equal its training rows bit for bit)."""
        backend = self.core_attention.backend
        return backend == "triton" or (
            backend == "auto"
            and resolve_backend(None, q) in ("triton", "fa4")
            and backend_available("triton", q)
        )

    def _cached_attention(self, q, k_all, v_all, positions, kv_slots=None):
        """New queries q [b, t] against the KV cache [b, S] (slot = position): the Triton decode kernel where
        the training forward runs Triton (a row's new queries are its last t positions, so padding goes
        first), the eager path otherwise, over the first `kv_slots` slots (None: up to the largest query
        position, read on the host)."""
        sinks = self.core_attention.softmax_offset.float()
        window = self.core_attention.window
        if self._uses_triton(q):
            seqlens = (positions[:, -1] + 1).to(torch.int32)
            return sink_decode(q, k_all, v_all, sinks, seqlens, window=window)
        return cached_sink_attention(q, k_all, v_all, sinks, positions, window=window, kv_slots=kv_slots)

    def _paged_decode(self, q, k_pool, v_pool, table, positions, q_view):
        """One new query per row, q [b, Hq, D], read through the block table (`sink_paged_decode`) where
        cached attention runs Triton; None otherwise (the cache then gathers a dense view)."""
        if not self._uses_triton(q):
            return None
        sinks = self.core_attention.softmax_offset.float()
        window = self.core_attention.window
        return sink_paged_decode(q, k_pool, v_pool, sinks, table, positions, q_view, window=window)

    def forward(self, x, cos, sin, cu_seqlens=None, max_seqlen=None, cache=None, positions=None):
        qkv = self.linear_qkv(x)
        # Shapes come from qkv: a sequence-parallel linear_qkv gathers the tokens that x holds a chunk of.
        batch, tokens, _ = qkv.shape
        target = None
        if self._fused_rotary(qkv, cos):
            target = None if cache is None else cache.slot_target(self.layer)
            if target is not None and (target[0].dtype != qkv.dtype or target[2].numel() != batch * tokens):
                target = None  # a cache in another dtype, or not one slot per token: attend writes
            heads = (self.num_groups, self.heads_per_group, self.head_dim)
            q, k, v = fused_rope.rotary_qkv(qkv, cos, sin, *heads, kv_cache=target)
        else:
            q, k, v = self.split_qkv(qkv)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            out = cache.attend(
                self.layer, q, k, v, positions, self._cached_attention, self._paged_decode, target is not None
            )
        elif cu_seqlens is not None:
            flat = (batch * tokens, -1, self.head_dim)
            out = self.core_attention(
                q.reshape(flat), k.reshape(flat), v.reshape(flat), cu_seqlens, max_seqlen
            )
        else:
            out = self.core_attention(q, k, v)
        return self.linear_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))
