"""Causal attention with per-head sinks (GPT-OSS), one entry point over several backends.

Contract (docs/architecture.md, "The sink attention contract"):
    Z_i = sum_{j visible} exp(s_ij) + exp(sink_h),  O_i = sum_j exp(s_ij - LSE_i) v_j,  LSE_i = log Z_i
with s_ij = scale * q_i . k_j. Query i sees key j when j <= i, j is in the same document (packed
input) and, with `window=W`, i - W < j. A row with no visible key returns O = 0 and LSE = sink.

Layouts follow flash-attn: padded q [B, T, Hq, D], k/v [B, T, Hkv, D]; packed q [N, Hq, D], k/v
[N, Hkv, D] with `cu_seqlens` int32 [docs + 1]. LSE is [B, Hq, T] (padded) or [Hq, N] (packed).

Backends:
    eager   PyTorch, materialises the [T, T] scores; accumulates in fp32 (fp64 for fp64 inputs). Reference.
    flex    torch flex_attention with the sink folded in through its log-sum-exp.
    triton  our fused kernel (megatron_gptoss.ops.triton_sink_attention); `sink_decode` is its decode path,
            `sink_paged_decode` its decode path through a paged cache's block table.
    fa4     flash-attn-4's CuTe kernels with `learnable_sink` (megatron_gptoss.ops.fa4_sink_attention).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

from megatron_gptoss.errors import AttentionInputError

BACKENDS = ("eager", "flex", "triton", "fa4")

# Backends implemented in their own modules, imported on first use: name -> (module, function).
_LAZY_BACKENDS = {
    "triton": ("megatron_gptoss.ops.triton_sink_attention", "triton_sink_attention"),
    "fa4": ("megatron_gptoss.ops.fa4_sink_attention", "fa4_sink_attention"),
}


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Causal sink attention; returns the output in q's layout (and the natural-log LSE when asked)."""
    check_inputs(q, k, v, sinks, window=window, cu_seqlens=cu_seqlens)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    name = resolve_backend(backend, q)
    fn = _backend_fn(name)
    return fn(
        q,
        k,
        v,
        sinks,
        window=window,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        softmax_scale=scale,
        return_lse=return_lse,
    )


