"""Triton kernels of the sink attention: forward (also the decode path), dQ (with Delta and the d_sink
partials), dK/dV (with d_sink), and the one-pass backward with its preprocess.

Launched only from `megatron_gptoss.ops.triton_sink_attention`, which states the public contract.

Indexing shared by every kernel. Program axis 2 is the sequence `b`: a batch row (padded input, base
offset `b * stride_b`) or a document (packed input, first token `cu_seqlens[b]`, `stride_b` = 0).
Positions are counted from the sequence start. Keys sit at positions 0 .. k_len - 1; the q_len
queries sit at the last positions, pos0 = k_len - q_len .. k_len - 1 (training: q_len = k_len, so
pos0 = 0; decode: the new queries at the end of a KV cache). Query tiles are aligned to multiples of
BLOCK_M positions and key blocks to multiples of BLOCK_N, independent of pos0, so a query row meets
the same tile, the same key blocks in the same order and the same masked/unmasked code path in
training and in decode: its result is bitwise the same.

Scores are handled in base 2 (qk_scale = softmax_scale * log2(e)); the stored LSE is natural-log.
The running max starts at the sink and the running sum at exp(sink - sink) = 1, so a row with no
visible key ends with O = 0 and LSE = sink.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _sequence(cu_seqlens, seqused_k, b, seqlen, VARLEN: tl.constexpr, SEQUSED_K: tl.constexpr):
    """First token row (packed input) and the query / key lengths of sequence b."""
    if VARLEN:
        start = tl.load(cu_seqlens + b).to(tl.int64)
        q_len = tl.load(cu_seqlens + b + 1) - tl.load(cu_seqlens + b)
    else:
        start = 0
        q_len = seqlen
    k_len = q_len
    if SEQUSED_K:
        k_len = tl.load(seqused_k + b)
    return start, q_len, k_len


@triton.jit
def _first_row_offset(b, stride_b, head, stride_h, start, stride_t):
    """64-bit offset of the first row of sequence b (start: its first token) of one head; stride_t 1 for
    the per-row LSE layouts. The start folds into this scalar, so a tile's row offsets added to it stay
    32-bit (64-bit row offsets raised the dQ kernel's registers from 128 to 141 and halved its programs per
    SM)."""
    return b.to(tl.int64) * stride_b + head * stride_h + start * stride_t


@triton.jit
def _first_row(P, b, stride_b, head, stride_h, start, stride_t):
    """Pointer to the first row of sequence b of one head (`_first_row_offset`)."""
    return P + _first_row_offset(b, stride_b, head, stride_h, start, stride_t)


@triton.jit
def _key_ranges(
    start_m, k_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """Key blocks a query tile [start_m, start_m + BLOCK_M) visits: [lo, full_lo) masked (window edge),
    [full_lo, diag_lo) unmasked, [diag_lo, hi) masked (diagonal and sequence end). Out-of-band blocks are
    outside [lo, hi) and never visited. A decode tile wholly before position 0 (left padding of a short row
    in a prefill group, start_m < 0) visits none: keys before a sequence's first entry are not its own."""
    hi = tl.minimum(start_m + BLOCK_M, k_len)
    diag_lo = tl.maximum(start_m, 0) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(start_m + BLOCK_M - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), diag_lo)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, diag_lo, hi


@triton.jit
def _visible(offs_m, offs_n, seq_len, window, HAS_WINDOW: tl.constexpr):
    """[M, N] mask: query position offs_m sees key position offs_n (causal, window, key in the sequence)."""
    ok = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < seq_len)
    if HAS_WINDOW:
        ok = ok & (offs_n[None, :] > offs_m[:, None] - window)
    return ok


