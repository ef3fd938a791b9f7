"""Decode attention read through a paged KV cache's block table: one new query per sequence, the keys and
values loaded from their blocks inside the kernel (no dense copy of a row's cache).

    q [B, Hq, D] (the new token of each row) ─┐
    pool keys / values [blocks, page, Hkv, D] ├─> program (kv head g, row b):
    block table [B, W], positions [B]         ┘     tile rows = the q heads of group g at the row's position p
                                                     key j (absolute position) -> view slot j - shift
                                                     -> block table[b, slot // page], offset slot % page

A sliding-window pool's table starts at the row's first unreleased block: `q_view` gives the query's slot
in that view, so shift = position - q_view (a multiple of the page) and keys before the view are never
visible. A row with q_view < 0 (padding) sees no key: O = 0, LSE = sink.

Bitwise contract: every output row equals the row of `triton_sink_attention` (its training forward) at the
same absolute position, under the same `KernelConfig`. The tile's rows are the group's query heads, all at
position p; the key blocks visited (BLOCK_N keys, aligned to absolute positions), their order and their
masked / unmasked code path are those of the training tile that holds p, and each row's dot products run on
the training tile's instructions: the training tile's shape, or on a GPU where the training tile gives
each warp 16 whole rows (128 rows over 8 warps, or the window's 64 over 4), one warp's share of it, 16 rows
over one warp (`decode_config`: every warp of the training tile computes its 16 rows alike, the row
reductions inside the warp; an eighth / a quarter of the work for the 8 heads of a group; bit-for-bit
equality checked on an H200 by tests/ops/test_paged_decode.py, and 20-25% faster than the 64-row tile at
512 rows). A row's result depends only on its own q row and the key blocks it visits, so it takes the same
bits.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from megatron_gptoss.errors import AttentionInputError
from megatron_gptoss.ops.triton_sink_attention import KernelConfig, _check, _dot_precision, default_config
from megatron_gptoss.ops.triton_sink_kernels import LN2, LOG2E, _key_ranges, _visible


def decode_config(config: KernelConfig, group: int = 8) -> KernelConfig:
    """The paged decode tile of a training forward `config` for `group` query heads per KV head: a tile of
    64 or more rows over one warp per 16 rows (each warp holding its 16 rows whole, as the training tile's
    warps do) becomes 16 rows over one warp, same BLOCK_N and stages, where the group fits in 16 rows: each
    row then runs the instructions a training warp runs for it, on a quarter of the rows the 64-row tile
    would compute (at 8 heads, 2 of 16 rows wasted instead of 56 of 64). Any other tile is kept."""
    if config.block_m >= 64 and config.fwd_warps * 16 == config.block_m and group <= 16:
        return dataclasses.replace(config, block_m=16, fwd_warps=1)
    return config


@triton.jit
def _paged_blocks(
    acc, l_i, m_i, q, K, V, table_row, shift, kv_off_k, kv_off_v, stride_kblk, stride_kt, stride_vblk,
    stride_vt, offs_m, offs_d, lo, hi, k_len, window, qk_scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_fwd_blocks` of the training forward with each key's address read from the block table."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        slot = offs_n - shift
        ok = (slot >= 0) & (offs_n < k_len)
        page = tl.where(ok, slot, 0)
        block = tl.load(table_row + page // PAGE, mask=ok, other=0).to(tl.int64)
        inside = page % PAGE
        kt_ptrs = K + kv_off_k + block[None, :] * stride_kblk + inside[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = V + kv_off_v + block[:, None] * stride_vblk + inside[:, None] * stride_vt + offs_d[None, :]
        kt = tl.load(kt_ptrs, mask=ok[None, :], other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if MASK:
            qk = tl.where(_visible(offs_m, offs_n, k_len, window, HAS_WINDOW), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def paged_decode_kernel(
    Q, K, V, Sinks, Out, Lse, Table, Pos, QView,
    stride_qb, stride_qh, stride_kblk, stride_kt, stride_kh, stride_vblk, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_lb, stride_tb,
    window, qk_scale, group,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (kv heads, rows)."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    pos = tl.load(Pos + b).to(tl.int64)
    q_view = tl.load(QView + b).to(tl.int64)
    k_len = tl.where(q_view >= 0, pos + 1, 0)
    shift = pos - q_view
    position = tl.where(q_view >= 0, pos, 0)
    start_m = position // BLOCK_M * BLOCK_M
    offs_m = tl.zeros([BLOCK_M], dtype=tl.int64) + position
    r = tl.arange(0, BLOCK_M)
    row_ok = r < group
    heads = kvh * group + r
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    sink = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = Table + b.to(tl.int64) * stride_tb
    kv_off_k = kvh * stride_kh
    kv_off_v = kvh * stride_vh
    lo, full_lo, diag_lo, hi = _key_ranges(start_m, k_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if HAS_WINDOW:
        acc, l_i, m_i = _paged_blocks(
            acc, l_i, m_i, q, K, V, table_row, shift, kv_off_k, kv_off_v, stride_kblk, stride_kt,
            stride_vblk, stride_vt, offs_m, offs_d, lo, full_lo, k_len, window, qk_scale,
            PAGE, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    acc, l_i, m_i = _paged_blocks(
        acc, l_i, m_i, q, K, V, table_row, shift, kv_off_k, kv_off_v, stride_kblk, stride_kt,
        stride_vblk, stride_vt, offs_m, offs_d, full_lo, diag_lo, k_len, window, qk_scale,
        PAGE, BLOCK_N, False, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _paged_blocks(
        acc, l_i, m_i, q, K, V, table_row, shift, kv_off_k, kv_off_v, stride_kblk, stride_kt,
        stride_vblk, stride_vt, offs_m, offs_d, diag_lo, hi, k_len, window, qk_scale,
        PAGE, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if STORE_LSE:
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(Lse + b.to(tl.int64) * stride_lb + heads, lse, mask=row_ok)


def triton_paged_decode(
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
    return_lse: bool = False,
    config: KernelConfig | None = None,
    tile: KernelConfig | None = None,
):
    """Attention of one new query per row against its keys in a paged cache, no gradient.

    q [B, Hq, D]; k_pool / v_pool [blocks, page, Hkv, D] already holding the new keys and values; block_table
    int32 or int64 [B, W]: the blocks of each row's view; positions int64 [B]: the query's absolute position;
    q_view int64 [B]: its slot in the view (position - first viewed block x page; < 0: a padding row that
    sees no key). Query b sees keys j <= positions[b] (and positions[b] - window < j), key j read from block
    block_table[b, (j - shift) // page] at offset (j - shift) % page, shift = positions[b] - q_view[b].
    Returns out [B, Hq, D] in q's dtype (and LSE [B, Hq] fp32, sink included). Nothing is checked on the
    device (no host sync): the table must cover every visible key of its row. `config`: the training
    forward's (default `default_config`), run with its `decode_config` tile; `tile`: run this tile as given
    instead (benchmarks of other tiles: a tile other than the decode tile need not keep the training bits)."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise AttentionInputError(
            f"paged decode expects q [B, Hq, D] and k/v pools [blocks, page, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    batch, hq, d = q.shape
    hkv = k_pool.shape[2]
    if k_pool.shape[-1] != d or hq % hkv:
        raise AttentionInputError(
            f"q {tuple(q.shape)} and pool {tuple(k_pool.shape)} disagree on head_dim or GQA"
        )
    for name, t in (("positions", positions), ("q_view", q_view)):
        if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
            raise AttentionInputError(f"{name} must be int32/int64 [{batch}], got {t.dtype} {tuple(t.shape)}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != batch
        or block_table.dtype not in (torch.int32, torch.int64)
    ):
        raise AttentionInputError(
            f"block_table must be int32/int64 [{batch}, W], got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if sinks.shape != (hq,):
        raise AttentionInputError(f"sinks has shape {tuple(sinks.shape)}; expected ({hq},)")
    if window is not None and window < 1:
        raise AttentionInputError(f"window must be >= 1 (query sees itself), got {window}")
    _check(q, k_pool, v_pool, softmax_scale)
    group = hq // hkv
    cfg = tile or decode_config(config or default_config(d, q.dtype, window is not None, q.device), group)
    if group > cfg.block_m:
        raise AttentionInputError(f"{group} query heads per KV head exceed the tile's {cfg.block_m} rows")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise AttentionInputError("paged decode needs q and the pools contiguous in head_dim")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq) if return_lse else (1, 1), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        paged_decode_kernel[(hkv, batch)](
            q, k_pool, v_pool, sinks, out, lse, block_table, positions, q_view,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
            lse.stride(0), block_table.stride(0), window or 0, scale * math.log2(math.e), group,
            PAGE=k_pool.shape[1], HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            HAS_WINDOW=window is not None, STORE_LSE=return_lse, DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        )  # fmt: skip
    return (out, lse) if return_lse else out