def sink_decode(
    q_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sinks: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """A few new queries per sequence against a KV cache (the embedded engine's decode / append step).

    q_new [B, n_new, Hq, D]; k_cache / v_cache [B, L, Hkv, D] already holding the new keys and values;
    cache_seqlens int32 [B] counts valid entries, new tokens included. Runs the triton backend, whose
    decode rows equal its training-forward rows bit for bit (contract: `triton_sink_decode`)."""
    module = importlib.import_module(_LAZY_BACKENDS["triton"][0])
    return module.triton_sink_decode(
        q_new,
        k_cache,
        v_cache,
        sinks,
        cache_seqlens,
        window=window,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
    )


def sink_paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    sinks: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    q_view: torch.Tensor,
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """One new query per row against its keys in a paged KV cache, read through the block table (the
    embedded engine's decode rows); q [B, Hq, D] -> [B, Hq, D]. Runs the triton backend; each row equals its
    training-forward row bit for bit (contract: `triton_paged_decode`)."""
    module = importlib.import_module("megatron_gptoss.ops.triton_paged_decode")
    return module.triton_paged_decode(
        q, k_pool, v_pool, sinks, block_table, positions, q_view, window=window, softmax_scale=softmax_scale
    )


def resolve_backend(backend: str | None, q: torch.Tensor) -> str:
    """`None`/"auto": fa4 then triton on CUDA; on the CPU triton under TRITON_INTERPRET=1, else eager."""
    if backend not in (None, "auto"):
        if backend not in BACKENDS:
            raise AttentionInputError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
        return backend
    if q.is_cuda:
        for name in ("fa4", "triton"):
            if backend_available(name, q):
                return name
        return "flex"
    if os.environ.get("TRITON_INTERPRET") == "1" and backend_available("triton", q):
        return "triton"
    return "eager"


def backend_available(name: str, q: torch.Tensor | None = None) -> bool:
    """Whether a backend can run here (its module imports and reports support for q's device)."""
    if name in ("eager", "flex"):
        return True
    try:
        module = importlib.import_module(_LAZY_BACKENDS[name][0])
    except ImportError:
        return False
    supported = getattr(module, "is_supported", None)
    return bool(supported(q)) if supported is not None and q is not None else True


def _backend_fn(name: str) -> Callable:
    if name == "eager":
        return eager_sink_attention
    if name == "flex":
        return flex_sink_attention
    module_name, fn_name = _LAZY_BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise AttentionInputError(f"attention backend {name!r} is not available here: {err}") from err
    return getattr(module, fn_name)


def check_inputs(q, k, v, sinks, *, window=None, cu_seqlens=None) -> None:
    """Raise AttentionInputError naming the argument when the inputs break the layout contract. The
    values of a CUDA `cu_seqlens` are checked by a device-side assert instead (no host sync)."""
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            layout = (
                "[total_tokens, heads, head_dim] with cu_seqlens" if packed else "[batch, tokens, heads, dim]"
            )
            raise AttentionInputError(f"{name} has shape {tuple(t.shape)}; expected {layout}")
    if k.shape != v.shape:
        raise AttentionInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise AttentionInputError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, tokens or head_dim"
        )
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq % hkv:
        raise AttentionInputError(f"q heads ({hq}) not divisible by kv heads ({hkv})")
    if sinks.shape != (hq,):
        raise AttentionInputError(f"sinks has shape {tuple(sinks.shape)}; expected ({hq},), one per q head")
    if window is not None and window < 1:
        raise AttentionInputError(f"window must be >= 1 (query sees itself), got {window}")
    if packed:
        assert cu_seqlens is not None
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise AttentionInputError(
                "cu_seqlens must be a 1-D int32 tensor [docs + 1], "
                f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.is_cuda:  # values checked on the device: no host sync (a violation fails the assert)
            ok = (
                (cu_seqlens[0] == 0)
                & (cu_seqlens[-1] == q.shape[0])
                & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
            )
            torch._assert_async(ok, "cu_seqlens must start at 0, end at total_tokens and be non-decreasing")
            return
        total = int(cu_seqlens[-1])
        if int(cu_seqlens[0]) != 0 or total != q.shape[0]:
            raise AttentionInputError(
                f"cu_seqlens must start at 0 and end at total_tokens={q.shape[0]}, "
                f"got {int(cu_seqlens[0])}..{total}"
            )
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise AttentionInputError("cu_seqlens must be non-decreasing")


# ------------------------------------------------------------------------------------------------
# Masks
def document_ids(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed token: its document index and its position inside the document (int64)."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(total, device=cu_seqlens.device) - starts[doc]
    return doc, pos


def visibility_mask(tokens: int, window: int | None, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Bool [tokens, tokens]: entry (i, j) is True when query i sees key j."""
    i = torch.arange(tokens, device=device)[:, None]
    j = torch.arange(tokens, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    if cu_seqlens is not None:
        doc, _ = document_ids(cu_seqlens.to(device), tokens)
        allowed &= doc[:, None] == doc[None, :]
    return allowed


# ------------------------------------------------------------------------------------------------
# Eager reference
# Most [heads, T, T] score elements of a packed input computed at once (256 MiB in fp32); longer packs run
# one document at a time.
EAGER_PACKED_SCORES = 1 << 26


def eager_sink_attention(
    q, k, v, sinks, *, window=None, cu_seqlens=None, max_seqlen=None, softmax_scale=None, return_lse=False
):
    """Reference: scores materialised, softmax with the sink column, fp32 (fp64 for fp64 inputs). Packed
    inputs whose [heads, T, T] scores would pass EAGER_PACKED_SCORES elements run one document at a time
    (the same values up to round-off; memory of the longest document's scores instead of the pack's)."""
    if cu_seqlens is not None and q.shape[0] ** 2 * q.shape[1] > EAGER_PACKED_SCORES:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, lses = [], []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop > start:
                o, doc_lse = eager_sink_attention(
                    *(t[None, start:stop] for t in (q, k, v)),
                    sinks,
                    window=window,
                    softmax_scale=softmax_scale,
                    return_lse=True,
                )
                outs.append(o[0])
                lses.append(doc_lse[0])
        out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
        return (out, lse) if return_lse else out
    packed = cu_seqlens is not None
    if packed:
        q, k, v = q[None], k[None], v[None]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, tokens, hq, _ = q.shape
    group = hq // k.shape[2]
    qf = q.to(compute).transpose(1, 2)
    kf = k.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    allowed = visibility_mask(tokens, window, cu_seqlens, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(compute).view(1, hq, 1, 1)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(scores - row_max)
    z = p.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max)
    out = ((p / z) @ vf).transpose(1, 2).to(q.dtype)
    lse = (row_max + torch.log(z)).squeeze(-1)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------
# flex_attention with the sink folded into its log-sum-exp
@functools.cache
def _compiled_flex_attention():
    """flex_attention runs fused only when compiled; uncompiled it materialises the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_with_lse(attend, q, k, v, **kwargs):
    """(O, LSE) of `attend` (flex_attention, compiled or not) through `return_aux` (its `return_lse` is
    deprecated: its once-only warning also changes a global that compiled calls are guarded on, so it
    would cost a recompilation)."""
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = attend(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def flex_sink_attention(
    q, k, v, sinks, *, window=None, cu_seqlens=None, max_seqlen=None, softmax_scale=None, return_lse=False
):
    """flex_attention gives O' and LSE' without the sink; with LSE = logaddexp(LSE', sink) the sink-aware
    output is O' * exp(LSE' - LSE). Differentiable wherever flex_attention is (CUDA; CPU forward only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    packed = cu_seqlens is not None
    if packed:
        q, k, v = q[None], k[None], v[None]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    batch, tokens, hq, _ = q.shape
    doc = document_ids(cu_seqlens, tokens)[0] if packed else None

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = kv_idx <= q_idx
        if window is not None:
            allowed = allowed & (kv_idx > q_idx - window)
        if doc is not None:
            allowed = allowed & (doc[q_idx] == doc[kv_idx])
        return allowed

    block_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device=q.device)
    out, lse = flex_with_lse(
        attend,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    lse = lse.float()
    total = torch.logaddexp(lse, sinks.float().view(1, hq, 1))
    out = (out.float() * torch.exp(lse - total).unsqueeze(-1)).to(q.dtype).transpose(1, 2)
    if packed:
        out, total = out[0], total[0]
    return (out, total) if return_lse else out
