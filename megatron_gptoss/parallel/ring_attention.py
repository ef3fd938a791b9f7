"""Ring attention of the context-parallel ranks: the earlier-keys part of every local query chunk, with
key/value blocks passed around the cp group instead of all-gathered.

Each cp rank r holds one block: its local keys and values [2c, Hkv, D] (chunks r and 2cp-1-r, see
`context_parallel`). Ring step s (0 <= s <= S): rank r holds the block of rank (r - s) mod cp and attends
its query rows to the parts of that block they can see; meanwhile the block goes on to rank r + 1 and the
block of rank r - s - 1 comes in from rank r - 1 (point-to-point in the cp group: `dist.batch_isend_irecv`,
global ranks taken from the group, so gloo and NCCL alike). S is the last step at which any rank of the
group has a rectangle to compute (every rank knows the whole micro-batch's document bounds, so all agree
on it): cp - 1 for full causal attention of one document, fewer when documents or a window keep the
earlier chunks out of reach; S = 0 exchanges nothing.

    cp = 4, forward on rank 1 (chunks 1, 6)      step 0     step 1     step 2     step 3
    block held (chunks)                          own 1,6    r0: 0,7    r3: 3,4    r2: 2,5
    rectangles (query chunk <- key chunk)        6 <- 1     1 <- 0     6 <- 3     6 <- 2
                                                            6 <- 0     6 <- 4     6 <- 5

A `Rect` is one such rectangle: query rows of one local chunk against the keys of one chunk of the held
block, every key before every query, so no causal mask (window W: key j seen when j > i - W). Rectangles
a query chunk cannot see (key chunks at or after it, outside the document of its first rows, or beyond
the window) are never planned, so never computed. Partial results are merged by their log-sum-exp into
(O_r, LSE_r) without the sink: the sink enters once, in the diagonal block that `context_parallel` merges
with this result (LSE_r = -inf and O_r = 0 on a row that sees no earlier key).

Backward (`RingAttention`, an autograd function): the blocks go around the ring again, each with a
gradient accumulator dK/dV (fp32; fp64 for fp64 inputs) that travels with it; every rank recomputes its
rectangles of the held block and differentiates them with the merge's formulas (w = exp(LSE_b - LSE_r)):
    dO_b = w dO_r,   dLSE_b = w (rowsum(dO_r (O_b - O_r)) + dLSE_r)
adds its dK/dV into the travelling accumulator and passes it on; after step S the accumulator goes
straight back to the block's owner (S hops back: the next rank when S = cp - 1).

Memory per rank beyond the local tokens' activations: the block being computed and the one in flight (two
blocks of 2 x 2c x Hkv x D elements, one remote block computed on at a time), the backward's two
accumulators in fp32, and the saved (O_r fp32, LSE_r) of the local rows; the all-gather it replaces holds
the micro-batch's N x Hkv x D keys and values of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_gptoss.ops.sink_attention import _compiled_flex_attention, flex_with_lse


# ------------------------------------------------------------------------------------------------
# One rectangle: queries against keys that all come before them
def rect_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    scale: float,
    rows: int | None = None,
    keys: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Query rows [0, rows) of q [Lq, Hq, D] (micro-batch positions q_start..) against keys [keys[0],
    keys[1]) of k/v [Lk, Hkv, D] (k's row 0 at position k_start), every key before every query (no causal
    mask), window W: key j seen when j > i - W. No sink. Returns (O [rows, Hq, D] fp32, LSE [Hq, rows]
    fp32, -inf for a row that sees no key). rows None: all of q; keys None: all of k.

    q, k and v may be longer than the rectangle (a whole chunk), so that the compiled kernel sees one
    shape for every rectangle of a run. Differentiable; CUDA runs `flex_rect_attention` from
    `FLEX_MIN_QUERIES` rows of q, shorter q and other devices `eager_rect_attention`."""
    rows = q.shape[0] if rows is None else rows
    first, last = (0, k.shape[0]) if keys is None else keys
    if q.is_cuda and q.shape[0] >= FLEX_MIN_QUERIES:
        out, lse = flex_rect_attention(q, k, v, q_start, k_start, window, scale, rows, (first, last))
        return out[:rows], lse[:, :rows]
    kr, vr = k[first:last], v[first:last]
    return eager_rect_attention(q[:rows], kr, vr, q_start, k_start + first, window, scale)


# Below this many query rows inductor lowers flex_attention to its decoding kernel, which found no
# configuration for a windowed fp32 rectangle (NoValidChoicesError, torch 2.11 on an H200); so few rows
# cost little with the scores materialised (Hq x rows x keys).
FLEX_MIN_QUERIES = 128
FLEX_BLOCK = 128  # flex_attention's sparse block, queries and keys
# Compiled rectangle shapes kept before dynamo falls back to uncompiled flex_attention (which would
# materialise the scores): two a chunk length (whole chunks; a window's tail keys), a bounded set of
# chunk lengths a run (`context_parallel.bucket_tokens`); dynamo's default keeps 8.
RECT_SHAPES = 64


