"""Context parallelism: each packed micro-batch's tokens split over the cp ranks, attention exact.

Load-balanced causal chunks (zig-zag): a micro-batch of N tokens is cut into 2cp chunks of c = N / 2cp
tokens; cp rank r holds chunks r and 2cp-1-r, in that order (its local tokens are [chunk r; chunk
2cp-1-r], 2c of them), so every rank has the same causal work:

    cp = 2, N = 8c   chunk   0    1    2    3
                     rank    0    1    1    0        rank 0: tokens [0, c) + [3c, 4c); rank 1: [c, 3c)

Every per-token input (ids, positions, targets, router replay) is split with `ContextParallel.split`;
positions restart at 0 in each document, so RoPE needs nothing more. The document boundaries stay
global: every rank passes the micro-batch's whole `cu_seqlens` (a host tensor) to the attention, which
knows where its chunks sit. The last stage's per-token log-probs and entropy are gathered back to the
micro-batch's token order (`gather`; backward: each rank keeps its own tokens' gradient), so the loss,
its normalisation, the metrics, the rollout correction and the critic see exactly the single-rank values.

Attention of one local chunk x (queries [x c, (x+1) c)) under the sink contract:

    diagonal block   the chunk against its own keys, documents cut at the chunk's edges: the backend's
                     kernel (eager, flex, triton, fa4) with the sinks, returning (O_d, LSE_d); LSE_d holds
                     the sink term, so the sink enters each row's normaliser exactly once
    earlier keys     only the chunk's first document can reach back (documents are contiguous): its
                     rows against keys [max(doc start, x c - W + 1), x c), all before every query, so
                     rectangles without causal mask (window: j > i - W), without the sink, merged into
                     (O_r, LSE_r) (LSE_r = -inf for a row that sees none); `ring_attention.rect_attention`
                     computes one: flex_attention on CUDA (compiled, scores never materialised; over the
                     whole query and key chunks with a block mask of the rectangle, so one kernel serves
                     every rectangle of a chunk length), the eager reference elsewhere
    merge            LSE = logaddexp(LSE_d, LSE_r), O = O_d exp(LSE_d - LSE) + O_r exp(LSE_r - LSE); the
                     backward is autograd's through the merge, so the diagonal and the earlier keys get
                     their LSE gradient (the ring passes its share on to each of its rectangles)

How the earlier keys reach a rank (`kv_exchange`, a constructor argument of `ContextParallelAttention`
and `apply_context_parallel`):

    "ring" (default)   full-attention layers, and window layers whose W - 1 exceeds a chunk, pass the
                       ranks' key/value blocks around the cp group point to point (`ring_attention`):
                       at step s rank r computes on the block of rank r - s while it sends that block on
                       to r + 1; the backward passes each block's dK/dV around with it and back to its
                       owner. One remote block is computed on at a time; two are held (it and the next
                       in flight), 2 x 2c of the N tokens' keys and values; rectangles no query chunk can
                       see are not computed, and ring steps no rank of the group needs are not taken.
    "all_gather"       those layers all-gather the micro-batch's keys and values over cp (backward:
                       reduce-scatter of their gradients) and attend each chunk to its earlier keys in one
                       rectangle: one collective a layer, but all N tokens' keys and values held at once.

A window layer whose W - 1 fits in a chunk needs only the previous chunk's last W - 1 keys: it gathers
every chunk's last W - 1 keys and values under either setting.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_gptoss.errors import LayoutError
from megatron_gptoss.model.attention import CoreAttention
from megatron_gptoss.ops.sink_attention import sink_attention
from megatron_gptoss.parallel.collectives import gather_from_sequence_parallel, gather_to_replicated
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.ring_attention import (
    Rect,
    Ring,
    merge_partials,
    rect_attention,
    ring_attention,
)
from megatron_gptoss.parallel.tensor_parallel import swap_module


@dataclass(frozen=True)
class ContextParallel:
    """The zig-zag split over the cp group of this rank (`rank` of `size`). `group` is None only when
    size == 1 (nothing is exchanged then)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, dims: ParallelDims) -> ContextParallel:
        return cls(dims.cp, dims.coord("cp"), dims.group("cp") if dims.cp > 1 else None)

    def chunks(self) -> tuple[int, int]:
        """This rank's two chunk numbers, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def check(self, tokens: int) -> int:
        """The chunk length c of a micro-batch of `tokens` tokens (LayoutError unless 2cp divides it)."""
        if tokens % (2 * self.size):
            raise LayoutError(
                f"context parallel splits a micro-batch of {tokens} tokens into 2 x "
                f"context_parallel_size={self.size} equal chunks: pack to a multiple of {2 * self.size}"
            )
        return tokens // (2 * self.size)

    def local_index(self, tokens: int, device=None) -> Tensor:
        """Micro-batch token indices of this rank's local tokens [2c] (int64)."""
        c = self.check(tokens)
        a, b = self.chunks()
        return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(device)

    def global_order(self, tokens: int) -> Tensor:
        """Index into the rank-order concatenation of every rank's local tokens giving micro-batch order."""
        c = self.check(tokens)
        where = torch.empty(2 * self.size, dtype=torch.long)  # chunk g -> its slot in rank order
        for r in range(self.size):
            where[r], where[2 * self.size - 1 - r] = 2 * r, 2 * r + 1
        return (where[:, None] * c + torch.arange(c)).reshape(-1)

    def split(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's local tokens of a micro-batch tensor (tokens along `dim`)."""
        if self.size == 1:
            return x
        return x.index_select(dim, self.local_index(x.shape[dim], x.device))

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """Every rank's local tokens back in micro-batch order, replicated (backward: this rank keeps
        the gradient of its own tokens)."""
        if self.size == 1:
            return x
        assert self.group is not None
        tokens = x.shape[dim] * self.size
        full = gather_to_replicated(x, self.group, dim, tokens)
        return full.index_select(dim, self.global_order(tokens).to(x.device))

    def gather_summed(self, x: Tensor, dim: int = 0) -> Tensor:
        """As `gather`, but the backward sums every rank's gradient (keys and values: each rank's
        queries read every rank's keys)."""
        if self.size == 1:
            return x
        assert self.group is not None
        full = gather_from_sequence_parallel(x, self.group, dim)
        tokens = full.shape[dim]
        return full.index_select(dim, self.global_order(tokens).to(x.device))


def bucket_tokens(tokens: int) -> int:
    """The micro-batch length a run whose lengths change step to step packs `tokens` into under cp: the
    smallest 2^k or 3 x 2^(k-1) at or above it (less than 1.5x it, two lengths an octave), so the
    compiled rectangles of earlier keys, one kernel per chunk length, are compiled a bounded number of
    times in a run instead of once a step."""
    if tokens <= 2:
        return max(tokens, 1)
    power = 1 << (tokens - 1).bit_length()  # the smallest 2^k >= tokens
    return power * 3 // 4 if power * 3 // 4 >= tokens else power


# ------------------------------------------------------------------------------------------------
# Attention blocks
@dataclass(frozen=True)
class _ChunkPlan:
    """Host-side geometry of one local chunk: its diagonal cu_seqlens (relative), its first document's
    rows that reach earlier keys (`rows`, 0 if none) and those keys' micro-batch range [k_lo, k_hi)."""

    start: int
    cu: list[int]
    longest: int
    rows: int
    k_lo: int


def plan_chunk(bounds: list[int], x: int, c: int, window: int | None) -> _ChunkPlan:
    """Geometry of chunk x (tokens [x c, (x+1) c)) from the micro-batch's document bounds."""
    lo, hi = x * c, (x + 1) * c
    cu = sorted({0, c, *(b - lo for b in bounds if lo < b < hi)})
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    doc_start = max(b for b in bounds if b <= lo)
    doc_end = min((b for b in bounds if b > lo), default=hi)
    k_lo = doc_start if window is None else max(doc_start, lo - (window - 1))
    rows = min(doc_end, hi) - lo if k_lo < lo else 0
    return _ChunkPlan(lo, cu, longest, rows, k_lo)


KV_EXCHANGES = ("ring", "all_gather")


@functools.lru_cache(maxsize=256)
def plan_ring(bounds: tuple[int, ...], size: int, c: int, window: int | None) -> tuple[tuple[Rect, ...], ...]:
    """Per cp rank (of `size`), the rectangles of its local chunks' earlier keys in a ring over chunks of
    c tokens: for chunk x and each earlier chunk y its first document reaches (within the window), rows
    [0, rows) of x against the reachable keys of y, at the step where y's owner's block is held. Rows a
    window keeps from every key of y are cut; a rectangle with no row or key is not planned."""
    per_rank = []
    for rank in range(size):
        rects = []
        for i, x in enumerate((rank, 2 * size - 1 - rank)):
            plan = plan_chunk(list(bounds), x, c, window)
            if not plan.rows:
                continue
            for y in range(plan.k_lo // c, x):
                lo, hi = max(plan.k_lo, y * c), (y + 1) * c
                rows = plan.rows if window is None else min(plan.rows, hi - 1 + window - plan.start)
                if rows <= 0 or lo >= hi:
                    continue
                owner, place = (y, 0) if y < size else (2 * size - 1 - y, c)
                rects.append(
                    Rect((rank - owner) % size, i * c, rows, plan.start, place + lo - y * c, hi - lo, lo)
                )
        per_rank.append(tuple(rects))
    return tuple(per_rank)


class ContextParallelAttention(CoreAttention):
    """`core_attention` of one cp rank: the same sinks (`softmax_offset`), window and backend as the
    single-device module. q [2c, Hq, D], k/v [2c, Hkv, D] this rank's local tokens (packed layout);
    `cu_seqlens`: the whole micro-batch's document bounds, a host int32 tensor [docs + 1] ending at
    2c x cp (None: one document). Returns [2c, Hq, D], each row exactly its single-device value.
    `kv_exchange`: "ring" (default) or "all_gather", how full layers reach earlier keys (module doc).
    Every rank of the cp group calls it for the same layer with the same `cu_seqlens`."""

    def __init__(self, full: CoreAttention, cp: ContextParallel, kv_exchange: str = "ring"):
        if kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {kv_exchange!r}")
        nn.Module.__init__(self)
        self.window, self.backend, self.cp, self.kv_exchange = full.window, full.backend, cp, kv_exchange
        self.softmax_offset = full.softmax_offset

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        if q.dim() != 3:
            raise ValueError(
                f"context-parallel attention takes packed local tokens [2c, heads, dim], got {tuple(q.shape)}"
            )
        cp, window = self.cp, self.window
        tokens = q.shape[0] * cp.size
        c = cp.check(tokens)
        if cu_seqlens is None:
            bounds = [0, tokens]
        elif cu_seqlens.device.type != "cpu":
            raise ValueError("context-parallel attention needs the micro-batch's cu_seqlens on the host")
        else:
            bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != tokens:
            raise ValueError(f"cu_seqlens must span the micro-batch's {tokens} tokens, got {bounds}")
        span = None if window is None or window - 1 > c else window - 1
        ring = span is None and cp.size > 1 and self.kv_exchange == "ring"
        keys, values = (None, None) if ring else self._exchange(k, v, c, span)
        sinks = self.softmax_offset.float()
        backend = None if self.backend == "auto" else self.backend
        scale = q.shape[-1] ** -0.5
        outs, lses = [], []
        for i, x in enumerate(cp.chunks()):
            plan = plan_chunk(bounds, x, c, window)
            rows = slice(i * c, (i + 1) * c)
            qx, kx, vx = q[rows], k[rows], v[rows]
            cu = torch.tensor(plan.cu, dtype=torch.int32).to(q.device, non_blocking=True)
            out, lse = sink_attention(
                qx, kx, vx, sinks, window=window, cu_seqlens=cu, max_seqlen=plan.longest,
                return_lse=True, backend=backend,
            )  # fmt: skip
            if plan.rows and not ring:
                kr, vr, k_start = self._earlier(keys, values, x, c, span)
                head = slice(0, plan.rows)
                reach = (plan.k_lo - k_start, x * c - k_start)
                o_r, lse_r = rect_attention(qx, kr, vr, plan.start, k_start, window, scale, plan.rows, reach)
                merged, _ = merge_partials(out[head], lse[:, head], o_r, lse_r)
                out = torch.cat([merged.to(out.dtype), out[plan.rows :]])
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs)
        if ring:  # every rank runs the ring, forward and backward, even one with no rectangle of its own
            assert cp.group is not None
            per_rank = plan_ring(tuple(bounds), cp.size, c, window)
            steps = max((r.step for rects in per_rank for r in rects), default=0)
            layer_ring = Ring(cp.group, cp.rank, cp.size, steps, per_rank[cp.rank], window, scale)
            o_r, lse_r = ring_attention(q, k, v, layer_ring)
            merged, _ = merge_partials(out, torch.cat(lses, dim=1), o_r, lse_r)
            return merged.to(out.dtype)
        if keys is not None and torch.is_grad_enabled():  # every rank runs the gather's backward
            out = out + (keys[:0].sum() + values[:0].sum()).to(out.dtype)
        return out

    def _exchange(self, k: Tensor, v: Tensor, c: int, span: int | None):
        """Keys and values of the other chunks: all of them in micro-batch order [N, Hkv, D] (span None),
        or the last `span` of every chunk [2cp, span, Hkv, D] in chunk order; None when cp == 1."""
        cp = self.cp
        if cp.size == 1:
            return None, None
        if span is None:
            return cp.gather_summed(k), cp.gather_summed(v)
        if span == 0:
            return None, None

        def tails(t: Tensor) -> Tensor:
            local = t.view(2, c, *t.shape[1:])[:, c - span :].reshape(2 * span, *t.shape[1:])
            full = cp.gather_summed(local, 0)  # as 2cp "chunks" of `span` rows, in chunk order
            return full.view(2 * cp.size, span, *t.shape[1:])

        return tails(k), tails(v)

    @staticmethod
    def _earlier(keys, values, x: int, c: int, span: int | None) -> tuple[Tensor, Tensor, int]:
        """Keys/values of the micro-batch that chunk x may reach (all before it: every earlier token, or
        chunk x - 1's last `span`) and the position of their first row. Whole, not cut to the chunk's
        reach: the rectangle keeps one shape per chunk (see `rect_attention`)."""
        if span is None:
            return keys[: x * c], values[: x * c], 0
        return keys[x - 1], values[x - 1], x * c - span


def apply_context_parallel(model: nn.Module, dims: ParallelDims, kv_exchange: str = "ring") -> None:
    """Swap every `core_attention` of `model` for its context-parallel version (sinks kept: the same
    parameter, possibly a tp shard; `kv_exchange` as in `ContextParallelAttention`). No-op when cp == 1."""
    if dims.cp == 1:
        return
    cp = ContextParallel.of(dims)
    for name, module in list(model.named_modules()):
        if isinstance(module, CoreAttention) and not isinstance(module, ContextParallelAttention):
            swap_module(model, name, ContextParallelAttention(module, cp, kv_exchange))