# ------------------------------------------------------------------------------------------------
# Forward
@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, k_len, window, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASK:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if MASK:
            qk = tl.where(_visible(offs_m, offs_n, k_len, window, HAS_WINDOW), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < k_len, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def sink_attn_fwd_kernel(
    Q, K, V, Sinks, Out, Lse, cu_seqlens, seqused_k,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    seqlen, window, qk_scale, group, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
    SEQUSED_K: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (q heads, query tiles, sequences); tiles are launched last-first and the heads inside, so every
    head's longest key loop starts before any shorter one (a causal sequence's tail of short tiles packs
    the last wave)."""
    h = tl.program_id(0)
    pid_m = num_m_blocks - 1 - tl.program_id(1)
    b = tl.program_id(2)
    start, q_len, k_len = _sequence(cu_seqlens, seqused_k, b, seqlen, VARLEN, SEQUSED_K)
    pos0 = k_len - q_len
    # the tile of pos0 is floor(pos0 / BLOCK_M) (Triton's integer division truncates toward zero), so the
    # tiles of a left-padded decode row (pos0 < 0) cover its padding, which reads no key (its output is 0)
    first_tile = tl.where(pos0 < 0, -((BLOCK_M - 1 - pos0) // BLOCK_M), pos0 // BLOCK_M)
    start_m = (first_tile + pid_m) * BLOCK_M
    if start_m >= k_len:
        return
    kvh = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (offs_m >= pos0) & (offs_m < k_len)
    rows = offs_m - pos0
    q_ptrs = _first_row(Q, b, stride_qb, h, stride_qh, start, stride_qt) + rows[:, None] * stride_qt
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = _first_row(K, b, stride_kb, kvh, stride_kh, start, stride_kt)
    v_base = _first_row(V, b, stride_vb, kvh, stride_vh, start, stride_vt)

    sink = tl.load(Sinks + h).to(tl.float32) * LOG2E
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, diag_lo, hi = _key_ranges(start_m, k_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if HAS_WINDOW:
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, full_lo, k_len,
            window, qk_scale, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, full_lo, diag_lo, k_len,
        window, qk_scale, BLOCK_N, False, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, diag_lo, hi, k_len,
        window, qk_scale, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = _first_row(Out, b, stride_ob, h, stride_oh, start, stride_ot) + rows[:, None] * stride_ot
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(Lse + _first_row_offset(b, stride_lb, h, stride_lh, start, 1) + rows, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------------
# Backward
@triton.jit
def _delta_rows(
    o, do, Lse, dLse, Sinks, Stats, DsinkPart, lse_off, dlse_off, offs_m, row_ok, h, part,
    HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """Delta_i = rowsum(dO_i * O_i) - dLSE_i of a tile's rows, stored with LSE_i as the pair Stats[row]
    (`_stats_ptrs`), and the tile's d_sink partial sum of exp(sink - LSE_i) * Delta_i into DsinkPart[part].
    Returns (Delta, LSE) of the rows. lse_off / dlse_off: the sequence's first row in LSE / dLSE (scalars);
    offs_m: the rows in it."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta = delta - tl.load(dLse + dlse_off + offs_m, mask=row_ok, other=0.0).to(tl.float32)
    lse = tl.load(Lse + lse_off + offs_m, mask=row_ok, other=0.0)
    tl.store(_stats_ptrs(Stats, lse_off, offs_m), tl.join(lse, delta), mask=row_ok[:, None])
    sink = tl.load(Sinks + h).to(tl.float32)
    tl.store(DsinkPart + part, tl.sum(tl.where(row_ok, tl.exp(sink - lse) * delta, 0.0), 0))
    return delta, lse


@triton.jit
def _sum_dsink(DsinkPart, dSinks, kvh, group, n_parts, BLOCK: tl.constexpr):
    """d_sink_h = -sum of head h's n_parts partials (DsinkPart[h, :]) for the group's query heads, summed
    in a fixed order (bitwise repeatable) and stored in the sinks' dtype. Run by one program per KV head of
    the kernel launched after the partials' writer."""
    for i in range(0, group):
        h = kvh * group + i
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, n_parts, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            acc += tl.load(DsinkPart + h.to(tl.int64) * n_parts + offs, mask=offs < n_parts, other=0.0)
        tl.store(dSinks + h, (-tl.sum(acc, 0)).to(dSinks.dtype.element_ty))


@triton.jit
def sink_attn_bwd_preprocess_kernel(
    Out, dOut, Lse, dLse, Sinks, Stats, DsinkPart, cu_seqlens,
    stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dlb, stride_dlh, seqlen, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """The (LSE, Delta) pairs and the d_sink partials alone (`_delta_rows`), for the one-pass backward; the
    two-pass backward computes them in its dQ kernel. Partial of (head, sequence, tile) at DsinkPart[h, b *
    num_m_blocks + tile]."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    start, q_len, _ = _sequence(cu_seqlens, cu_seqlens, b, seqlen, VARLEN, False)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    o_base = _first_row(Out, b, stride_ob, h, stride_oh, start, stride_ot)
    do_base = _first_row(dOut, b, stride_dob, h, stride_doh, start, stride_dot)
    o = tl.load(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    part = (h * tl.num_programs(2) + b) * num_m_blocks + pid_m
    lse_off = _first_row_offset(b, stride_lb, h, stride_lh, start, 1)
    dlse_off = _first_row_offset(b, stride_dlb, h, stride_dlh, start, 1)
    _delta_rows(
        o, do, Lse, dLse, Sinks, Stats, DsinkPart, lse_off, dlse_off, offs_m, row_ok, h, part, HAS_DLSE
    )


@triton.jit
def _query_ranges(
    start_n, seq_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """Query tiles seeing the key block [start_n, start_n + BLOCK_N): [m_lo, full_lo) masked (diagonal),
    [full_lo, full_hi) unmasked, [full_hi, m_hi) masked (window edge, sequence end)."""
    m_lo = start_n // BLOCK_M * BLOCK_M
    full_lo = (start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_hi = seq_len // BLOCK_M * BLOCK_M
    if HAS_WINDOW:
        m_hi = tl.minimum(seq_len, start_n + BLOCK_N - 1 + window)
        full_hi = tl.minimum(full_hi, (start_n + window) // BLOCK_M * BLOCK_M)
    else:
        m_hi = seq_len
    full_lo = tl.minimum(full_lo, m_hi)
    full_hi = tl.maximum(full_hi, full_lo)
    return m_lo, full_lo, full_hi, m_hi


@triton.jit
def _query_band(band: tl.constexpr, m_lo, full_lo, full_hi, m_hi):
    """[lo, hi) of `_query_ranges`' band 0 (the masked diagonal), 1 (the unmasked middle) or 2 (the masked
    tail)."""
    if band == 0:
        lo, hi = m_lo, full_lo
    elif band == 1:
        lo, hi = full_lo, full_hi
    else:
        lo, hi = full_hi, m_hi
    return lo, hi


@triton.jit
def _stats_ptrs(Stats, row0, offs_m):
    """[rows, 2] pointers to the (LSE, Delta) pairs of rows row0 + offs_m, row0 an index in LSE's layout:
    the pairs sit at twice LSE's offsets, so every pair is 8-byte aligned wherever a packed sequence
    starts and loads as one vector (LSE and Delta apart load one float at a time from an unaligned start)."""
    return Stats + 2 * row0 + 2 * offs_m[:, None] + tl.arange(0, 2)[None, :]


@triton.jit
def _row_stats(stats_ptrs, row_ok, MASK: tl.constexpr):
    """LSE and Delta of a query tile's rows; rows past the sequence end read as zeros under MASK."""
    if MASK:
        pairs = tl.load(stats_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        pairs = tl.load(stats_ptrs)
    return tl.split(pairs)


@triton.jit
def _dkdv_rows(q_ptrs, do_ptrs, stats_ptrs, row_ok, MASK: tl.constexpr):
    """Q, dO, LSE and Delta of a query tile; rows past the sequence end read as zeros under MASK."""
    if MASK:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
    lse, delta = _row_stats(stats_ptrs, row_ok, MASK)
    return q, do, lse, delta


@triton.jit
def _dkdv_step(
    dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, seq_len, window, qk_scale, MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (key block, query tile) step: P^T and dS^T of the block's keys against the tile's queries, added
    into dV and dK. Returns (dK, dV, dS^T in the inputs' dtype)."""
    qkt = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    pt = tl.math.exp2(qkt * qk_scale - (lse * LOG2E)[None, :])
    if MASK:
        ok = (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < seq_len)
        if HAS_WINDOW:
            ok = ok & (offs_n[:, None] > offs_m[None, :] - window)
        pt = tl.where(ok, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dst = (pt * (dpt - delta[None, :])).to(q.dtype)
    dk = tl.dot(dst, q, dk, input_precision=DOT_PRECISION)
    return dk, dv, dst


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_base, do_base, Qd, dOd, tma_row, tma_col, Stats, stat_row0, stride_qt, stride_dot,
    offs_n, offs_d, lo, hi, seq_len, window, qk_scale, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Query tiles [lo, hi) against one key block. With TMA, Q and dO come through the descriptors Qd and
    dOd at rows tma_row + start_m (rows past the sequence end hold the next sequence's or zeros; the
    masked step zeroes their terms)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if TMA:
            q = Qd.load([tma_row + start_m, tma_col])
            do = dOd.load([tma_row + start_m, tma_col])
            lse, delta = _row_stats(_stats_ptrs(Stats, stat_row0, offs_m), offs_m < seq_len, MASK)
        else:
            q, do, lse, delta = _dkdv_rows(
                q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                do_base + offs_m[:, None] * stride_dot + offs_d[None, :],
                _stats_ptrs(Stats, stat_row0, offs_m),
                offs_m < seq_len,
                MASK,
            )
        dk, dv, _ = _dkdv_step(
            dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, seq_len, window, qk_scale, MASK, HAS_WINDOW,
            DOT_PRECISION,
        )  # fmt: skip
    return dk, dv


@triton.jit
def sink_attn_bwd_dkdv_kernel(
    Q, K, V, dOut, Stats, dK, dV, DsinkPart, dSinks, cu_seqlens, Qd, dOd, tma_rows_per_b,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh, stride_lb, stride_lh, seqlen, window, qk_scale, sm_scale, group,
    n_parts,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAIR: tl.constexpr, SINK_CHUNK: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (key blocks, kv heads, sequences). A program owns dK/dV of BLOCK_N keys of one KV head and loops
    over the `group` query heads sharing it, so every element is written once (no atomics). With PAIR
    (causal), program p owns key blocks p and n_blocks - 1 - p, which evens out the causal triangle's
    work across programs (grid axis 0: half the key blocks). Program (0, kvh, 0) also sums the group's
    d_sink partials (`_sum_dsink`), written by the dQ kernel before it. With TMA, Q and dO are read through
    the descriptors Qd, dOd over [rows, q heads * HEAD_DIM], sequence b's first row at b * tma_rows_per_b +
    its start."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    if pid == 0 and b == 0:
        _sum_dsink(DsinkPart, dSinks, kvh, group, n_parts, SINK_CHUNK)
    start, seq_len, _ = _sequence(cu_seqlens, cu_seqlens, b, seqlen, VARLEN, False)
    if PAIR:
        partner = (seq_len + BLOCK_N - 1) // BLOCK_N - 1 - pid
        if pid > partner:
            return
        count = tl.where(partner > pid, 2, 1)
    else:
        if pid * BLOCK_N >= seq_len:
            return
        partner = pid
        count = 1
    offs_d = tl.arange(0, HEAD_DIM)
    tma_row = (b * tma_rows_per_b + start).to(tl.int32)
    for j in range(0, count):
        start_n = tl.where(j == 0, pid, partner) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n[:, None] < seq_len
        k_ptrs = _first_row(K, b, stride_kb, kvh, stride_kh, start, stride_kt) + offs_n[:, None] * stride_kt
        v_ptrs = _first_row(V, b, stride_vb, kvh, stride_vh, start, stride_vt) + offs_n[:, None] * stride_vt
        k = tl.load(k_ptrs + offs_d[None, :], mask=key_ok, other=0.0)
        v = tl.load(v_ptrs + offs_d[None, :], mask=key_ok, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        m_lo, full_lo, full_hi, m_hi = _query_ranges(start_n, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)

        for i in range(0, group):
            h = kvh * group + i
            q_base = _first_row(Q, b, stride_qb, h, stride_qh, start, stride_qt)
            do_base = _first_row(dOut, b, stride_dob, h, stride_doh, start, stride_dot)
            stat_row0 = _first_row_offset(b, stride_lb, h, stride_lh, start, 1)
            for band in tl.static_range(3):
                lo, hi = _query_band(band, m_lo, full_lo, full_hi, m_hi)
                dk, dv = _dkdv_blocks(
                    dk, dv, k, v, q_base, do_base, Qd, dOd, tma_row, h * HEAD_DIM, Stats, stat_row0,
                    stride_qt, stride_dot, offs_n, offs_d, lo, hi, seq_len, window, qk_scale, BLOCK_M,
                    band != 1, HAS_WINDOW, TMA, DOT_PRECISION,
                )  # fmt: skip

        dk = dk * sm_scale
        dk_ptrs = (
            _first_row(dK, b, stride_dkb, kvh, stride_dkh, start, stride_dkt) + offs_n[:, None] * stride_dkt
        )
        dv_ptrs = (
            _first_row(dV, b, stride_dvb, kvh, stride_dvh, start, stride_dvt) + offs_n[:, None] * stride_dvt
        )
        tl.store(dk_ptrs + offs_d[None, :], dk.to(dK.dtype.element_ty), mask=key_ok)
        tl.store(dv_ptrs + offs_d[None, :], dv.to(dV.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, seq_len, window,
    qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]
        vt_ptrs = v_base + offs_n[None, :] * stride_vt + offs_d[:, None]
        if MASK:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(_visible(offs_m, offs_n, seq_len, window, HAS_WINDOW), p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def sink_attn_bwd_dq_kernel(
    Q, K, V, Out, dOut, Lse, dLse, Sinks, Stats, DsinkPart, dQ, cu_seqlens,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh,
    stride_lb, stride_lh, stride_dlb, stride_dlh, seqlen, window, qk_scale, sm_scale, group, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DLSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, q heads, sequences), tiles last-first; the key loop is the forward's. A program
    first takes its rows' Delta and the tile's d_sink partial (`_delta_rows`, DsinkPart[h, b *
    num_m_blocks + tile]; 0 for a tile past the sequence end), which the dK/dV kernel launched after it
    reads."""
    pid_m = num_m_blocks - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    part = (h * tl.num_programs(2) + b) * num_m_blocks + pid_m
    start, seq_len, _ = _sequence(cu_seqlens, cu_seqlens, b, seqlen, VARLEN, False)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        tl.store(DsinkPart + part, 0.0)
        return
    kvh = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q_ptrs = _first_row(Q, b, stride_qb, h, stride_qh, start, stride_qt) + offs_m[:, None] * stride_qt
    o_ptrs = _first_row(Out, b, stride_ob, h, stride_oh, start, stride_ot) + offs_m[:, None] * stride_ot
    do_ptrs = _first_row(dOut, b, stride_dob, h, stride_doh, start, stride_dot) + offs_m[:, None] * stride_dot
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse_off = _first_row_offset(b, stride_lb, h, stride_lh, start, 1)
    dlse_off = _first_row_offset(b, stride_dlb, h, stride_dlh, start, 1)
    delta, lse = _delta_rows(
        o, do, Lse, dLse, Sinks, Stats, DsinkPart, lse_off, dlse_off, offs_m, row_ok, h, part, HAS_DLSE
    )
    lse2 = lse * LOG2E
    k_base = _first_row(K, b, stride_kb, kvh, stride_kh, start, stride_kt)
    v_base = _first_row(V, b, stride_vb, kvh, stride_vh, start, stride_vt)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, diag_lo, hi = _key_ranges(start_m, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if HAS_WINDOW:
        dq = _dq_blocks(
            dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, full_lo,
            seq_len, window, qk_scale, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, full_lo, diag_lo,
        seq_len, window, qk_scale, BLOCK_N, False, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, diag_lo, hi,
        seq_len, window, qk_scale, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    dq = dq * sm_scale
    dq_ptrs = _first_row(dQ, b, stride_dqb, h, stride_dqh, start, stride_dqt) + offs_m[:, None] * stride_dqt
    tl.store(dq_ptrs + offs_d[None, :], dq.to(dQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------------------
# Backward in one pass: dK/dV as above, and dQ accumulated into fp32 in a fixed key-block order
@triton.jit
def _fused_tiles(
    dk, dv, k, v, Q, dOut, Stats, DQacc, Locks, b, start, kvh, group, n_block, lo, hi,
    stride_qb, stride_qt, stride_qh, stride_dob, stride_dot, stride_doh, stride_ab, stride_at, stride_ah,
    stride_lb, stride_lh, lock_b, lock_h, offs_n, offs_d, seq_len, window, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Query tiles [lo, hi) last-first, the group's query heads inside. Each (head, tile) takes this key
    block's dQ term after the lower key blocks' (its lock counts them), so dQ sums in key-block order."""
    count = (hi - lo + BLOCK_M - 1) // BLOCK_M
    for jj in range(0, count):
        start_m = lo + (count - 1 - jj) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        tile = start_m // BLOCK_M
        first = tl.maximum(start_m - window + 1, 0) // BLOCK_N if HAS_WINDOW else 0
        for i in range(0, group):
            h = kvh * group + i
            rows = offs_m[:, None]  # from the sequence's start, folded into the scalar bases below
            stat = _first_row_offset(b, stride_lb, h, stride_lh, start, 1)
            q_base = _first_row(Q, b, stride_qb, h, stride_qh, start, stride_qt)
            do_base = _first_row(dOut, b, stride_dob, h, stride_doh, start, stride_dot)
            q, do, lse, delta = _dkdv_rows(
                q_base + rows * stride_qt + offs_d[None, :],
                do_base + rows * stride_dot + offs_d[None, :],
                _stats_ptrs(Stats, stat, offs_m),
                row_ok,
                MASK,
            )
            dk, dv, dst = _dkdv_step(
                dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, seq_len, window, qk_scale, MASK, HAS_WINDOW,
                DOT_PRECISION,
            )  # fmt: skip
            dq = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION) * sm_scale
            lock = Locks + b * lock_b + h * lock_h + tile
            while tl.atomic_add(lock, 0, sem="acquire") != n_block - first:
                pass
            acc_ptrs = _first_row(DQacc, b, stride_ab, h, stride_ah, start, stride_at) + rows * stride_at
            tl.atomic_add(acc_ptrs + offs_d[None, :], dq, mask=row_ok[:, None], sem="relaxed")
            tl.debug_barrier()
            tl.atomic_add(lock, 1, sem="release")
    return dk, dv


@triton.jit
def sink_attn_bwd_fused_kernel(
    Q, K, V, dOut, Stats, dK, dV, DQacc, Locks, DsinkPart, dSinks, cu_seqlens,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh, stride_ab, stride_at, stride_ah, stride_lb, stride_lh,
    lock_b, lock_h, seqlen, window, qk_scale, sm_scale, group, kv_heads, n_parts,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SINK_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (kv heads x sequences, key blocks): program (c, n) owns dK/dV of key block n of KV head / sequence
    c, as `sink_attn_bwd_dkdv_kernel`, and adds its dQ terms to the fp32 DQacc. Every (query head, query
    tile) has a counter in Locks: block n adds its term once the counter reads the number of lower key
    blocks that reach the tile, then increments it, so each dQ element is summed in key-block order
    (bitwise repeatable). A block waits only on lower blocks of the same (kv head, sequence), launched
    before it (programs start in launch order): no deadlock. Tiles run last-first, so the programs of one
    wave meet each tile about one step apart. Program (kvh, 0) of sequence 0 also sums the group's d_sink
    partials (`_sum_dsink`)."""
    c = tl.program_id(0)
    n_block = tl.program_id(1)
    kvh = c % kv_heads
    b = c // kv_heads
    if n_block == 0 and b == 0:
        _sum_dsink(DsinkPart, dSinks, kvh, group, n_parts, SINK_CHUNK)
    start, seq_len, _ = _sequence(cu_seqlens, cu_seqlens, b, seqlen, VARLEN, False)
    start_n = n_block * BLOCK_N
    if start_n >= seq_len:
        return
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n[:, None] < seq_len
    k_ptrs = _first_row(K, b, stride_kb, kvh, stride_kh, start, stride_kt) + offs_n[:, None] * stride_kt
    v_ptrs = _first_row(V, b, stride_vb, kvh, stride_vh, start, stride_vt) + offs_n[:, None] * stride_vt
    k = tl.load(k_ptrs + offs_d[None, :], mask=key_ok, other=0.0)
    v = tl.load(v_ptrs + offs_d[None, :], mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    m_lo, full_lo, full_hi, m_hi = _query_ranges(start_n, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for part in tl.static_range(3):  # last-first: the masked tail, the unmasked middle, the masked diagonal
        lo, hi = _query_band(2 - part, m_lo, full_lo, full_hi, m_hi)
        dk, dv = _fused_tiles(
            dk, dv, k, v, Q, dOut, Stats, DQacc, Locks, b, start, kvh, group, n_block, lo, hi,
            stride_qb, stride_qt, stride_qh, stride_dob, stride_dot, stride_doh, stride_ab, stride_at,
            stride_ah, stride_lb, stride_lh, lock_b, lock_h, offs_n, offs_d, seq_len, window, qk_scale,
            sm_scale, BLOCK_M, BLOCK_N, part != 1, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    dk = dk * sm_scale
    dk_ptrs = _first_row(dK, b, stride_dkb, kvh, stride_dkh, start, stride_dkt) + offs_n[:, None] * stride_dkt
    dv_ptrs = _first_row(dV, b, stride_dvb, kvh, stride_dvh, start, stride_dvt) + offs_n[:, None] * stride_dvt
    tl.store(dk_ptrs + offs_d[None, :], dk.to(dK.dtype.element_ty), mask=key_ok)
    tl.store(dv_ptrs + offs_d[None, :], dv.to(dV.dtype.element_ty), mask=key_ok)