def rect_block_mask(
    q_len: int, k_len: int, rows: int, keys: tuple[int, int], offset: int | None, device: torch.device
):
    """The BlockMask of a rectangle of q_len x k_len (query i sees key j when i < rows, keys[0] <= j <
    keys[1] and, offset not None, j > i + offset), built from its block lists without materialising the
    q_len x k_len mask. Query block b (rows from t = 128 b, if t < rows) reaches key blocks from the one
    holding key max(keys[0], t + offset + 1) to the one holding keys[1] - 1; a reached block is full (no
    mask applied) when all its rows are below `rows` and all its keys inside the range and seen by its
    last row, partial otherwise. The bounds enter the mask as one device tensor, so rectangles of one
    shape share a compiled kernel."""
    from torch.nn.attention.flex_attention import BlockMask

    first, last = keys
    n_q, n_k = -(-q_len // FLEX_BLOCK), -(-k_len // FLEX_BLOCK)
    top = torch.arange(n_q, device=device)[:, None] * FLEX_BLOCK  # each query block's first row
    key = torch.arange(n_k, device=device)[None, :] * FLEX_BLOCK  # each key block's first key
    lowest = torch.full_like(top, first) if offset is None else (top + offset + 1).clamp(min=first)
    reached = (top < rows) & (lowest < last) & (key + FLEX_BLOCK > lowest) & (key < last)
    lowest_full = lowest if offset is None else (top + FLEX_BLOCK + offset).clamp(min=first)
    full = (top + FLEX_BLOCK <= rows) & (key >= lowest_full) & (key + FLEX_BLOCK <= last)
    partial = reached & ~full

    def lists(chosen: Tensor) -> tuple[Tensor, Tensor]:
        """(count [1, 1, n_q], indices [1, 1, n_q, n_k]) of the chosen key blocks, in order, first."""
        block = torch.arange(n_k, device=device).expand(n_q, n_k)
        order = torch.where(chosen, block, block + n_k).argsort(dim=1)
        return chosen.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    # offset None: -(q_len + 1) keeps every key of the range (j >= 0 > i - q_len - 1)
    limits = torch.tensor([rows, first, last, -(q_len + 1) if offset is None else offset], device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        inside = (q_idx < limits[0]) & (kv_idx >= limits[1]) & (kv_idx < limits[2])
        return inside & (kv_idx > q_idx + limits[3])

    return BlockMask.from_kv_blocks(
        *lists(partial), *lists(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


def flex_rect_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    scale: float,
    rows: int,
    keys: tuple[int, int],
) -> tuple[Tensor, Tensor]:
    """`rect_attention` through flex_attention (compiled on CUDA, its LSE differentiable; eager
    elsewhere, forward only) over all of q: O [Lq, Hq, D] in q's dtype upcast and LSE [Hq, Lq], rows at
    or past `rows` 0 and -inf. The mask is always a block mask, so one compiled kernel serves every
    rectangle of q's and k's shapes, windowed or not."""
    from torch.nn.attention.flex_attention import flex_attention

    offset = None if window is None else q_start - k_start - window
    block_mask = rect_block_mask(q.shape[0], k.shape[0], rows, keys, offset, q.device)
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    with torch._dynamo.config.patch(recompile_limit=RECT_SHAPES):
        out, lse = flex_with_lse(
            attend,
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[0].transpose(0, 1).float(), lse[0].float()


def eager_rect_attention(
    q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, window: int | None, scale: float
) -> tuple[Tensor, Tensor]:
    """`rect_attention` with the scores materialised (fp32; fp64 for fp64 inputs): the reference."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    qf = q.to(compute).transpose(0, 1)
    kf = k.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)
    vf = v.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [Hq, Lq, Lk]
    if window is not None:
        i = torch.arange(q_start, q_start + q.shape[0], device=q.device)[:, None]
        j = torch.arange(k_start, k_start + k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(~(j > i - window), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(scores - row_max)
    z = p.sum(dim=-1, keepdim=True)
    seen = z > 0
    z = torch.where(seen, z, torch.ones_like(z))  # a row that sees no key: O = 0, and no gradient
    out = (p @ vf) / z
    lse = torch.where(seen, row_max + torch.log(z), torch.full_like(z, float("-inf")))
    return out.transpose(0, 1), lse.squeeze(-1)


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial results of the same rows (O [L, H, D], LSE [H, L]) over disjoint key sets -> the
    result over their union (fp32). lse_a must be finite (the block that holds the sink)."""
    total = torch.logaddexp(lse_a.float(), lse_b.float())
    wa = torch.exp(lse_a.float() - total).transpose(0, 1)[..., None]
    wb = torch.exp(lse_b.float() - total).transpose(0, 1)[..., None]
    return out_a.float() * wa + out_b.float() * wb, total


def _weight(lse_b: Tensor, total: Tensor) -> Tensor:
    """exp(lse_b - total), 0 where a row sees nothing (both -inf)."""
    return torch.exp(lse_b - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))


# ------------------------------------------------------------------------------------------------
# The plan and the exchange
@dataclass(frozen=True)
class Rect:
    """Local query rows [row, row + rows) at micro-batch position q_start against keys [key, key + keys)
    of the block held at ring step `step` (rows of that block, micro-batch position k_start)."""

    step: int
    row: int
    rows: int
    q_start: int
    key: int
    keys: int
    k_start: int

    def chunks(self, c: int) -> tuple[slice, slice]:
        """The local query chunk and the held block's key chunk (chunks of c rows) the rectangle lies
        in: it is computed over these whole chunks, so every rectangle of a run has one shape."""
        base = self.key - self.key % c
        return slice(self.row, self.row + c), slice(base, base + c)


@dataclass(frozen=True)
class Ring:
    """This rank's part of one layer's ring: `rank` of `size` in `group`, steps 0..`steps`, its
    rectangles (any order), the window W (None: full) and the softmax scale."""

    group: dist.ProcessGroup
    rank: int
    size: int
    steps: int
    rects: tuple[Rect, ...]
    window: int | None
    scale: float

    def peer(self, hops: int) -> int:
        """Global rank of the group rank `hops` after this one (negative: before)."""
        return dist.get_global_rank(self.group, (self.rank + hops) % self.size)

    def exchange(self, send: Tensor, hops: int, tag: int) -> tuple[Tensor, list]:
        """Start sending `send` to the rank `hops` ahead and receiving its like from the rank `hops`
        behind; returns the receive buffer and the requests to wait on."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.peer(hops), self.group, tag),
            dist.P2POp(dist.irecv, recv, self.peer(-hops), self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _rect(q: Tensor, block: Tensor, r: Rect, ring: Ring) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The rectangle's query chunk and key chunk (views of c rows: `Rect.chunks`) and its (O_b, LSE_b)
    over its rows and keys."""
    rows, keys = r.chunks(q.shape[0] // 2)
    qb, kb, vb = q[rows], block[0, keys], block[1, keys]
    skip = r.key - keys.start  # the rectangle's first key inside its chunk
    out, lse = rect_attention(
        qb, kb, vb, r.q_start, r.k_start - skip, ring.window, ring.scale, r.rows, (skip, skip + r.keys)
    )
    return qb, kb, vb, out, lse


class RingAttention(torch.autograd.Function):
    """(q [2c, Hq, D], k, v [2c, Hkv, D] this rank's local tokens, ring) -> (O_r [2c, Hq, D], LSE_r
    [Hq, 2c], fp32; fp64 for fp64 inputs) over every earlier key the ring's rectangles cover, without the
    sink. Every rank of the group must call it for the same layer (forward and backward exchange with
    its neighbours)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> tuple[Tensor, Tensor]:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc)
        held = torch.stack([k, v])
        for step in range(ring.steps + 1):
            incoming = ring.exchange(held, 1, tag=0) if step < ring.steps else None
            for r in ring.rects:
                if r.step == step:
                    _, _, _, o_b, lse_b = _rect(q, held, r, ring)
                    rows = slice(r.row, r.row + r.rows)
                    total = torch.logaddexp(lse[:, rows], lse_b)
                    wa, wb = _weight(lse[:, rows], total), _weight(lse_b, total)
                    out[rows] = out[rows] * wa.T[..., None] + o_b * wb.T[..., None]
                    lse[:, rows] = total
            if incoming is not None:
                _wait(incoming[1])
                held = incoming[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        dq = torch.zeros_like(q, dtype=out.dtype)
        held = torch.stack([k, v])
        grads = torch.zeros_like(held, dtype=out.dtype)  # dK/dV of the held block, travelling with it
        for step in range(ring.steps + 1):
            incoming = ring.exchange(held, 1, tag=0) if step < ring.steps else None
            for r in ring.rects:
                if r.step == step:
                    with torch.enable_grad():
                        leaves = [t.detach().requires_grad_() for t in (q, held)]
                        qb, kb, vb, o_b, lse_b = _rect(leaves[0], leaves[1], r, ring)
                    rows = slice(r.row, r.row + r.rows)
                    w = _weight(lse_b.detach(), lse[:, rows])  # [Hq, rows]
                    g_out = d_out[rows] * w.T[..., None]
                    g_lse = w * (((o_b.detach() - out[rows]) * d_out[rows]).sum(-1).T + d_lse[:, rows])
                    gq, gk, gv = torch.autograd.grad((o_b, lse_b), (qb, kb, vb), (g_out, g_lse))
                    chunk_rows, chunk_keys = r.chunks(q.shape[0] // 2)
                    dq[chunk_rows] += gq
                    grads[0, chunk_keys] += gk
                    grads[1, chunk_keys] += gv
            if ring.steps == 0:
                break
            # on to the next rank; after the last step, straight back to the block's owner
            back = ring.exchange(grads, 1 if step < ring.steps else -ring.steps, tag=1)
            if incoming is not None:
                _wait(incoming[1])
                held = incoming[0]
            _wait(back[1])
            grads = back[0]
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> tuple[Tensor, Tensor]:
    """`RingAttention.apply`: (O_r, LSE_r) of this rank's local rows over the earlier keys of the ring."""
    return RingAttention.apply(q, k, v, ring)
