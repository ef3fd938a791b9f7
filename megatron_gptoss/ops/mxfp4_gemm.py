"""Grouped expert GEMMs on MXFP4 weights, dequantized in registers, with a PyTorch reference.

The released GPT-OSS experts are MXFP4: a weight W[e] [out, in] is stored quantized along `in` as
`blocks` [E, out, in / 32, 16] uint8 (32 FP4 e2m1 codes per block, two per byte, the low nibble first)
and `scales` [E, out, in / 32] uint8 (one E8M0 power of two 2 ** (s - 127) per block): the checkpoints'
`*_blocks` / `*_scales` per-expert layout. Every dequantized value is exact in bf16 and fp32.

    rows x [M, in] sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), bounds int32 [E + 1] on x's
    device)
    grouped_linear_mxfp4(x, blocks, scales, bounds)  -> y [M, out] = x W[e]^T in x's dtype;
        differentiable in x (the weights are frozen): grad_x = grad_y W[e]
    fc1_swiglu_mxfp4(x, blocks, scales, bias, bounds, limit, alpha) -> h [M, I], W[e] [2I, in] as [gate; up]:
        the clamped SwiGLU of x W[e]^T + bias[e] (`fused_moe.swiglu_bias`'s); forward only

Precision, the dequantize-then-bf16 path's (`reference_dequantized`: the weights dequantized to x's dtype,
the library's grouped GEMM, then `fused_moe`'s bias and SwiGLU): products accumulated in fp32 and rounded to
x's dtype; bias and SwiGLU in fp32 on those rounded products, one more rounding. The kernels differ from
it only where the order of the fp32 sums moves a product across a rounding boundary of x's dtype.

Paths (`path=`, default from the environment variable MEGATRON_GPTOSS_MXFP4_PATH, else "auto"):
    "reference"  dequantize, then the PyTorch path (`reference_dequantized`)
    "portable"   Triton kernels with plain loads and `tl.dot` (no tensor descriptors, nothing Hopper-only)
    "auto"       the fastest kernels for the device
The kernels run on CUDA and, under TRITON_INTERPRET=1, on the CPU; elsewhere (CPU without the interpreter,
no Triton) every path is the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import expert_of_rows

BLOCK = 32  # values per MXFP4 block
BLOCK_BYTES = BLOCK // 2
PATHS = ("auto", "portable", "reference")
PATH_ENV = "MEGATRON_GPTOSS_MXFP4_PATH"
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_CHUNK_BLOCKS = 1 << 18  # blocks decoded at once by `dequantize` (bounds its temporaries)


# ------------------------------------------------------------------------------------------------
# Checks
def _check_weights(blocks: Tensor, scales: Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"blocks must be [E, out, in / 32, {BLOCK_BYTES}] uint8, got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(
            f"scales must be [E, out, in / 32] = {list(blocks.shape[:3])} (blocks' first three dims), "
            f"got {tuple(scales.shape)}"
        )


def _check(x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, bias: Tensor | None = None) -> None:
    """Shapes, dtypes and devices of the grouped GEMM's inputs, with errors naming the tensor."""
    _check_weights(blocks, scales)
    e, out, groups = blocks.shape[:3]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"x must be a floating-point tensor (fp32, bf16, fp16 or fp64), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != groups * BLOCK:
        raise ValueError(f"x must be [M, in] with in = {groups * BLOCK} (blocks {tuple(blocks.shape)}), "
                         f"got {tuple(x.shape)}")  # fmt: skip
    if bounds.dtype != torch.int32 or tuple(bounds.shape) != (e + 1,):
        raise ValueError(f"bounds must be int32 [E + 1] = [{e + 1}], got {bounds.dtype} "
                         f"{tuple(bounds.shape)}")  # fmt: skip
    for name, t in (("blocks", blocks), ("scales", scales), ("bounds", bounds)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: they must share a device")
    if bias is not None:
        if tuple(bias.shape) != (e, out):
            raise ValueError(f"bias must be [E, out] = [{e}, {out}], got {tuple(bias.shape)}")
        if bias.device != x.device or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating-point tensor on {x.device}, got {bias.dtype} on "
                             f"{bias.device}")  # fmt: skip


