"""MXFP4 grouped expert GEMMs (megatron_gptoss.ops.mxfp4_gemm) on the CPU under the Triton interpreter,
fp32, tiny shapes: forward and input gradient against the dequantize-then-compute reference (fresh random
blocks, scales in 120..130, uneven experts with one without rows, partial column and K blocks, experts over
several row tiles and programs), the fc1 + SwiGLU forward against the reference and against the learner's
composition (`grouped_linear_mxfp4` + `fused_moe.swiglu_bias`), both with an addend (an adapter's update),
the `tl.dot_scaled` kernel on bf16 rows (its products viewed in fp32: the interpreter's bf16 casts truncate
and its bf16 `tl.dot` is not modelled), the dequantization against `hf.mxfp4`, and clear errors. Errors per
tensor are ||ours - ref|| / ||ref||."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import triton
import triton.language as tl
from helpers.triton_cpu import interpreted

from megatron_gptoss.config.model import MXFP4_BYTE_FORMATS, MXFP4_TILE
from megatron_gptoss.hf.mxfp4 import dequantize_mxfp4
from megatron_gptoss.ops import fused_moe, mxfp4_bytes, mxfp4_gemm, mxfp4_kernels, mxfp4_relaid
from megatron_gptoss.ops.mxfp4_gemm import (
    Mxfp4Config,
    fc1_swiglu_mxfp4,
    grouped_linear_mxfp4,
    reference_dequantized,
)

LIMIT, ALPHA = 7.0, 1.702
# Tiles whose K step (64) leaves a partial block at K = 96, column blocks of 16 over 40 columns
TILES = Mxfp4Config(
    block_m=16, block_n=16, block_k=64, warps=1, stages=1, bwd_block_m=16, bwd_block_r=16, bwd_block_k=64,
    bwd_warps=1,
)  # fmt: skip


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def weights(experts: int, out: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [E, out, width / 32, 16] (every code) and scales in 120..130."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, width // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, (experts, out, width // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def rows(counts: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(sum(counts), width, generator=g), bounds


def test_dequantize_equals_hf_reference():
    """Every byte and every scale byte (0 and 255 included): the same bits as hf.mxfp4's decoder."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 2).reshape(256, 2, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(256, 2, 16).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        ours = mxfp4_gemm.dequantize(blocks, scales, dtype)
        ref = dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


