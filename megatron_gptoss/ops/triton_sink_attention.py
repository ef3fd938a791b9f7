"""Our Triton sink attention: training forward + backward (`triton_sink_attention`) and the decode/append
path of the embedded rollout engine (`triton_sink_decode`).

Contract: `megatron_gptoss.ops.sink_attention` (causal, per-head sinks, optional window W: query i sees
keys j with i - W < j <= i; GQA of any ratio; padded [B, T, H, D] or packed [N, H, D] + cu_seqlens).
head_dim 16, 32, 64 or 128; fp32, bf16 or fp16 inputs, fp32 softmax and accumulation (fp32 dots in
IEEE precision, never TF32). Sinks are read as stored and upcast to fp32; their gradient is returned
in their dtype.

Determinism and batch invariance:
- the backward writes every dK/dV element from one program (the query heads of a KV group are looped
  inside) and reduces d_sink from per-tile partials in a fixed order: gradients are bitwise identical
  across runs;
- the tiling depends only on (device, head_dim, dtype, window or not) through `default_config`, and a
  row's key loop only on its position, so a row computes the same bits whether it comes in a padded
  batch, a packed batch or a decode step (`triton_sink_decode`).

On the CPU the kernels run under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_gptoss.errors import AttentionInputError
from megatron_gptoss.ops import triton_sink_kernels as kernels

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2: the forward's query tiles, every kernel's sequences
# the kernels address a row inside its sequence with 32-bit offsets (row x token stride); the sequence's
# start and the batch row go into a 64-bit base pointer
ROW_OFFSET_LIMIT = 2**31
SINK_CHUNK = 1024  # d_sink partials summed per step by the one program of a KV head that sums them


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch parameters. The forward's (block_m, block_n, fwd_warps) fix the tiling and
    reduction order of a row; the decode path must use the same config as the training forward."""

    block_m: int  # forward / decode query tile (rows)
    block_n: int  # forward / decode key block
    fwd_warps: int
    fwd_stages: int
    dkdv_block_m: int  # dK/dV: query block looped inside
    dkdv_block_n: int  # dK/dV: key block owned by a program
    dkdv_warps: int
    dkdv_stages: int
    dq_block_m: int  # dQ: query tile owned by a program
    dq_block_n: int  # dQ: key block looped inside
    dq_warps: int
    dq_stages: int
    dkdv_pair: bool = True  # causal: a dK/dV program takes key blocks p and last - p (balanced work)
    # dQ accumulated inside the dK/dV kernel in key-block order (ordered counters per query tile), no dQ pass
    fused_dq: bool = False
    # the dK/dV kernel's query tiles (Q and dO) loaded through TMA tensor descriptors where the layout
    # allows (`_row_descriptor`): the same values, so the same bits
    tma: bool = False
    # cap on the dQ kernel's registers per thread (ptxas): at 128 two 8-warp programs share an SM; a packed
    # batch's sequence starts, held in registers, otherwise take it to about 140 and one program per SM
    dq_max_registers: int | None = None


def default_config(
    head_dim: int, dtype: torch.dtype, windowed: bool, device: torch.device, max_seqlen: int | None = None
) -> KernelConfig:
    """The config used when none is given. The forward fields depend on (device, head_dim, dtype,
    windowed) only, so training and decode tile a row alike (batch invariance); the backward fields may
    also depend on the longest sequence. Tiles measured on H100/H200 at GPT-OSS shapes (head_dim 64,
    64 q heads, 8 kv heads, bf16; benchmarks/bench_attention.py --sweep)."""
    long = max_seqlen is not None and max_seqlen > 4096
    if device.type != "cuda":  # interpreter: small tiles keep CPU tests fast and multi-block
        return KernelConfig(16, 16, 1, 1, 16, 16, 1, 1, 16, 16, 1, 1, tma=True)
    if dtype == torch.float32:  # tests only: IEEE fp32 dots, modest tiles
        return KernelConfig(32, 32, 4, 2, 32, 32, 4, 2, 32, 32, 4, 2)
    if head_dim > 64:
        return KernelConfig(128, 64, 8, 3, 32, 64, 4, 3, 64, 64, 4, 3)
    if windowed:
        return KernelConfig(64, 32, 4, 3, 32, 64, 4, 3, 64, 32, 4, 3)
    tma = torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9  # Hopper and later
    dkdv = (64, 64, 4, 3) if tma else (32, 64, 4, 3)
    dq = (128, 64, 8, 3) if long else (64, 64, 4, 3)
    cap = 128 if long and torch.version.hip is None else None  # `maxnreg` is NVIDIA's
    return KernelConfig(128, 64, 8, 3, *dkdv, *dq, tma=tma, dq_max_registers=cap)


