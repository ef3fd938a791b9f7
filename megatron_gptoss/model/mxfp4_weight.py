"""A frozen expert weight held in MXFP4, the 4-bit format of the released GPT-OSS expert weights.

    logical weight  [E, out, in] in the run's dtype (what `Experts` multiplies by)
    blocks          [E, out, in / 32, 16] uint8: 32 FP4 (e2m1) codes per block, two per byte, low nibble first
    scales          [E, out, in / 32] uint8: one power of two per block, 2 ** (scale - 127)

The buffers are the released checkpoints' `<name>_blocks` / `<name>_scales` bytes (fc1's rows reordered from
HF's interleaved gate/up to our [gate; up], a permutation of whole rows), 4.25 bits a value. They are
buffers, not parameters: they never train, never enter an optimizer, and the expert GEMMs read them as they
are (`ops.mxfp4_gemm`). `dequantize` gives the logical weight, exactly (every MXFP4 value is exact in fp32 and
bf16); `parallel.loading` fills the buffers from a checkpoint or quantizes a random initialisation.

`byte_format` "pairs" (`model.mxfp4_byte_format`) holds each block's bytes re-encoded by
`ops.mxfp4_bytes.pair_words` (same shapes and size; decoded with about half the kernels' instructions): every
writer goes through `copy_packed_` / `copy_experts_`, which take the released bytes and re-encode them, and
every reader passes the format on (`dequantize`, the expert GEMMs), so checkpoints, exports and weight syncs
keep the released bytes. "tiled_pairs" holds the pairs' bytes and the scales stored tile by tile as well
(`ops.mxfp4_bytes.tile_experts`: the same shapes, each expert's bytes permuted), so that the decode kernels
read each tile of a K step as one contiguous run; it needs both widths to be multiples of 64.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.ops.mxfp4_bytes import (
    BLOCK,
    BLOCK_BYTES,
    byte_format_of,
    check_held_format,
    check_pairs_scales,
    check_tileable,
    held_blocks,
    held_scales,
    is_tiled,
)
from megatron_gptoss.ops.mxfp4_gemm import dequantize


class MXFP4Weight(nn.Module):
    """Expert weights [experts, out_features, in_features] as MXFP4 buffers `blocks` and `scales` (zero until
    filled). `dtype`: the dtype the weight is used in (the run's dtype: the experts' inputs and biases);
    `byte_format`: how `blocks` holds the bytes ("checkpoint", "pairs" or "tiled_pairs", module doc)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, experts: int, out_features: int, in_features: int, dtype=None, device=None,
        byte_format: str = "checkpoint",
    ):  # fmt: skip
        super().__init__()
        check_held_format(byte_format)
        self.byte_format = byte_format
        if in_features % BLOCK:
            raise ValueError(f"an MXFP4 weight needs in_features divisible by {BLOCK}, got {in_features}")
        if is_tiled(byte_format):
            check_tileable(out_features, in_features, "this MXFP4 expert weight")
        groups = in_features // BLOCK
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.register_buffer(
            "blocks",
            torch.zeros(experts, out_features, groups, BLOCK_BYTES, dtype=torch.uint8, device=device),
        )
        self.register_buffer(
            "scales", torch.zeros(experts, out_features, groups, dtype=torch.uint8, device=device)
        )

    def _apply(self, fn, recurse=True):
        """`module.to(...)`, `.cuda()`, `.bfloat16()`: the buffers keep their bytes (uint8 is never cast) and
        `dtype` follows the conversion floating-point tensors get."""
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.blocks.device)).dtype
        return self

    @property
    def shape(self) -> torch.Size:
        """The logical weight's shape [E, out, in]."""
        e, out, groups = self.scales.shape
        return torch.Size((e, out, groups * BLOCK))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def extra_repr(self) -> str:
        return (f"experts={self.shape[0]}, out={self.shape[1]}, in={self.shape[2]}, dtype={self.dtype}, "
                f"bytes={self.byte_format}")  # fmt: skip

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical weight [E, out, in] in `dtype` (default `self.dtype`); exact in fp32 and bf16."""
        return dequantize(self.blocks, self.scales, dtype or self.dtype, self.byte_format)

    @torch.no_grad()
    def copy_packed_(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Write the buffers from the released bytes of the same shapes (uint8), re-encoded into
        `byte_format`."""
        for name, src, dst in (("blocks", blocks, self.blocks), ("scales", scales, self.scales)):
            if src.dtype != torch.uint8 or tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"MXFP4 {name} must be uint8 {tuple(dst.shape)}, got {src.dtype} {tuple(src.shape)}"
                )
        self.copy_experts_(0, blocks, scales)

    @torch.no_grad()
    def copy_experts_(self, first: int, blocks: torch.Tensor | None, scales: torch.Tensor | None) -> None:
        """Write experts [first, first + n) from the released bytes: blocks [n, out, in / 32, 16] and / or
        scales [n, out, in / 32] (None: left as they are), blocks re-encoded into `byte_format`. The "pairs"
        format refuses scales outside 2..128 (weights beyond 12 in magnitude) with an error naming the
        range."""
        if scales is not None:
            if byte_format_of(self.byte_format) == "pairs":
                remedy = ": use model.mxfp4_byte_format=checkpoint"
                check_pairs_scales(scales, "these experts' scales", remedy)
            scales = held_scales(scales, self.byte_format)
            self.scales[first : first + scales.shape[0]].copy_(scales)
        if blocks is not None:
            blocks = held_blocks(blocks, self.byte_format)
            self.blocks[first : first + blocks.shape[0]].copy_(blocks)


def mxfp4_weights(model: nn.Module) -> dict[str, MXFP4Weight]:
    """Every MXFP4 weight of `model` by the name its parameter would have (`...linear_fc1.weight`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MXFP4Weight)}


def frozen_base(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base tensors of a LoRA model that an engine of the same layout can use as they are: every
    parameter but the adapters' and the MXFP4 weights' buffers (`<weight name>.blocks` / `.scales`)."""
    base: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if not is_adapter_param(n)}
    for name, weight in mxfp4_weights(model).items():
        base[f"{name}.blocks"], base[f"{name}.scales"] = weight.blocks, weight.scales
    return base
