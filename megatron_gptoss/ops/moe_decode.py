"""Expert GEMMs for few rows per expert (decode steps), forward only, with PyTorch references.

At decode a layer's experts see a few dozen rows each: the GEMMs read every weight of every expert hit
and do little arithmetic with it, so their time is the time to stream the weights from memory. One Triton
kernel (`megatron_gptoss.ops.moe_decode_kernels`) per GEMM reads each hit expert's weight once, with the
epilogue fused: fc1 with its bias and the clamped SwiGLU, fc2 with its bias, each optionally with an addend
(an expert adapter's update, `model.lora`) added to the products first.

    rows x [M, H] sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), bounds int32 [E + 1] on the
    device)
    decode_fc1(x, w1 [E, 2I, H] ([gate; up]), b1 [E, 2I] | None, bounds, limit, alpha,
               addend=a1 [M, 2I] ([gate; up]) | None) -> h [M, I]:
        g, u = x w1[e, :I]^T + a1[:, :I] + b1[e, :I], x w1[e, I:]^T + a1[:, I:] + b1[e, I:]
        h = (clamp(u, -limit, limit) + 1) * gate * sigmoid(alpha gate), gate = min(g, limit)
    decode_fc2(h [M, I], w2 [E, H, I], b2 [E, H] | None, bounds, addend=a2 [M, H] | None)
        -> y [M, H] = h w2[e]^T + a2 + b2[e]

Precision, the library path's (`torch._grouped_mm`, the addend added as a tensor, then `fused_moe`'s bias and
SwiGLU): operands read in their dtype, products accumulated in fp32 over K in a fixed order and rounded to
x's dtype, the addend added in fp32 and the sum rounded to x's dtype, bias and SwiGLU in fp32 on those
rounded values, one more rounding to x's dtype. The two paths then differ only where the order of the fp32
sums moves a product across a rounding boundary of x's dtype. Skipping the products' rounding (fp32 straight
into the epilogue) is closer to float64 but moves every bf16 output by up to half a unit in the last place
against the learner, which runs the library path: enough to flip the top-k experts of one token in 60 in the
next layer's router at gpt-oss width.
The grid is static and the bounds are read only on the device (CUDA-graph capturable); an expert without
rows costs one program exit per column block. No autograd: callers take this path only without gradients.

Scope: the model's experts take these kernels only inside `decode_scope()`, which the rollout engine enters
around its forward steps; the learner's forwards (with or without gradients) never do, so its log-probs
come from one expert path whatever autograd records.

Tiles (`DecodeConfig`): `default_config` picks them from the average rows per expert and fits the K loop's
buffers to the shared memory (`fit_shared_memory`); `python benchmarks/bench_moe_decode.py` times the
alternatives at gpt-oss-20b widths against the library path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import _cdiv, _pow2, expert_bias_reference, swiglu_reference

_SCOPE = {"depth": 0, "off": 0}


def in_decode_scope() -> bool:
    """Whether the caller runs inside `decode_scope` (the rollout engine's forward steps) and not inside
    `library_only`."""
    return _SCOPE["depth"] > 0 and _SCOPE["off"] == 0


@contextlib.contextmanager
def decode_scope() -> Iterator[None]:
    """Forwards inside the block may take the decode kernels (`Experts.decode_kernels`); nestable."""
    _SCOPE["depth"] += 1
    try:
        yield
    finally:
        _SCOPE["depth"] -= 1


@contextlib.contextmanager
def library_only() -> Iterator[None]:
    """Forwards inside the block never take the decode kernels, inside `decode_scope` too (the library
    path as a benchmark's baseline); nestable."""
    _SCOPE["off"] += 1
    try:
        yield
    finally:
        _SCOPE["off"] -= 1


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shapes and launch parameters of `decode_grouped_kernel`."""

    block_m: int  # rows per tile (an expert with more rows loops over tiles, rereading its weight block)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    warps: int
    stages: int  # software pipeline depth of the K loop
    swap: bool  # weight tile on the left of the product (module doc of the kernels)
    tma: bool = False  # tiles read through tensor descriptors (TMA) where the layout allows, else pointers


# Interpreter tiles (the CPU): small, few numpy calls; both orientations are tested.
CPU_CONFIG = DecodeConfig(block_m=16, block_n=16, block_k=16, warps=1, stages=1, swap=False)


# Shared memory the K loop's buffers may take (H100: 227 KB per block; the rest is left to the epilogue)
SHARED_MEMORY_BUDGET = 192 * 1024


def row_tile(rows: int, experts: int, factor: int) -> int:
    """`factor` x the average rows per expert as a power of two in [16, 128]."""
    return min(128, max(16, _pow2(factor * _cdiv(rows, max(experts, 1)))))


def fit_shared_memory(cfg: DecodeConfig, dtype: torch.dtype, gated: bool) -> DecodeConfig:
    """cfg with block_k (down to 64), then stages (down to 2), then block_k lowered until the pipelined
    tiles (per stage: the weight tile, two with `gated`, and the row tile) fit `SHARED_MEMORY_BUDGET`."""
    size = torch.empty((), dtype=dtype).element_size()
    block_k, stages = cfg.block_k, cfg.stages

    def over() -> bool:
        per_stage = ((2 if gated else 1) * cfg.block_n + cfg.block_m) * block_k * size
        return stages * per_stage > SHARED_MEMORY_BUDGET

    while over() and block_k > 64:
        block_k //= 2
    while over() and stages > 2:
        stages -= 1
    while over() and block_k > 16:
        block_k //= 2
    return dataclasses.replace(cfg, block_k=block_k, stages=stages)


def default_config(
    rows: int, experts: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, gated: bool = True
) -> DecodeConfig:
    """Tiles for `rows` expert-sorted rows over `experts` experts (fc1 when `gated`, else fc2). A row tile
    of twice the average rows per expert: an expert with more rows than a tile reads its weight again per
    extra tile (from HBM, as the other programs stream theirs through L2), and with the rows on the narrow
    side of the product (`swap`) a wider tile costs little."""
    if device.type != "cuda":
        return CPU_CONFIG
    block_m = row_tile(rows, experts, 2)
    # fc1's two accumulators over 128 rows take more registers than 4 warps hold (sm_90 spills)
    warps = 8 if gated and block_m >= 128 else 4
    cfg = DecodeConfig(block_m=block_m, block_n=64, block_k=128, warps=warps, stages=4, swap=True)
    return fit_shared_memory(cfg, dtype, gated)


def _kernels():
    """The Triton kernels, imported on first use (TRITON_INTERPRET must be set before, on the CPU)."""
    return importlib.import_module("megatron_gptoss.ops.moe_decode_kernels")


def _descriptors(x: Tensor, weight: Tensor, cfg: DecodeConfig):
    """(x_desc, w_desc) over x [M, K] and weight [E * rows, K], or (None, None) where a tensor descriptor
    cannot hold them (non-contiguous, or base / row stride not 16-byte aligned)."""
    size = x.element_size()
    ok = x.is_contiguous() and weight.is_contiguous() and (x.shape[1] * size) % 16 == 0
    if not (cfg.tma and ok and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0):
        return None, None
    descriptor = importlib.import_module("triton.tools.tensor_descriptor").TensorDescriptor
    x_desc = descriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = descriptor.from_tensor(weight.view(-1, weight.shape[2]), [cfg.block_n, cfg.block_k])
    return x_desc, w_desc


def _check(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    addend: Tensor | None,
    bounds: Tensor,
    out_rows: int,
    k: int,
) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != k or weight.shape[2] != k:
        raise ValueError(f"rows {tuple(x.shape)} and weight {tuple(weight.shape)} do not match (K = {k})")
    if bounds.dtype != torch.int32 or bounds.numel() != weight.shape[0] + 1:
        raise ValueError(f"bounds must be int32 [E + 1] = [{weight.shape[0] + 1}], got {bounds.dtype} "
                         f"{tuple(bounds.shape)}")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (weight.shape[0], out_rows):
        raise ValueError(f"bias {tuple(bias.shape)} must be [E, {out_rows}]")
    if addend is not None and (tuple(addend.shape) != (x.shape[0], out_rows) or addend.dtype != x.dtype):
        raise ValueError(f"addend must be [M, {out_rows}] = [{x.shape[0]}, {out_rows}] in the rows' dtype "
                         f"{x.dtype}, got {addend.dtype} {tuple(addend.shape)}")  # fmt: skip


def _launch(
    x: Tensor, weight: Tensor, bias: Tensor | None, addend: Tensor | None, bounds: Tensor, n: int,
    gated: bool, limit: float, alpha: float, config: DecodeConfig | None,
) -> Tensor:  # fmt: skip
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = bias if bias is None or bias.stride(-1) == 1 else bias.contiguous()
    addend = addend if addend is None or addend.stride(-1) == 1 else addend.contiguous()
    m, k = x.shape
    e = weight.shape[0]
    out = x.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    cfg = default_config(m, e, x.device, x.dtype, gated) if config is None else config
    has_bias, has_add = bias is not None, addend is not None
    bias_arg = weight if bias is None else bias
    add_arg = x if addend is None else addend
    x_desc, w_desc = _descriptors(x, weight, cfg)
    _kernels().decode_grouped_kernel[(_cdiv(n, cfg.block_n), e)](
        x, weight, bias_arg, add_arg, out, bounds, x_desc, w_desc, n, k, weight.shape[1],
        x.stride(0), weight.stride(0), weight.stride(1), bias_arg.stride(0) if has_bias else 0,
        add_arg.stride(0) if has_add else 0, out.stride(0), float(limit), float(alpha),
        GATED=gated, HAS_BIAS=has_bias, HAS_ADD=has_add, SWAP=cfg.swap, TMA=x_desc is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def decode_fc1(
    x: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor, limit: float, alpha: float,
    config: DecodeConfig | None = None, addend: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x [M, H] sorted by expert, weight [E, 2I, H] ([gate; up]), bias [E, 2I] or None, addend [M, 2I]
    ([gate; up]) in x's dtype or None -> the clamped SwiGLU of x w[e]^T + addend + b[e]: [M, I] in x's dtype
    (module doc)."""
    two_i = weight.shape[1] if weight.dim() == 3 else 0
    _check(x, weight, bias, addend, bounds, two_i, x.shape[-1])
    if two_i % 2:
        raise ValueError(f"fc1 weight {tuple(weight.shape)}: the output width must be even ([gate; up])")
    return _launch(x, weight, bias, addend, bounds, two_i // 2, True, limit, alpha, config)


def decode_fc2(
    h: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor, config: DecodeConfig | None = None,
    addend: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """h [M, I] sorted by expert, weight [E, H, I], bias [E, H] or None, addend [M, H] in h's dtype or None
    -> h w[e]^T + addend + b[e]: [M, H] in h's dtype (module doc)."""
    out_width = weight.shape[1] if weight.dim() == 3 else 0
    _check(h, weight, bias, addend, bounds, out_width, h.shape[-1])
    return _launch(h, weight, bias, addend, bounds, out_width, False, 0.0, 0.0, config)


def narrow_config(
    rows: int, experts: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> DecodeConfig:
    """Tiles for a product of `n` output columns over a reduction of `k` (an expert adapter's factor: A
    [E, r, in] has few columns, B [E, out, r] a short K): `default_config`'s, not gated, with the column
    tile cut to half of n (so that a narrow A runs two programs an expert) and the K step to k, each as a
    power of two of at least 16 (the matrix unit's smallest)."""
    cfg = default_config(rows, experts, device, dtype, gated=False)
    if device.type != "cuda":
        return cfg
    block_n = max(16, min(cfg.block_n, _pow2(n) // 2))
    return dataclasses.replace(cfg, block_n=block_n, block_k=max(16, min(cfg.block_k, _pow2(k))))


def decode_grouped(x: Tensor, weight: Tensor, bounds: Tensor, config: DecodeConfig | None = None) -> Tensor:
    """x [M, K] sorted by expert, weight [E, N, K] -> x w[e]^T: [M, N] in x's dtype, products rounded as
    `decode_fc2`'s (the library GEMM's output): an expert adapter's factor at decode (`model.lora`: x A[e]^T,
    then that times B[e]^T), on tiles fitted to its narrow shapes (`narrow_config`)."""
    out_width = weight.shape[1] if weight.dim() == 3 else 0
    _check(x, weight, None, None, bounds, out_width, x.shape[-1])
    if config is None:
        config = narrow_config(x.shape[0], weight.shape[0], out_width, x.shape[-1], x.device, x.dtype)
    return _launch(x, weight, None, None, bounds, out_width, False, 0.0, 0.0, config)


# ------------------------------------------------------------------------------------------------
# References (PyTorch): per-expert loop, computed in fp32 (float64 for float64 inputs); the products rounded
# to the inputs' dtype before the epilogue, as the kernels and the library path do, and so is their sum with
# the addend
def _grouped_reference(x: Tensor, weight: Tensor, bounds: Tensor) -> Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    counts = (bounds[1:] - bounds[:-1]).tolist()
    pieces = [chunk.to(acc) @ weight[e].to(acc).t() for e, chunk in enumerate(x.split(counts))]
    return torch.cat(pieces) if pieces else x.new_empty(0, weight.shape[1], dtype=acc)


def _rounded_products(
    x: Tensor, weight: Tensor, addend: Tensor | None, bounds: Tensor, dtype: torch.dtype
) -> Tensor:
    """The products rounded to `dtype`, plus the addend (in x's dtype or wider) rounded to `dtype` again;
    returned in x's dtype."""
    products = _grouped_reference(x, weight, bounds)
    rounded = products.to(dtype).to(products.dtype)
    if addend is not None:
        rounded = (rounded + addend.to(products.dtype)).to(dtype).to(products.dtype)
    return rounded.to(x.dtype)


# to `dtype` (default: the inputs'); float64 inputs with dtype=torch.bfloat16 give the exact products of
# bf16 operands correctly rounded, the ideal of the bf16 paths
def fc1_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor, limit: float, alpha: float,
    dtype: torch.dtype | None = None, addend: Tensor | None = None,
) -> Tensor:  # fmt: skip
    dtype = x.dtype if dtype is None else dtype
    products = _rounded_products(x, weight, addend, bounds, dtype)
    return swiglu_reference(products, bias, bounds, limit, alpha).to(dtype)


def fc2_reference(
    h: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor, dtype: torch.dtype | None = None,
    addend: Tensor | None = None,
) -> Tensor:  # fmt: skip
    dtype = h.dtype if dtype is None else dtype
    y = _rounded_products(h, weight, addend, bounds, dtype)
    return (y if bias is None else expert_bias_reference(y, bias, bounds)).to(dtype)
