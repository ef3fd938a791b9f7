"""MXFP4 expert weights re-laid for the forward kernel (`ops.mxfp4_kernels`): tile by tile and / or in another
byte format (`ops.mxfp4_bytes`), with the forward over them. `benchmarks/bench_mxfp4_gemm.py --relaid` times
the layouts; the model holds row-major weights (`model.mxfp4_byte_format` picks their byte format).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import _cdiv
from megatron_gptoss.ops.mxfp4_bytes import BLOCK, check_pairs_scales, pair_words, shuffle_bytes
from megatron_gptoss.ops.mxfp4_gemm import (
    BYTE_FORMATS,
    Mxfp4Config,
    _check_weights,
    _kernel_layout,
    _launch_forward,
    default_config,
    kernel_for,
)


@dataclass(frozen=True)
class KernelWeights:
    """An expert weight's MXFP4 bytes and scales re-laid for the forward kernel's (block_n, block_k) tiles
    (`kernel_weights`): `tiled`, stored tile by tile, so that the [block_n, block_k / 2] bytes and [block_n,
    block_k / 32] scales one program reads at one K step are each one contiguous run, not block_n runs a row
    stride apart; `byte_format` (BYTE_FORMATS): "checkpoint" the released bytes, "shuffled" each 16-byte
    block's bytes in `shuffle_bytes`' order, so that the bytes one thread of the matrix unit's operand decodes
    are side by side (one vector read from shared memory instead of one read a byte), "pairs" each block as
    `pair_words`' four 32-bit words, decoded into bf16 pairs in K's order by masks and one fma a pair."""

    # tiled: [E, halves, NB, KT, block_n, block_k / 2] uint8 (zero-padded); else [E, R, K / 32, 16]
    blocks: Tensor
    scales: Tensor  # tiled: [E, halves, NB, KT, block_n, block_k / 32] uint8; else [E, R, K / 32]
    n: int  # output columns (of each half: fc1's gate and up are tiled apart)
    k: int  # input columns
    gated: bool
    block_n: int
    block_k: int
    tiled: bool
    byte_format: str

    @property
    def layout(self) -> tuple[int, ...]:
        """The forward kernel's tile addressing (`_row_major_layout`'s order)."""
        b, s = self.blocks, self.scales
        if not self.tiled:
            sb, ss = b.stride(1), s.stride(1)
            return (self.n * sb, self.block_n * sb, self.block_k // 2, sb, self.n * ss, self.block_n * ss,
                    self.block_k // BLOCK, ss)  # fmt: skip
        return (
            b.stride(1),
            b.stride(2),
            b.stride(3),
            b.stride(4),
            s.stride(1),
            s.stride(2),
            s.stride(3),
            s.stride(4),
        )


def kernel_weights(
    blocks: Tensor, scales: Tensor, gated: bool, block_n: int, block_k: int, tiled: bool = True,
    byte_format: str = "checkpoint",
) -> KernelWeights:  # fmt: skip
    """blocks [E, R, K / 32, 16] / scales [E, R, K / 32] (R = 2N as [gate; up] when `gated`, else N) re-laid
    for the forward kernel's (block_n, block_k) tiles (`KernelWeights`): a copy, zero-padded to whole tiles
    when `tiled`. "pairs" holds scale bytes 2..128 only (weights up to 12 in magnitude): others are
    refused."""
    _check_weights(blocks, scales)
    if byte_format not in BYTE_FORMATS:
        raise ValueError(f"byte_format must be one of {BYTE_FORMATS}, got {byte_format!r}")
    if byte_format == "pairs":
        check_pairs_scales(scales)
    if block_k % BLOCK or block_n <= 0:
        raise ValueError(f"tiles must be block_n > 0 rows by a multiple of {BLOCK} columns, got {block_n} x "
                         f"{block_k}")  # fmt: skip
    e, r = blocks.shape[:2]
    halves = 2 if gated else 1
    if r % halves:
        raise ValueError(f"fc1 blocks {tuple(blocks.shape)}: the output width must be even ([gate; up])")
    n, k = r // halves, blocks.shape[2] * BLOCK
    nb, kt = _cdiv(n, block_n), _cdiv(k, block_k)

    def tiled_copy(t: Tensor, per_k: int) -> Tensor:
        t = t.reshape(e, halves, n, -1)
        t = torch.nn.functional.pad(t, (0, kt * per_k - t.shape[-1], 0, nb * block_n - n))
        return t.reshape(e, halves, nb, block_n, kt, per_k).permute(0, 1, 2, 4, 3, 5).contiguous()

    if byte_format == "shuffled":
        blocks = shuffle_bytes(blocks)
    elif byte_format == "pairs":
        blocks = pair_words(blocks)
    if tiled:
        blocks, scales = tiled_copy(blocks, block_k // 2), tiled_copy(scales, block_k // BLOCK)
    else:
        blocks, scales = _kernel_layout(blocks.contiguous(), scales)
    return KernelWeights(blocks, scales, n, k, gated, block_n, block_k, tiled, byte_format)


def held_like(byte_format: str) -> str:
    """The held format (`mxfp4_bytes.HELD_FORMATS`) whose `default_config` tiles suit BYTE_FORMATS'
    `byte_format`: the pairs' for the pairs, the checkpoint's for the shuffled bytes (decoded a block vector
    at a time, as the checkpoint's are by the "groups" decoding)."""
    return "pairs" if byte_format == "pairs" else "checkpoint"


def forward_kernel_weights(
    x: Tensor, weights: KernelWeights, bias: Tensor | None, bounds: Tensor, limit: float = 0.0,
    alpha: float = 0.0, config: Mxfp4Config | None = None, addend: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """`fc1_swiglu_mxfp4` (weights.gated: the clamped SwiGLU [M, N]) or `grouped_linear_mxfp4`'s forward plus
    bias[e] ([M, N]) over re-laid weights, by the portable kernel at the weights' block_n and block_k: the
    same products in the same K order as over the checkpoint's layout. Forward only; x [M, K] sorted by
    expert, on CUDA, or fp32 on the CPU under TRITON_INTERPRET=1."""
    e = weights.blocks.shape[0]
    if x.dim() != 2 or x.shape[1] != weights.k:
        raise ValueError(f"x must be [M, {weights.k}] (the weights' input width), got {tuple(x.shape)}")
    if bounds.dtype != torch.int32 or tuple(bounds.shape) != (e + 1,):
        raise ValueError(
            f"bounds must be int32 [E + 1] = [{e + 1}], got {bounds.dtype} {tuple(bounds.shape)}"
        )
    if kernel_for(x, "portable") != "portable":
        raise ValueError(f"re-laid MXFP4 weights need the Triton kernels: {x.dtype} rows on {x.device} "
                         "cannot run them (CUDA, or fp32 rows on the CPU under the interpreter)")  # fmt: skip
    out = (2 if weights.gated else 1) * weights.n
    if bias is not None and tuple(bias.shape) != (e, out):
        raise ValueError(f"bias must be [E, out] = [{e}, {out}], got {tuple(bias.shape)}")
    if addend is not None and tuple(addend.shape) != (x.shape[0], out):
        raise ValueError(f"addend must be [M, out] = [{x.shape[0]}, {out}], got {tuple(addend.shape)}")
    cfg = config
    if cfg is None:
        cfg = default_config(x.shape[0], e, x.device, weights.gated, held_like(weights.byte_format))
        cfg = dataclasses.replace(cfg, block_n=weights.block_n, block_k=weights.block_k, sub_k=0)
    if (cfg.block_n, cfg.block_k) != (weights.block_n, weights.block_k):
        raise ValueError(f"the kernel's tiles {cfg.block_n} x {cfg.block_k} must be the weights' "
                         f"{weights.block_n} x {weights.block_k}")  # fmt: skip
    with torch.no_grad():
        return _launch_forward(
            x, weights.blocks, weights.scales, weights.layout, weights.n, bias, addend, bounds, weights.gated,
            limit, alpha, "portable", cfg, None, BYTE_FORMATS.index(weights.byte_format),
        )  # fmt: skip