@interpreted
def test_dequantize_kernel_equals_the_reference():
    """The dequantized path's one-launch decoding: every byte, every scale byte of its range (0 .. 240) and a
    partial last program, the same bits as `dequantize` in fp32; in bf16 from scale 2 up (the interpreter's
    casts to bf16 flush the subnormal values of scales 0 and 1 to zero; the GPU test covers them)."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 37, 5, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, :, :] = torch.arange(80, dtype=torch.uint8).reshape(5, 16)
    blocks[0, 1, :, :] = torch.arange(80, 160, dtype=torch.uint8).reshape(5, 16)
    blocks[0, 2, :, :] = torch.arange(160, 240, dtype=torch.uint8).reshape(5, 16)
    blocks[0, 3, :1, :] = torch.arange(240, 256, dtype=torch.uint8)
    scales = torch.randint(0, 241, (3, 37, 5), generator=g, dtype=torch.uint8)
    scales[1, 0, :] = torch.tensor([0, 1, 127, 239, 240], dtype=torch.uint8)
    ours = mxfp4_gemm.dequantize_kernel(blocks, scales, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == (3, 37, 160)
    assert torch.equal(ours, mxfp4_gemm.dequantize(blocks, scales, torch.float32))
    scales = scales.clamp(min=2)
    ours = mxfp4_gemm.dequantize_kernel(blocks, scales, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, mxfp4_gemm.dequantize(blocks, scales, torch.bfloat16))
    experts = mxfp4_gemm.dequantize_kernel(blocks[1:], scales[1:], torch.float32)  # a slice of experts
    assert torch.equal(experts, mxfp4_gemm.dequantize(blocks[1:], scales[1:], torch.float32))


@triton.jit
def _decode_rows_kernel(B, S, Out, BYTES: tl.constexpr):
    """Row r of B [R, BYTES] bytes with scales S [R, BYTES / 16] -> Out [R, 2 BYTES] fp32, the kernels'
    in-register decoding."""
    r = tl.program_id(0)
    j = tl.arange(0, BYTES)
    even, odd = mxfp4_kernels._decode(
        B + r * BYTES + j, S + r * (BYTES // 16) + j // 16, j < BYTES, tl.float32
    )
    both = tl.reshape(tl.join(even, odd), [2 * BYTES])
    tl.store(Out + r * 2 * BYTES + tl.arange(0, 2 * BYTES), both)


@interpreted
def test_kernel_decoding_is_exact():
    """Every byte under every scale byte 0..240 (the kernels' range): the kernels' decoded values equal
    `dequantize`'s bit for bit."""
    scales = torch.arange(241, dtype=torch.uint8)[:, None].expand(241, 16).contiguous()
    blocks = torch.arange(256, dtype=torch.uint8).repeat(241, 1)
    out = torch.empty(241, 512)
    _decode_rows_kernel[(241,)](blocks, scales, out, BYTES=256)
    ref = mxfp4_gemm.dequantize(blocks.view(241, 16, 16), scales, torch.float32)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@interpreted
@pytest.mark.parametrize("path", ["portable", "auto"])
@pytest.mark.parametrize("counts", [[5, 0, 19], [3, 0, 70, 2]])
def test_grouped_linear_forward_and_input_grad(path, counts):
    """fp32: forward and grad_x within 1e-6 of the reference; the second routing puts 70 rows (5 tiles of 16)
    on one expert, shared by two programs."""
    e, n, k = len(counts), 40, 96
    blocks, scales = weights(e, n, k, seed=len(counts))
    x, bounds = rows(counts, k, seed=len(counts))
    assert mxfp4_gemm.kernel_for(x, path) == "portable"
    ours_x = x.clone().requires_grad_()
    y = grouped_linear_mxfp4(ours_x, blocks, scales, bounds, path=path, config=TILES)
    ref_x = x.clone().requires_grad_()
    y_ref = reference_dequantized(ref_x, blocks, scales, bounds)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    y.backward(grad)
    y_ref.backward(grad)
    assert rel_err(y.detach(), y_ref.detach()) <= 1e-6
    assert rel_err(ours_x.grad, ref_x.grad) <= 1e-6
    # a partial column block and the interpreter's default tiles
    y_default = grouped_linear_mxfp4(x, blocks, scales, bounds, path=path)
    assert rel_err(y_default, y_ref.detach()) <= 1e-6


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_group_decoding(gated):
    """The portable kernel with decode="groups" (block vectors, one scale load per block), also in K pieces
    of 32 (`sub_k`), and "ptx" (which the interpreter runs as "groups"): fp32 within 1e-6 of the reference,
    partial column and K blocks."""
    counts, n, k = [5, 0, 19], 48, 96
    blocks, scales = weights(len(counts), n, k, seed=13)
    x, bounds = rows(counts, k, seed=13)
    for decode, sub_k in (("groups", 0), ("groups", 32), ("ptx", 0)):
        tiles = dataclasses.replace(TILES, decode=decode, sub_k=sub_k)
        if gated:
            ref = reference_dequantized(x, blocks, scales, bounds, None, (LIMIT, ALPHA))
            ours = fc1_swiglu_mxfp4(x, blocks, scales, None, bounds, LIMIT, ALPHA, "portable", tiles)
        else:
            ref = reference_dequantized(x, blocks, scales, bounds)
            ours = grouped_linear_mxfp4(x, blocks, scales, bounds, "portable", tiles)
        assert rel_err(ours, ref) <= 1e-6, decode
    with pytest.raises(ValueError, match="decode must be one of"):
        grouped_linear_mxfp4(x, blocks, scales, bounds, "portable", dataclasses.replace(TILES, decode="lut"))
    with pytest.raises(ValueError, match="sub_k must be a multiple of 32 dividing block_k 64"):
        tiles = dataclasses.replace(TILES, decode="groups", sub_k=48)
        grouped_linear_mxfp4(x, blocks, scales, bounds, "portable", tiles)


@interpreted
def test_sliced_weights():
    """Weights that are slices over experts and rows (strided, each row's bytes contiguous): read in place,
    the same products as their contiguous copies."""
    blocks, scales = weights(4, 64, 64, seed=12)
    part_b, part_s = blocks[1:3, 32:], scales[1:3, 32:]
    assert not part_b.is_contiguous()
    x, bounds = rows([5, 9], 64, seed=12)
    ours = grouped_linear_mxfp4(x, part_b, part_s, bounds, path="portable")
    ref = reference_dequantized(x, part_b.contiguous(), part_s.contiguous(), bounds)
    assert rel_err(ours, ref) <= 1e-6


@interpreted
@pytest.mark.parametrize("bias", [True, False])
def test_fc1_swiglu_forward(bias):
    """fp32: within 1e-6 of the reference, both clamps of the SwiGLU taken; equal to the learner's
    composition within fp32 rounding."""
    counts, inter, k = [6, 0, 11], 24, 64
    blocks, scales = weights(len(counts), 2 * inter, k, seed=3)
    x, bounds = rows(counts, k, seed=3)
    x = x * 4  # products beyond the limit of 7
    b = torch.randn(len(counts), 2 * inter, generator=torch.Generator().manual_seed(4)) if bias else None
    ref = reference_dequantized(x, blocks, scales, bounds, b, (LIMIT, ALPHA))
    pre = reference_dequantized(x, blocks, scales, bounds)
    assert (pre[:, :inter] > LIMIT).any() and (pre[:, inter:].abs() > LIMIT).any()
    for path in ("portable", "auto"):
        h = fc1_swiglu_mxfp4(x, blocks, scales, b, bounds, LIMIT, ALPHA, path=path, config=TILES)
        assert rel_err(h, ref) <= 1e-6, path
    learner = fused_moe.swiglu_bias(grouped_linear_mxfp4(x, blocks, scales, bounds), b, bounds, LIMIT, ALPHA)
    assert rel_err(h, learner) <= 1e-6


@interpreted
@pytest.mark.parametrize("with_addend", [False, True])
def test_fc2_bias_is_the_product_then_the_expert_bias(with_addend):
    """`fc2_bias_mxfp4` (the engine's fc2: the bias in the kernel's epilogue) gives exactly what
    `grouped_linear_mxfp4` then `fused_moe.expert_bias` give, on the portable kernel (16- and 32-row tiles,
    the latter with half-height tails) and the reference path, with and without an addend; within 1e-6 of
    the reference; no bias: the product alone; forward only."""
    counts, n, k = [6, 0, 19], 40, 96
    blocks, scales = weights(len(counts), n, k, seed=16)
    x, bounds = rows(counts, k, seed=16)
    g = torch.Generator().manual_seed(17)
    b = torch.randn(len(counts), n, generator=g)
    addend = torch.randn(x.shape[0], n, generator=g) if with_addend else None
    ref = reference_dequantized(x, blocks, scales, bounds, b, None, addend)
    tall = dataclasses.replace(TILES, block_m=32, half_tail=True)
    for path, cfg in [("portable", TILES), ("portable", tall), ("reference", None)]:
        composed = fused_moe.expert_bias(
            grouped_linear_mxfp4(x, blocks, scales, bounds, path, cfg, addend), b, bounds
        )
        ours = mxfp4_gemm.fc2_bias_mxfp4(x, blocks, scales, b, bounds, path, cfg, addend)
        assert torch.equal(ours, composed), (path, cfg)
        assert rel_err(ours, ref) <= 1e-6, path
        plain = mxfp4_gemm.fc2_bias_mxfp4(x, blocks, scales, None, bounds, path, cfg, addend)
        assert torch.equal(plain, grouped_linear_mxfp4(x, blocks, scales, bounds, path, cfg, addend))
    with pytest.raises(RuntimeError, match="fc2_bias_mxfp4 is forward only"):
        mxfp4_gemm.fc2_bias_mxfp4(x, blocks, scales, b.requires_grad_(), bounds)


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_addend(gated):
    """fp32 with an addend [M, out] (an adapter's update; fc1's in [gate; up] columns), the portable kernel
    and the reference path: fc1 + SwiGLU and the plain product within 1e-6 of the reference, which adds it
    to the rounded products before bias and SwiGLU, and of the learner's composition; without it the
    results move."""
    counts, n, k = [6, 0, 11], 48, 64
    blocks, scales = weights(len(counts), n, k, seed=14)
    x, bounds = rows(counts, k, seed=14)
    x = x * 4  # fc1: products beyond the limit of 7
    g = torch.Generator().manual_seed(15)
    addend = 4 * torch.randn(x.shape[0], n, generator=g)
    b = torch.randn(len(counts), n, generator=g) if gated else None
    swiglu = (LIMIT, ALPHA) if gated else None
    ref = reference_dequantized(x, blocks, scales, bounds, b, swiglu, addend)
    assert rel_err(reference_dequantized(x, blocks, scales, bounds, b, swiglu), ref) > 1e-2
    learner = grouped_linear_mxfp4(x, blocks, scales, bounds) + addend
    if gated:
        learner = fused_moe.swiglu_bias(learner, b, bounds, LIMIT, ALPHA)
        assert rel_err(learner, ref) <= 1e-6
    for path in ("portable", "reference"):
        if gated:
            ours = fc1_swiglu_mxfp4(x, blocks, scales, b, bounds, LIMIT, ALPHA, path, TILES, addend=addend)
        else:
            ours = grouped_linear_mxfp4(x, blocks, scales, bounds, path, TILES, addend=addend)
        assert rel_err(ours, ref) <= 1e-6, path


@interpreted
def test_addend_gradients():
    """`grouped_linear_mxfp4` with an addend is differentiable in both: x's gradient within 1e-6 of autograd
    through the reference (grad_y W[e], as without an addend), the addend's grad_y itself."""
    counts, n, k = [6, 0, 11], 48, 64
    blocks, scales = weights(len(counts), n, k, seed=16)
    x, bounds = rows(counts, k, seed=16)
    g = torch.Generator().manual_seed(17)
    addend = torch.randn(x.shape[0], n, generator=g).requires_grad_()
    grad = torch.randn(x.shape[0], n, generator=g)
    ours_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    grouped_linear_mxfp4(ours_x, blocks, scales, bounds, "portable", TILES, addend=addend).backward(grad)
    reference_dequantized(ref_x, blocks, scales, bounds).backward(grad)
    assert torch.equal(addend.grad, grad)
    assert rel_err(ours_x.grad, ref_x.grad) <= 1e-6


@interpreted
@pytest.mark.parametrize("with_addend", [False, True])
@pytest.mark.parametrize("gated,swap", [(False, False), (True, False), (True, True)])
def test_scaled_kernel_on_bf16_rows(gated, swap, with_addend):
    """The `tl.dot_scaled` kernel (the auto path's on bf16 rows), the weight on either side, its products
    (and their sums with a bf16 addend) rounded to fp32 instead of bf16: within 1e-6 of the float64 product
    of the bf16 rows and the decoded weights (plus the addend)."""
    counts, n, k = [7, 0, 21], 48, 96
    blocks, scales = weights(len(counts), n, k, seed=6)
    x, bounds = rows(counts, k, seed=6)
    x16 = x.bfloat16()
    assert mxfp4_gemm.kernel_for(x16, "auto") == "reference"  # bf16 on the CPU: the API's reference
    w = mxfp4_gemm.dequantize(blocks, scales, torch.float64)
    g = torch.Generator().manual_seed(8)
    b = torch.randn(len(counts), n, generator=g) if gated else None
    addend = torch.randn(x.shape[0], n, generator=g).bfloat16() if with_addend else None
    expert = fused_moe.expert_of_rows(bounds, x.shape[0])
    exact = torch.einsum("mk,mnk->mn", x16.double(), w[expert])
    if with_addend:
        exact = exact + addend.double()
    if gated:
        exact = mxfp4_gemm.reference_dequantized(
            x16.double(), blocks, scales, bounds, b.double(), (LIMIT, ALPHA),
            None if addend is None else addend.double(),
        )  # fmt: skip
    tiles = dataclasses.replace(TILES, swap=swap)
    ours = mxfp4_gemm._forward(
        x16, blocks, scales, b, addend, bounds, gated, LIMIT, ALPHA, "scaled", tiles, out_dtype=torch.float32
    )  # fmt: skip
    assert rel_err(ours, exact) <= 1e-6


@interpreted
def test_paths_and_fallback(monkeypatch):
    """path="reference" (and the environment variable) run the reference; fp64 rows and a CPU without the
    interpreter fall back to it; an empty batch gives empty outputs and a zero-size gradient."""
    blocks, scales = weights(2, 32, 64, seed=9)
    x, bounds = rows([4, 3], 64, seed=9)
    assert mxfp4_gemm.kernel_for(x, "reference") == "reference"
    assert mxfp4_gemm.kernel_for(x.double(), "auto") == "reference"
    monkeypatch.setenv(mxfp4_gemm.PATH_ENV, "reference")
    assert mxfp4_gemm.kernel_for(x) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert mxfp4_gemm.kernel_for(x, "portable") == "reference"
    assert torch.equal(
        grouped_linear_mxfp4(x, blocks, scales, bounds), reference_dequantized(x, blocks, scales, bounds)
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    empty = torch.zeros(0, 64, requires_grad=True)
    none = torch.zeros(3, dtype=torch.int32)
    y = grouped_linear_mxfp4(empty, blocks, scales, none, path="portable")
    y.sum().backward()
    assert y.shape == (0, 32) and empty.grad.shape == (0, 64)
    assert fc1_swiglu_mxfp4(empty.detach(), blocks, scales, None, none, LIMIT, ALPHA).shape == (0, 16)


def test_errors_name_the_tensor():
    blocks, scales = weights(2, 32, 64, seed=10)
    x, bounds = rows([4, 3], 64, seed=10)
    cases = [
        ((x, blocks.int(), scales, bounds), TypeError, "uint8"),
        ((x, blocks[..., :8], scales, bounds), ValueError, "blocks must be"),
        ((x, blocks, scales[:, :, :1], bounds), ValueError, "scales must be"),
        ((x[:, :32], blocks, scales, bounds), ValueError, "x must be \\[M, in\\] with in = 64"),
        ((x.int(), blocks, scales, bounds), TypeError, "x must be a floating-point"),
        ((x, blocks, scales, bounds.long()), ValueError, "bounds must be int32"),
        ((x, blocks, scales, bounds[:2]), ValueError, "bounds must be int32 \\[E \\+ 1\\] = \\[3\\]"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            grouped_linear_mxfp4(*args)
    with pytest.raises(ValueError, match="bias must be \\[E, out\\] = \\[2, 32\\]"):
        fc1_swiglu_mxfp4(x, blocks, scales, torch.zeros(2, 16), bounds, LIMIT, ALPHA)
    with pytest.raises(ValueError, match="addend must be \\[M, out\\] = \\[7, 32\\]"):
        fc1_swiglu_mxfp4(x, blocks, scales, None, bounds, LIMIT, ALPHA, addend=torch.zeros(7, 16))
    with pytest.raises(ValueError, match="addend must be torch.float32"):
        grouped_linear_mxfp4(x, blocks, scales, bounds, addend=torch.zeros(7, 32).bfloat16())
    odd_blocks, odd_scales = weights(2, 33, 64, seed=11)
    with pytest.raises(ValueError, match="output width must be even"):
        fc1_swiglu_mxfp4(x, odd_blocks, odd_scales, None, bounds, LIMIT, ALPHA)
    with pytest.raises(ValueError, match="path must be one of"):
        grouped_linear_mxfp4(x, blocks, scales, bounds, path="fast")
    with pytest.raises(RuntimeError, match="forward only"):
        fc1_swiglu_mxfp4(
            x, blocks, scales, None, bounds, LIMIT, ALPHA, addend=torch.zeros(7, 32).requires_grad_()
        )
    with pytest.raises(RuntimeError, match="forward only"):
        fc1_swiglu_mxfp4(x.requires_grad_(), blocks, scales, None, bounds, LIMIT, ALPHA)


def test_tiles_fit_the_shared_memory():
    """At 99 KB a block (Ada, consumer Ampere) the 128-row fc1 tiles drop to 2 stages and a 64 K step; at
    227 KB (H100) they stay as chosen."""
    cfg = Mxfp4Config(block_m=128, block_n=64, block_k=128, warps=8, stages=3)
    small = mxfp4_gemm.fit_shared_memory(cfg, 99 * 1024, gated=True)
    assert (small.stages, small.block_k) == (2, 64)
    assert mxfp4_gemm.fit_shared_memory(cfg, 227 * 1024, gated=True) == cfg


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_relaid_weights_give_the_row_major_products(gated):
    """Weights re-laid for the forward kernel (`kernel_weights`): tile by tile (partial column and K tiles
    zero-padded, fc1's halves tiled apart), each block's bytes shuffled or re-encoded as bf16 pairs, or
    both. The kernel reading
    them gives exactly what it gives over the checkpoint's layout, bias and addend included, with each
    decoding and over several row tiles of an expert; within 1e-6 of the reference; and clear errors for
    tiles that do not match the kernel's, rows of another width, a decoding that cannot read the format or
    scales beyond the pairs' range."""
    counts, n, k = [5, 0, 37], 40, 96
    blocks, scales = weights(len(counts), 2 * n if gated else n, k, seed=21)  # scales 120..130
    scales = scales.clamp(max=128)  # within the pairs' range
    x, bounds = rows(counts, k, seed=21)
    g = torch.Generator().manual_seed(22)
    bias = torch.randn(len(counts), blocks.shape[1], generator=g)
    addend = torch.randn(x.shape[0], blocks.shape[1], generator=g)
    swiglu = (LIMIT, ALPHA) if gated else None
    ref = reference_dequantized(x, blocks, scales, bounds, bias, swiglu, addend)
    tiled = mxfp4_relaid.kernel_weights(blocks, scales, gated, TILES.block_n, TILES.block_k)
    assert tiled.blocks.shape == (len(counts), 2 if gated else 1, 3, 2, 16, 32)
    assert tiled.blocks.is_contiguous() and tiled.blocks.stride(4) == TILES.block_k // 2
    decodes = [("bytes", 0), ("groups", 0), ("groups", 32), ("ptx", 0)]
    formats = [
        (True, "checkpoint"),
        (False, "shuffled"),
        (True, "shuffled"),
        (False, "pairs"),
        (True, "pairs"),
    ]
    for is_tiled, byte_format in formats:
        relaid = mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 64, is_tiled, byte_format)
        for decode, sub_k in decodes[1:] if byte_format != "checkpoint" else decodes:
            tiles = dataclasses.replace(TILES, decode=decode, sub_k=sub_k)
            ours = mxfp4_relaid.forward_kernel_weights(x, relaid, bias, bounds, LIMIT, ALPHA, tiles, addend)
            row_major = mxfp4_gemm._forward(
                x, blocks, scales, bias, addend, bounds, gated, LIMIT, ALPHA, "portable", tiles
            )
            assert ours.abs().sum() > 0 and torch.equal(ours, row_major), (
                is_tiled,
                byte_format,
                decode,
                sub_k,
            )
            assert rel_err(ours, ref) <= 1e-6, decode
    pairs = mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 64, False, "pairs")
    with pytest.raises(ValueError, match="byte format 'pairs' needs the 'groups' or 'ptx' decoding"):
        mxfp4_relaid.forward_kernel_weights(x, pairs, bias, bounds, config=TILES)
    with pytest.raises(ValueError, match="scale bytes 2..128 exactly; these scales span 121..129"):
        mxfp4_relaid.kernel_weights(blocks, scales + 1, gated, 16, 64, False, "pairs")
    with pytest.raises(ValueError, match="byte_format must be one of"):
        mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 64, False, "nibbles")
    with pytest.raises(ValueError, match="the kernel's tiles 16 x 32 must be the weights' 16 x 64"):
        mxfp4_relaid.forward_kernel_weights(
            x, tiled, bias, bounds, config=dataclasses.replace(TILES, block_k=32)
        )
    with pytest.raises(ValueError, match=r"x must be \[M, 96\]"):
        mxfp4_relaid.forward_kernel_weights(x[:, :64], tiled, bias, bounds)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 48)