def is_supported(q: torch.Tensor) -> bool:
    """CUDA tensors (any GPU Triton compiles for), or CPU tensors under TRITON_INTERPRET=1; head_dim and
    dtype in the supported sets."""
    on_device = q.is_cuda or (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and q.shape[-1] in HEAD_DIMS and q.dtype in DTYPES


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> None:
    if q.shape[-1] not in HEAD_DIMS:
        raise AttentionInputError(f"triton backend: head_dim {q.shape[-1]} not in {HEAD_DIMS}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionInputError(
            f"triton backend: q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise AttentionInputError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if not is_supported(q):
        raise AttentionInputError(
            f"triton backend cannot run on {q.device} here (CPU needs TRITON_INTERPRET=1)"
        )
    if softmax_scale is not None and not softmax_scale > 0:
        raise AttentionInputError(f"softmax_scale must be > 0, got {softmax_scale}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fits_row_offsets(t: torch.Tensor, rows: int) -> bool:
    """Whether `rows` rows of t (one tile of slack past them) stay within 32-bit offsets from a
    sequence's first row."""
    return (rows + 256) * _seq_strides(t)[1] < ROW_OFFSET_LIMIT


def _check_row_offsets(longest: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not _fits_row_offsets(t, longest):
            raise AttentionInputError(
                f"triton backend: a sequence of {longest} tokens at {name}'s token stride of "
                f"{_seq_strides(t)[1]} elements passes 32-bit row offsets ({ROW_OFFSET_LIMIT}); "
                "split the sequence or pass a contiguous layout"
            )


def _seq_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) strides; a packed [N, H, D] tensor has batch stride 0."""
    if t.dim() == 3:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of an LSE [B, H, T] or [H, N]; the token stride must be 1."""
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def _row_descriptor(t: torch.Tensor, block_rows: int) -> tuple[TensorDescriptor, int] | None:
    """A TMA descriptor over t ([B, T, H, D] or packed [N, H, D]) read as [rows, H * D] with blocks of
    [block_rows, D] (one head's rows), and the rows between batch rows (0 when packed); None where the
    layout has no such view (heads not side by side, batch stride not a whole number of rows) or breaks
    TMA's 16-byte alignment of the base and row stride."""
    d = t.shape[-1]
    batch_stride, row_stride, head_stride = _seq_strides(t)
    size = t.element_size()
    if head_stride != d or t.stride(-1) != 1 or batch_stride % row_stride:
        return None
    if t.data_ptr() % 16 or (row_stride * size) % 16:
        return None
    rows_per_b = batch_stride // row_stride
    rows = t.shape[0] if t.dim() == 3 else (t.shape[0] - 1) * rows_per_b + t.shape[1]
    desc = TensorDescriptor(t, [rows, t.shape[-2] * d], [row_stride, 1], [block_rows, d])
    return desc, rows_per_b


def _tma_args(cfg: KernelConfig, q: torch.Tensor, dout: torch.Tensor) -> tuple:
    """(Q's descriptor, dO's descriptor, rows per batch row, use them) for the dK/dV kernel: descriptors when
    `cfg.tma` and both layouts allow them, else (None, None, 0, False) and pointer loads."""
    if cfg.tma:
        q_view, do_view = _row_descriptor(q, cfg.dkdv_block_m), _row_descriptor(dout, cfg.dkdv_block_m)
        if q_view is not None and do_view is not None and q_view[1] == do_view[1]:
            return q_view[0], do_view[0], q_view[1], True
    return None, None, 0, False


def _register_cap(max_registers: int | None) -> dict:
    """Launch options capping a kernel's registers per thread (NVIDIA's `maxnreg`); none when uncapped."""
    return {} if max_registers is None else {"maxnreg": max_registers}


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 dots in IEEE precision (no TF32); half-precision dots use Triton's default."""
    return "ieee" if dtype == torch.float32 else None


# ------------------------------------------------------------------------------------------------
# Launchers
def _forward(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cfg, seqused_k=None):
    """out in q's layout, lse [B, Hq, Tq] or [Hq, N] fp32. With seqused_k (decode), q is [B, Tq, Hq, D]
    and k/v [B, L, Hkv, D] with seqused_k[b] <= L valid keys, queries at the last Tq positions."""
    packed = cu_seqlens is not None
    hq, d = q.shape[-2], q.shape[-1]
    group = hq // k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if packed:
        batch, seqlen = cu_seqlens.numel() - 1, max_seqlen
        lse = torch.empty((hq, q.shape[0]), dtype=torch.float32, device=q.device)
    else:
        batch, seqlen = q.shape[0], q.shape[1]
        lse = torch.empty((batch, hq, seqlen), dtype=torch.float32, device=q.device)
    if seqused_k is None:
        num_m_blocks = triton.cdiv(seqlen, cfg.block_m)
    else:  # the new rows may straddle one more tile boundary than their count suggests
        num_m_blocks = triton.cdiv(seqlen, cfg.block_m) + 1
    grid = (hq, num_m_blocks, batch)
    kernels.sink_attn_fwd_kernel[grid](
        q, k, v, sinks, out, lse, cu_seqlens, seqused_k,
        *_seq_strides(q), *_seq_strides(k), *_seq_strides(v), *_seq_strides(out), *_lse_strides(lse),
        seqlen, window or 0, scale * math.log2(math.e), group, num_m_blocks,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, VARLEN=packed,
        SEQUSED_K=seqused_k is not None, HAS_WINDOW=window is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )  # fmt: skip
    return out, lse


def _geometry(q, k, cu_seqlens, max_seqlen):
    """(sequences, longest sequence, q heads per kv head) of a training input."""
    packed = cu_seqlens is not None
    batch = cu_seqlens.numel() - 1 if packed else q.shape[0]
    seqlen = max_seqlen if packed else q.shape[1]
    return batch, seqlen, q.shape[-2] // k.shape[-2]


def _sink_grads(q, sinks, lse, batch, tiles):
    """The rows' (LSE, Delta) pairs (LSE's shape + 2, at twice LSE's offsets: lse must be contiguous), the
    d_sink partials [Hq, sequences * tiles] and d_sink, unfilled: the first backward kernel writes the pairs
    and the partials, the second reads the pairs and sums the partials into d_sink."""
    stats = torch.empty((*lse.shape, 2), dtype=torch.float32, device=lse.device)
    partials = torch.empty((q.shape[-2], batch * tiles), dtype=torch.float32, device=q.device)
    return stats, partials, torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)


def _dlse_args(dlse):
    """(dLse, its batch and head strides), a dummy pointer with zero strides when the loss ignores the LSE."""
    return (dlse, *_lse_strides(dlse)) if dlse is not None else (None, 0, 0)


def _bwd_preprocess(q, k, sinks, out, lse, dout, dlse, cu_seqlens, max_seqlen):
    """(LSE, Delta = rowsum(dO * O) - dLSE) pairs and the d_sink partials, for the one-pass backward (the
    two-pass backward takes them in its dQ kernel)."""
    batch, seqlen, _ = _geometry(q, k, cu_seqlens, max_seqlen)
    blocks = triton.cdiv(seqlen, 64)
    stats, partials, dsinks = _sink_grads(q, sinks, lse, batch, blocks)
    dlse, *dlse_strides = _dlse_args(dlse)
    kernels.sink_attn_bwd_preprocess_kernel[(blocks, q.shape[-2], batch)](
        out, dout, lse, dlse, sinks, stats, partials, cu_seqlens,
        *_seq_strides(out), *_seq_strides(dout), *_lse_strides(lse), *dlse_strides, seqlen, blocks,
        HEAD_DIM=q.shape[-1], BLOCK_M=64, VARLEN=cu_seqlens is not None, HAS_DLSE=dlse is not None,
    )  # fmt: skip
    return stats, partials, dsinks


def _bwd_dq(q, k, v, sinks, out, dout, lse, dlse, cu_seqlens, max_seqlen, window, scale, cfg):
    """dQ, and on the way the (LSE, Delta) pairs and the d_sink partials (read by the dK/dV kernel)."""
    batch, seqlen, group = _geometry(q, k, cu_seqlens, max_seqlen)
    blocks = triton.cdiv(seqlen, cfg.dq_block_m)
    stats, partials, dsinks = _sink_grads(q, sinks, lse, batch, blocks)
    dlse, *dlse_strides = _dlse_args(dlse)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernels.sink_attn_bwd_dq_kernel[(blocks, q.shape[-2], batch)](
        q, k, v, out, dout, lse, dlse, sinks, stats, partials, dq, cu_seqlens,
        *_seq_strides(q), *_seq_strides(k), *_seq_strides(v), *_seq_strides(out), *_seq_strides(dout),
        *_seq_strides(dq), *_lse_strides(lse), *dlse_strides, seqlen, window or 0,
        scale * math.log2(math.e), scale, group, blocks,
        HEAD_DIM=q.shape[-1], BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        VARLEN=cu_seqlens is not None, HAS_WINDOW=window is not None, HAS_DLSE=dlse is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
        **_register_cap(cfg.dq_max_registers),
    )  # fmt: skip
    return dq, stats, partials, dsinks


def _bwd_dkdv(q, k, v, dout, lse, stats, partials, dsinks, cu_seqlens, max_seqlen, window, scale, cfg):
    """dK, dV, and d_sink from the partials."""
    batch, seqlen, group = _geometry(q, k, cu_seqlens, max_seqlen)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    pair = window is None and cfg.dkdv_pair
    blocks = triton.cdiv(seqlen, cfg.dkdv_block_n)
    q_desc, do_desc, rows_per_b, tma = _tma_args(cfg, q, dout)
    kernels.sink_attn_bwd_dkdv_kernel[(triton.cdiv(blocks, 2) if pair else blocks, k.shape[-2], batch)](
        q, k, v, dout, stats, dk, dv, partials, dsinks, cu_seqlens, q_desc, do_desc, rows_per_b,
        *_seq_strides(q), *_seq_strides(k), *_seq_strides(v), *_seq_strides(dout), *_seq_strides(dk),
        *_seq_strides(dv), *_lse_strides(lse), seqlen, window or 0, scale * math.log2(math.e), scale, group,
        partials.shape[1],
        HEAD_DIM=q.shape[-1], BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
        VARLEN=cu_seqlens is not None, HAS_WINDOW=window is not None, PAIR=pair, SINK_CHUNK=SINK_CHUNK,
        TMA=tma, DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.dkdv_warps,
        num_stages=cfg.dkdv_stages,
    )  # fmt: skip
    return dk, dv


def _bwd_fused(q, k, v, dout, lse, stats, partials, dsinks, cu_seqlens, max_seqlen, window, scale, cfg):
    """dK, dV and dQ from one kernel: dQ summed in fp32 in key-block order, then cast; d_sink from the
    partials."""
    batch, seqlen, group = _geometry(q, k, cu_seqlens, max_seqlen)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    hq, hkv = q.shape[-2], k.shape[-2]
    tiles = triton.cdiv(seqlen, cfg.dkdv_block_m)
    locks = torch.zeros((batch, hq, tiles), dtype=torch.int32, device=q.device)
    kernels.sink_attn_bwd_fused_kernel[(hkv * batch, triton.cdiv(seqlen, cfg.dkdv_block_n))](
        q, k, v, dout, stats, dk, dv, dq_acc, locks, partials, dsinks, cu_seqlens,
        *_seq_strides(q), *_seq_strides(k), *_seq_strides(v), *_seq_strides(dout), *_seq_strides(dk),
        *_seq_strides(dv), *_seq_strides(dq_acc), *_lse_strides(lse), hq * tiles, tiles, seqlen,
        window or 0, scale * math.log2(math.e), scale, group, hkv, partials.shape[1],
        HEAD_DIM=q.shape[-1], BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
        VARLEN=cu_seqlens is not None, HAS_WINDOW=window is not None, SINK_CHUNK=SINK_CHUNK,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )  # fmt: skip
    return dq_acc.to(q.dtype), dk, dv


def _backward(q, k, v, sinks, out, lse, dout, dlse, cu_seqlens, max_seqlen, window, scale, cfg):
    """Two launches: dQ (with the (LSE, Delta) pairs and the d_sink partials), then dK/dV (with d_sink).
    The one-pass backward (`cfg.fused_dq`) takes the pairs from a preprocess kernel instead."""
    lse = lse.contiguous()  # the pairs sit at twice its offsets (`_sink_grads`); ours always is
    dout = _last_dim_contiguous(dout)
    if not _fits_row_offsets(dout, max_seqlen if cu_seqlens is not None else dout.shape[1]):
        dout = dout.contiguous()  # a token stride no wider than q's, which fits (checked in the forward)
    if dlse is not None and dlse.stride(-1) != 1:
        dlse = dlse.contiguous()
    geometry = (cu_seqlens, max_seqlen, window, scale, cfg)
    if cfg.fused_dq:
        stats, partials, dsinks = _bwd_preprocess(q, k, sinks, out, lse, dout, dlse, cu_seqlens, max_seqlen)
        dq, dk, dv = _bwd_fused(q, k, v, dout, lse, stats, partials, dsinks, *geometry)
        return dq, dk, dv, dsinks
    dq, stats, partials, dsinks = _bwd_dq(q, k, v, sinks, out, dout, lse, dlse, *geometry)
    dk, dv = _bwd_dkdv(q, k, v, dout, lse, stats, partials, dsinks, *geometry)
    return dq, dk, dv, dsinks


class SinkAttentionFunction(torch.autograd.Function):
    """(q, k, v, sinks) -> (out, lse); differentiable in all four, the loss may use both outputs."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cfg):
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        out, lse = _forward(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cfg)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, sinks, out, lse, cu_seqlens)
        ctx.args = (max_seqlen, window, scale, cfg)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, window, scale, cfg = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dsinks = _backward(
            q, k, v, sinks, out, lse, dout, dlse, cu_seqlens, max_seqlen, window, scale, cfg
        )
        return dq, dk, dv, dsinks, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# Public API
def triton_sink_attention(
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
    config: KernelConfig | None = None,
):
    """Causal sink attention, differentiable in q, k, v and sinks.

    q [B, T, Hq, D], k/v [B, T, Hkv, D]; or packed q [N, Hq, D], k/v [N, Hkv, D] with cu_seqlens int32
    [docs + 1] on q's device (max_seqlen: the longest document, read from cu_seqlens when None).
    sinks [Hq]. Returns out in q's layout and dtype, and with return_lse the fp32 natural-log LSE
    [B, Hq, T] or [Hq, N] (sink included). `config` overrides `default_config` (tuning only: decode rows
    equal training rows only under the same config)."""
    _check(q, k, v, softmax_scale)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens is not None:
        if cu_seqlens.device != q.device:
            raise AttentionInputError(f"cu_seqlens on {cu_seqlens.device}, q on {q.device}")
        given = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if max_seqlen is None else max_seqlen
        max_seqlen = max(int(given), 1)
    sequences, longest, _ = _geometry(q, k, cu_seqlens, max_seqlen)
    _check_row_offsets(longest, q=q, k=k, v=v)
    cfg = config or default_config(q.shape[-1], q.dtype, window is not None, q.device, longest)
    if triton.cdiv(longest, cfg.block_m) > MAX_GRID_YZ or sequences > MAX_GRID_YZ:
        raise AttentionInputError(
            f"triton backend: {sequences} sequences of up to {longest} tokens exceed the launch grid "
            f"(at most {MAX_GRID_YZ} sequences and {MAX_GRID_YZ} query tiles of {cfg.block_m} rows); "
            "split the batch"
        )
    out, lse = SinkAttentionFunction.apply(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cfg)
    return (out, lse) if return_lse else out


def triton_sink_decode(
    q_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sinks: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    config: KernelConfig | None = None,
):
    """Attention of a few new queries per sequence against a KV cache (decode / append), no gradient.

    q_new [B, n_new, Hq, D]; k_cache, v_cache [B, L, Hkv, D] already holding the new tokens' keys and
    values; cache_seqlens int32 [B]: valid cache entries per sequence, new tokens included
    (cache_seqlens[b] <= L; not checked on the device, to keep decode free of host syncs).
    Query r of sequence b sits at position cache_seqlens[b] - n_new + r and sees cache entries j with
    0 <= j <= position (and position - window < j); a query before position 0 (a short row left-padded in
    a prefill group) sees none: its output is 0. Returns out [B, n_new, Hq, D] (and LSE [B, Hq, n_new]).

    Bitwise contract: each output row (and LSE) equals the row at the same position of
    `triton_sink_attention` run on the whole sequence (padded or packed), on the same device with the
    same dtype, head_dim, window, scale and config."""
    if q_new.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise AttentionInputError(
            f"decode expects q_new [B, n_new, Hq, D] and k/v cache [B, L, Hkv, D], got "
            f"{tuple(q_new.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, n_new, hq, d = q_new.shape
    if k_cache.shape[0] != batch or k_cache.shape[-1] != d or hq % k_cache.shape[2]:
        raise AttentionInputError(
            f"q_new {tuple(q_new.shape)} and cache {tuple(k_cache.shape)} disagree on batch, head_dim or GQA"
        )
    if n_new > k_cache.shape[1]:
        raise AttentionInputError(f"{n_new} new queries do not fit a cache of {k_cache.shape[1]} entries")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
        raise AttentionInputError(
            f"cache_seqlens must be int32 [{batch}], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    if sinks.shape != (hq,):
        raise AttentionInputError(f"sinks has shape {tuple(sinks.shape)}; expected ({hq},)")
    if window is not None and window < 1:
        raise AttentionInputError(f"window must be >= 1 (query sees itself), got {window}")
    _check(q_new, k_cache, v_cache, softmax_scale)
    _check_row_offsets(n_new, q_new=q_new)
    _check_row_offsets(k_cache.shape[1], k_cache=k_cache, v_cache=v_cache)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    cfg = config or default_config(d, q_new.dtype, window is not None, q_new.device)
    q_new, k_cache, v_cache = (_last_dim_contiguous(t) for t in (q_new, k_cache, v_cache))
    with torch.no_grad():
        out, lse = _forward(
            q_new, k_cache, v_cache, sinks, None, None, window, scale, cfg, seqused_k=cache_seqlens
        )
    return (out, lse) if return_lse else out