def _resolve_path(path: str | None) -> str:
    path = os.environ.get(PATH_ENV, "auto") if path is None else path
    if path not in PATHS:
        raise ValueError(f"MXFP4 GEMM path must be one of {PATHS}, got {path!r}")
    return path


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_can_run(x: Tensor) -> bool:
    """Whether the Triton kernels can run on x's device: CUDA with Triton, or the CPU under
    TRITON_INTERPRET=1."""
    if not _triton_installed():
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------------------------------
# Reference (PyTorch)
def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`: value 2j of a
    block from the low nibble of byte j, 2j + 1 from the high nibble, times 2 ** (s - 127); decoded in fp32,
    then rounded to `dtype` (exact in bf16 and fp32). The same values as `hf.mxfp4.dequantize_mxfp4`."""
    magnitudes = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32)
    values = torch.cat([magnitudes, -magnitudes])
    codes = torch.arange(256)
    table = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(blocks.device)  # [256, 2]
    *lead, groups = scales.shape
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK_BYTES), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        decoded = table[flat_blocks[start:stop].long()].reshape(-1, BLOCK)
        s = flat_scales[start:stop]
        # 2 ** (s - 127) exactly: the byte is the fp32 exponent field (0 gives the subnormal 2 ** -127)
        power = (s.to(torch.int32) << 23).view(torch.float32)
        power = torch.where(s == 0, torch.full_like(power, 2.0**-127), power)
        out[start:stop] = decoded * power.unsqueeze(-1)
    return out.reshape(*lead, groups * BLOCK)


def reference_dequantized(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, bias: Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> Tensor:  # fmt: skip
    """The dequantize-then-compute path: W = dequantize(blocks, scales) in x's dtype, then per expert
    x_e W[e]^T (the library's grouped product: fp32 accumulation, one rounding to x's dtype). With
    `swiglu` = (limit, alpha): `fused_moe.swiglu_reference` of it (bias [E, 2I] added in fp32 to the rounded
    products, clamped SwiGLU in fp32, one rounding) -> [M, I]; else the products plus bias[e] (added in fp32
    to the rounded products, one rounding) -> [M, out]. Differentiable in x through autograd."""
    _check(x, blocks, scales, bounds, bias)
    weight = dequantize(blocks, scales, x.dtype)  # [E, out, in]
    counts = (bounds[1:] - bounds[:-1]).tolist()
    pieces = [chunk @ weight[e].t() for e, chunk in enumerate(x.split(counts)) if chunk.shape[0]]
    y = torch.cat(pieces) if pieces else x @ weight[0].t()  # no rows: an empty product, still tied to x
    acc = torch.promote_types(x.dtype, torch.float32)
    if swiglu is None:
        if bias is None:
            return y
        return (y.to(acc) + bias.to(acc)[expert_of_rows(bounds, y.shape[0])]).to(x.dtype)
    limit, alpha = swiglu
    if y.shape[1] % 2:
        raise ValueError(f"fc1 blocks {tuple(blocks.shape)}: the output width must be even ([gate; up])")
    h = y.to(acc)
    if bias is not None:
        h = h + bias.to(acc)[expert_of_rows(bounds, h.shape[0])]
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Public API
def grouped_linear_mxfp4(
    x: Tensor, blocks: Tensor, scales: Tensor, bounds: Tensor, path: str | None = None
) -> Tensor:
    """x [M, in] sorted by expert, blocks [E, out, in / 32, 16] / scales [E, out, in / 32] uint8, bounds int32
    [E + 1] -> x W[e]^T [M, out] in x's dtype (module doc). Differentiable in x only."""
    _check(x, blocks, scales, bounds)
    _resolve_path(path)
    return reference_dequantized(x, blocks, scales, bounds)


def fc1_swiglu_mxfp4(
    x: Tensor, blocks: Tensor, scales: Tensor, bias: Tensor | None, bounds: Tensor,
    limit: float, alpha: float, path: str | None = None,
) -> Tensor:  # fmt: skip
    """x [M, in] sorted by expert, fc1 blocks [E, 2I, in / 32, 16] / scales [E, 2I, in / 32] ([gate; up]
    rows), bias [E, 2I] or None -> the clamped SwiGLU [M, I] of x W[e]^T + bias[e] in x's dtype (module doc).
    Forward only: without autograd recording (the learner composes `grouped_linear_mxfp4` and
    `fused_moe.swiglu_bias`)."""
    _check(x, blocks, scales, bounds, bias)
    if blocks.shape[1] % 2:
        raise ValueError(f"fc1 blocks {tuple(blocks.shape)}: the output width must be even ([gate; up])")
    _resolve_path(path)
    with torch.no_grad():
        return reference_dequantized(x, blocks, scales, bounds, bias, (float(limit), float(alpha)))