@pytest.mark.parametrize("gated", [True, False])
def test_kernel_weights_keep_every_byte(gated):
    """The tiled bytes and scales hold every byte and scale of the weights where the kernel's tile
    addressing looks for them, and zeros in the padding; shuffled bytes are each block's [4, 4] transpose,
    which shuffling again undoes."""
    g = torch.Generator().manual_seed(0)
    experts, rows_, width = 2, 2 * 24 if gated else 24, 96  # 24 rows: not a whole number of 16-row tiles
    blocks = torch.randint(0, 256, (experts, rows_, width // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 130, (experts, rows_, width // 32), generator=g, dtype=torch.uint8)
    tiles = mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 64)
    tiled, tiled_scales, nb, kt = tiles.blocks, tiles.scales, *tiles.blocks.shape[2:4]
    halves, n = (2, rows_ // 2) if gated else (1, rows_)
    assert (nb, kt) == (2, 2) and tiled.shape == (experts, halves, nb, kt, 16, 32)
    # byte j of row r of half h sits in tile (r // 16, j // 32) at (r % 16, j % 32); the padding is zero
    untiled = tiled.permute(0, 1, 2, 4, 3, 5).reshape(experts, halves, nb * 16, kt * 32)
    assert torch.equal(
        untiled[:, :, :n, : width // 2].reshape(experts, rows_, -1), blocks.reshape(experts, rows_, -1)
    )
    assert untiled[:, :, n:].eq(0).all() and untiled[..., width // 2 :].eq(0).all()
    scales_back = tiled_scales.permute(0, 1, 2, 4, 3, 5).reshape(experts, halves, nb * 16, kt * 2)
    assert torch.equal(scales_back[:, :, :n, : width // 32].reshape(experts, rows_, -1), scales)
    shuffled = mxfp4_relaid.kernel_weights(blocks, scales, gated, 16, 64, tiled=False, byte_format="shuffled")
    assert torch.equal(shuffled.blocks[..., 1], blocks[..., 4]) and torch.equal(
        shuffled.blocks[..., 4], blocks[..., 1]
    )
    assert torch.equal(mxfp4_bytes.shuffle_bytes(shuffled.blocks), blocks)
    assert torch.equal(shuffled.scales, scales)


def test_every_relaid_byte_format_has_held_tiles():
    """Re-laid weights of each kernel byte format take the tiles of a held format (`mxfp4_relaid.held_like`:
    `default_config` refuses the shuffled bytes, which no model holds): the pairs' for the pairs (K steps
    of 64 on a GPU), the checkpoint's for the rest."""
    for byte_format in mxfp4_gemm.BYTE_FORMATS:
        held = mxfp4_relaid.held_like(byte_format)
        mxfp4_bytes.check_held_format(held)
        assert (held == "pairs") == (byte_format == "pairs"), byte_format
    with pytest.raises(ValueError, match="shuffled"):
        mxfp4_bytes.check_held_format("shuffled")


def test_released_bytes_as_each_held_format_holds_them():
    """`mxfp4_bytes.held_blocks` / `held_scales`: the released bytes re-encoded per held format (checkpoint:
    as they are; pairs: `pair_words`; tiled_pairs: those tile by tile, the scales too), and read back by
    `dequantize` to the released values; an unknown format is refused by name."""
    blocks, scales = weights(2, 64, 128, seed=49)
    scales = scales.clamp(max=128)
    expected = {
        "checkpoint": (blocks, scales),
        "pairs": (mxfp4_bytes.pair_words(blocks), scales),
        "tiled_pairs": (
            mxfp4_bytes.tile_experts(mxfp4_bytes.pair_words(blocks)),
            mxfp4_bytes.tile_experts(scales),
        ),
    }
    values = mxfp4_gemm.dequantize(blocks, scales, torch.float32)
    for held, (b, s) in expected.items():
        ours = mxfp4_bytes.held_blocks(blocks, held), mxfp4_bytes.held_scales(scales, held)
        assert torch.equal(ours[0], b) and torch.equal(ours[1], s), held
        assert torch.equal(mxfp4_gemm.dequantize(*ours, torch.float32, held), values), held
    for held_fn, t in ((mxfp4_bytes.held_blocks, blocks), (mxfp4_bytes.held_scales, scales)):
        with pytest.raises(ValueError, match="shuffled"):
            held_fn(t, "shuffled")


def test_pair_words_decode_to_the_weights():
    """Byte format "pairs" (`pair_words`) read back by the kernels' rule (word a of a block: pair i from slot
    i's bits, as a bf16 of 2 ** -126 times the FP4 value) gives every code of every byte at K 2 (a + 4 i) + t,
    signed zeros included."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte, in every position
    blocks = torch.cat([blocks, blocks.roll(7, dims=1)]).reshape(2, 16, 1, 16)
    words = mxfp4_bytes.pair_words(blocks).reshape(-1, 4, 4).to(torch.int64)
    word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [blocks, a]
    values = torch.empty(word.shape[0], 32)
    for i in range(4):
        if i < 3:
            bits = (word << (3 * i)) & 0x81C081C0
        else:
            bits = ((word << 1) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040)
        for t in range(2):
            half = ((bits >> (16 * t)) & 0xFFFF).to(torch.int32) << 16
            decoded = half.view(torch.float32) * 2.0**126  # [blocks, a]
            for a in range(4):
                values[:, 2 * (a + 4 * i) + t] = decoded[:, a]
    ref = mxfp4_gemm.dequantize(blocks, torch.full(blocks.shape[:3], 127, dtype=torch.uint8), torch.float32)
    ref = ref.reshape(-1, 32)
    assert torch.equal(values, ref) and torch.equal(values.signbit(), ref.signbit())
    with pytest.raises(ValueError, match="blocks must end in 16 bytes a block"):
        mxfp4_bytes.pair_words(blocks[..., :8])


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_pairs_byte_format_through_every_path(gated):
    """Weights held in byte format "pairs" (`pair_words`): the forward (portable kernel, each decoding), the
    input gradient (the backward kernel decodes the pairs in K's order and multiplies once) and the reference
    path give exactly what the checkpoint's bytes give, addend included; the whole-weight decoding
    (`dequantize_kernel`, the dequantized path's) gives the same values; `unpair_words` gives the bytes
    back."""
    counts, out, k = [7, 0, 21], 48, 96
    blocks, scales = weights(len(counts), 2 * out if gated else out, k, seed=31)
    scales = scales.clamp(max=128)
    pairs = mxfp4_bytes.pair_words(blocks)
    assert not torch.equal(pairs, blocks) and torch.equal(mxfp4_bytes.unpair_words(pairs), blocks)
    x, bounds = rows(counts, k, seed=31)
    addend = torch.randn(x.shape[0], blocks.shape[1], generator=torch.Generator().manual_seed(32))
    for decode in ("groups", "ptx"):
        tiles = dataclasses.replace(TILES, decode=decode)
        if gated:
            call = functools.partial(fc1_swiglu_mxfp4, x, bias=None, bounds=bounds, limit=LIMIT, alpha=ALPHA,
                                     path="portable", config=tiles, addend=addend)  # fmt: skip
            ours, ref = call(pairs, scales, byte_format="pairs"), call(blocks, scales)
        else:
            xs = [x.clone().requires_grad_(True) for _ in range(2)]
            ours = grouped_linear_mxfp4(xs[0], pairs, scales, bounds, "portable", tiles, addend, "pairs")
            ref = grouped_linear_mxfp4(xs[1], blocks, scales, bounds, "portable", tiles, addend)
            g = torch.randn_like(ref)
            ours.backward(g)
            ref.backward(g)
            assert xs[1].grad.abs().sum() > 0 and torch.equal(xs[0].grad, xs[1].grad), decode
        assert ref.abs().sum() > 0 and torch.equal(ours, ref), decode
    if not gated:  # the default tiles (no config): a decoding that reads the pairs
        ours = grouped_linear_mxfp4(x, pairs, scales, bounds, "portable", None, addend, "pairs")
        assert torch.equal(ours, grouped_linear_mxfp4(x, blocks, scales, bounds, "portable", None, addend))
    swiglu = (LIMIT, ALPHA) if gated else None
    ours = reference_dequantized(x, pairs, scales, bounds, None, swiglu, addend, "pairs")
    assert torch.equal(ours, reference_dequantized(x, blocks, scales, bounds, None, swiglu, addend))
    decoded = mxfp4_gemm.dequantize_kernel(pairs, scales, torch.float32, "pairs")
    assert torch.equal(decoded, mxfp4_gemm.dequantize(blocks, scales, torch.float32))
    with pytest.raises(ValueError, match="held in one of .*, got 'shuffled'"):
        grouped_linear_mxfp4(x, pairs, scales, bounds, "portable", TILES, None, "shuffled")


def test_tiles_put_each_k_step_of_a_row_block_in_one_run():
    """`tile_experts`: expert e's tile (row block b, K step t) holds rows 64 b .. of K columns 64 t .. as one
    contiguous run in order, `untile_experts` gives the row-major bytes back, scales alike; widths that do
    not fill whole tiles are refused, naming the width."""
    blocks, scales = weights(2, 128, 192, seed=41)  # 2 row blocks x 3 K steps a expert
    tiled, tiled_scales = mxfp4_bytes.tile_experts(blocks), mxfp4_bytes.tile_experts(scales)
    assert tiled.shape == blocks.shape and tiled_scales.shape == scales.shape
    flat, flat_scales = tiled.reshape(2, -1), tiled_scales.reshape(2, -1)
    run, run_scales = 64 * 32, 64 * 2  # a tile's bytes and scale bytes
    for e, b, t in [(0, 0, 0), (0, 1, 2), (1, 0, 1), (1, 1, 0)]:
        start = (b * 3 + t) * run
        expect = blocks[e, 64 * b : 64 * (b + 1), 2 * t : 2 * t + 2].reshape(-1)
        assert torch.equal(flat[e, start : start + run], expect), (e, b, t)
        start = (b * 3 + t) * run_scales
        expect = scales[e, 64 * b : 64 * (b + 1), 2 * t : 2 * t + 2].reshape(-1)
        assert torch.equal(flat_scales[e, start : start + run_scales], expect), (e, b, t)
    assert torch.equal(mxfp4_bytes.untile_experts(tiled), blocks)
    assert torch.equal(mxfp4_bytes.untile_experts(tiled_scales), scales)
    assert MXFP4_BYTE_FORMATS == mxfp4_bytes.HELD_FORMATS  # the config's names are the held formats
    assert MXFP4_TILE == mxfp4_bytes.TILE_ROWS == mxfp4_bytes.TILE_K
    with pytest.raises(ValueError, match="out_features=96, not a multiple of 64"):
        mxfp4_bytes.tile_experts(blocks[:, :96])
    with pytest.raises(ValueError, match="in_features=160, not a multiple of 64"):
        mxfp4_bytes.tile_experts(scales[:, :, :5])


def tiled_case(counts: list[int], out: int, k: int, seed: int):
    """(blocks, scales) of the checkpoint's bytes (scales up to 128), the same held "tiled_pairs", and
    rows x sorted by expert with their bounds."""
    blocks, scales = weights(len(counts), out, k, seed=seed)
    scales = scales.clamp(max=128)
    held = mxfp4_bytes.held_blocks(blocks, "tiled_pairs")
    x, bounds = rows(counts, k, seed=seed)
    return blocks, scales, held, mxfp4_bytes.held_scales(scales, "tiled_pairs"), x, bounds


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_tiled_pairs_through_every_path(gated):
    """Weights held "tiled_pairs" (the pairs' bytes and the scales tile by tile): the forward (the portable
    kernel at the held 64 x 64 tiles, over 2 K steps and experts over several row tiles), the input gradient
    (the backward kernel addressing the tiles), the reference path and the whole-weight decoding give exactly
    what the checkpoint's bytes give, addend included; tiles other than the held ones are refused."""
    counts = [7, 0, 21]
    blocks, scales, held, held_scales, x, bounds = tiled_case(counts, 2 * 64 if gated else 64, 128, seed=43)
    addend = torch.randn(x.shape[0], blocks.shape[1], generator=torch.Generator().manual_seed(44))
    fmt = "tiled_pairs"
    assert mxfp4_gemm.default_config(28, 3, x.device, gated, fmt).block_n == 64
    if gated:
        call = functools.partial(fc1_swiglu_mxfp4, x, bias=None, bounds=bounds, limit=LIMIT, alpha=ALPHA,
                                 path="portable", addend=addend)  # fmt: skip
        ours, ref = call(held, held_scales, byte_format=fmt), call(blocks, scales, config=TILES)
    else:
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        ours = grouped_linear_mxfp4(xs[0], held, held_scales, bounds, "portable", None, addend, fmt)
        ref = grouped_linear_mxfp4(xs[1], blocks, scales, bounds, "portable", TILES, addend)
        g = torch.randn_like(ref)
        ours.backward(g)
        ref.backward(g)
        assert xs[1].grad.abs().sum() > 0 and torch.equal(xs[0].grad, xs[1].grad)
    assert ref.abs().sum() > 0 and torch.equal(ours, ref)
    swiglu = (LIMIT, ALPHA) if gated else None
    ours = reference_dequantized(x, held, held_scales, bounds, None, swiglu, addend, fmt)
    assert torch.equal(ours, reference_dequantized(x, blocks, scales, bounds, None, swiglu, addend))
    decoded = mxfp4_gemm.dequantize_kernel(held, held_scales, torch.float32, fmt)
    assert torch.equal(decoded, mxfp4_gemm.dequantize(blocks, scales, torch.float32))
    with pytest.raises(ValueError, match="block_n must be a multiple of 64 and its block_k 64, got 16 x 64"):
        grouped_linear_mxfp4(x, held, held_scales, bounds, "portable", TILES, None, fmt)


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_tiled_pairs_in_blocks_of_two_tiles(gated):
    """The forward over weights held "tiled_pairs" with 128 columns a program: each block's rows from two
    stored 64-row tiles (`_tiled_layout`'s row blocks; `SUB_ROWS`), at 192 columns a half, so the second
    block's second tile lies past the weight and is masked; exactly the products of one tile a program and
    of the checkpoint's bytes."""
    counts = [7, 0, 21]
    blocks, scales, held, held_scales, x, bounds = tiled_case(counts, 2 * 192 if gated else 192, 128, seed=45)
    fmt = "tiled_pairs"
    one = mxfp4_gemm.default_config(x.shape[0], len(counts), x.device, gated, fmt)
    two = dataclasses.replace(one, block_n=2 * MXFP4_TILE)
    if gated:
        call = functools.partial(fc1_swiglu_mxfp4, x, bias=None, bounds=bounds, limit=LIMIT, alpha=ALPHA,
                                 path="portable")  # fmt: skip
    else:
        call = functools.partial(grouped_linear_mxfp4, x, bounds=bounds, path="portable")
    ours = call(held, held_scales, config=two, byte_format=fmt)
    assert ours.abs().sum() > 0 and torch.equal(ours, call(held, held_scales, config=one, byte_format=fmt))
    assert torch.equal(ours, call(blocks, scales, config=TILES))


@interpreted
@pytest.mark.parametrize("block_k", [32, 64])
def test_scales_loaded_a_step_ahead_give_the_same_products(monkeypatch, block_k):
    """The forward kernel with each K step's scale bytes loaded a step ahead (`prefetch_scales`, on where
    the installed Triton keeps the loop's layout with it) gives exactly the products of the load in its
    step, for the checkpoint's bytes and the pairs, each block-vector decoding, over 3 and 2 K steps (the
    last partial); within 1e-6 of the reference. The release rule: Triton 3.6 only."""
    counts, n, k = [6, 0, 19], 40, 96
    blocks, scales = weights(len(counts), 2 * n, k, seed=41)
    scales = scales.clamp(max=128)
    x, bounds = rows(counts, k, seed=41)
    bias = torch.randn(len(counts), 2 * n, generator=torch.Generator().manual_seed(42))
    ref = reference_dequantized(x, blocks, scales, bounds, bias, (LIMIT, ALPHA), None)
    held = {"checkpoint": blocks, "pairs": mxfp4_bytes.pair_words(blocks)}
    for byte_format, decode in [("checkpoint", "groups"), ("checkpoint", "ptx"), ("pairs", "ptx")]:
        tiles = dataclasses.replace(TILES, block_k=block_k, decode=decode)
        out = {}
        for prefetch in (False, True):
            monkeypatch.setattr(mxfp4_gemm, "prefetch_scales", lambda p=prefetch: p)
            out[prefetch] = fc1_swiglu_mxfp4(x, held[byte_format], scales, bias, bounds, LIMIT, ALPHA,
                                             "portable", tiles, byte_format=byte_format)  # fmt: skip
        assert out[True].abs().sum() > 0 and torch.equal(out[True], out[False]), (byte_format, decode)
        assert rel_err(out[True], ref) <= 1e-6, (byte_format, decode)
    monkeypatch.undo()
    for release, expected in [("3.6.0", True), ("3.6.1", True), ("3.5.1", False), ("3.9.0", False)]:
        monkeypatch.setattr(mxfp4_gemm.importlib.metadata, "version", lambda name, r=release: r)
        mxfp4_gemm.prefetch_scales.cache_clear()
        assert mxfp4_gemm.prefetch_scales() is expected, release
    monkeypatch.undo()
    mxfp4_gemm.prefetch_scales.cache_clear()


def spy_forward_launches(monkeypatch, record) -> None:
    """`mxfp4_gemm`'s forward kernel launched as before, record(kwargs) called with each launch's keywords
    first."""
    kernels = mxfp4_gemm._kernels()

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                record(kwargs)
                return kernels.mxfp4_fwd_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(mxfp4_gemm, "_kernels", lambda: type("K", (), {"mxfp4_fwd_kernel": Spy()}))


@interpreted
def test_a_register_cap_reaches_the_launch(monkeypatch):
    """`Mxfp4Config.maxnreg` goes to the forward's launch as Triton's `maxnreg` (none at 0) with the same
    products; a negative cap is refused by name; `Mxfp4Config.pdl` launches nothing differently on the CPU.
    Eight warps only for the checkpoint bytes' gated 128-row tiles (the pairs' fc1 at 2,048 rows took twice as
    long with eight on an H200)."""
    counts, n, k = [6, 0, 19], 40, 96
    blocks, scales = weights(len(counts), 2 * n, k, seed=43)
    x, bounds = rows(counts, k, seed=43)
    launches, flags = [], []

    def record(kwargs):
        launches.append(kwargs.get("maxnreg"))
        flags.append((kwargs["PDL"], "launch_pdl" in kwargs))

    spy_forward_launches(monkeypatch, record)
    out = {
        cap: fc1_swiglu_mxfp4(
            x, blocks, scales, None, bounds, LIMIT, ALPHA, "portable", dataclasses.replace(TILES, maxnreg=cap)
        )  # fmt: skip
        for cap in (0, 96)
    }
    assert launches == [None, 96] and torch.equal(out[0], out[96]) and out[0].abs().sum() > 0
    launches.clear()
    pdl = fc1_swiglu_mxfp4(x, blocks, scales, None, bounds, LIMIT, ALPHA, "portable",
                           dataclasses.replace(TILES, pdl=True))  # fmt: skip
    assert flags[-1] == (False, False) and torch.equal(pdl, out[0])  # off on the CPU: no PDL launch or GDC
    with pytest.raises(ValueError, match="maxnreg"):
        fc1_swiglu_mxfp4(x, blocks, scales, None, bounds, LIMIT, ALPHA, "portable",
                         dataclasses.replace(TILES, maxnreg=-1))  # fmt: skip
    assert mxfp4_gemm.default_warps(128, True, "checkpoint") == 8
    assert (
        mxfp4_gemm.default_warps(128, True, "pairs") == mxfp4_gemm.default_warps(64, True, "checkpoint") == 4
    )


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_half_height_tail_tiles(monkeypatch, gated):
    """`Mxfp4Config.half_tail` at 32-row tiles: experts of 5 and 16 rows (at most half a tile: the 16-row
    loop), 17 and 70 rows (the full loop; 70 over three tiles) and none. The launch carries HALF_TAIL (a spy),
    the products equal those at full height and lie within 1e-6 of the reference; the scaled kernel and
    16-row tiles never take the half-height loop."""
    counts, n, k = [5, 16, 0, 17, 70], 40, 96
    blocks, scales = weights(len(counts), (2 if gated else 1) * n, k, seed=47)
    x, bounds = rows(counts, k, seed=47)
    bias = torch.randn(len(counts), (2 if gated else 1) * n, generator=torch.Generator().manual_seed(48))
    ref = reference_dequantized(x, blocks, scales, bounds, bias, (LIMIT, ALPHA) if gated else None, None)
    launches = []
    spy_forward_launches(monkeypatch, lambda kwargs: launches.append(kwargs["HALF_TAIL"]))
    out = {}
    for half in (True, False):
        tiles = dataclasses.replace(TILES, block_m=32, half_tail=half)
        if gated:
            out[half] = fc1_swiglu_mxfp4(x, blocks, scales, bias, bounds, LIMIT, ALPHA, "portable", tiles)
        else:
            y = grouped_linear_mxfp4(x, blocks, scales, bounds, "portable", tiles)
            out[half] = y + bias.repeat_interleave(torch.tensor(counts), dim=0)
    assert launches == [True, False]
    assert out[True].abs().sum() > 0 and torch.equal(out[True], out[False])
    assert rel_err(out[True], ref) <= 1e-6
    tall = dataclasses.replace(TILES, block_m=32, half_tail=True)
    assert mxfp4_gemm.half_tail(tall, "portable")
    assert not mxfp4_gemm.half_tail(tall, "scaled")
    assert not mxfp4_gemm.half_tail(dataclasses.replace(tall, block_m=16), "portable")
    assert not Mxfp4Config(32, 64, 64, 4, 3).half_tail  # off unless asked (`default_config`: fc1's on a GPU)
