"""MXFP4 grouped expert GEMMs (megatron_gptoss.ops.mxfp4_gemm) on a CUDA GPU, bf16 at gpt-oss-20b width (32
experts, hidden = intermediate = 2880, top-4 routing): both paths per row against float64 with the
dequantize-then-bf16 path's roundings and against that path itself, also with addends (an adapter's update);
the input gradient likewise; the portable kernel's block-vector decodings (its PTX decoding exhaustively); the
portable kernel with Triton's pre-Hopper matrix instructions (DISABLE_MMA_V3=1, in a child process).

    python -m pytest -q -m gpu tests/ops/test_mxfp4_gemm_gpu.py -s
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_gptoss.ops import fused_moe, mxfp4_bytes, mxfp4_gemm, mxfp4_relaid
from megatron_gptoss.ops.mxfp4_gemm import fc1_swiglu_mxfp4, grouped_linear_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LIMIT, ALPHA = 7.0, 1.702
EXPERTS, WIDTH, TOPK = 32, 2880, 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def full_precision_library_gemms():
    """The dequantized bf16 path's GEMMs (cuBLAS) accumulate in fp32 only, as `torch._grouped_mm` does."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction = saved


def inputs(tokens: int, seed: int = 7, experts: int = EXPERTS):
    """bf16 rows of `tokens` tokens routed to TOPK of EXPERTS experts at random (sorted by expert), MXFP4
    fc1 [E, 2 * WIDTH, WIDTH] and fc2 [E, WIDTH, WIDTH] with every code and scales 2^-6 .. 2^-4 (products of
    std 2.5 to 10: both clamps of the SwiGLU taken), fc1 bias N(0, 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    choice = torch.rand(tokens, experts, generator=g, device="cuda").topk(TOPK, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    x = torch.randn(tokens * TOPK, WIDTH, generator=g, device="cuda").bfloat16()

    def mxfp4(out: int):
        blocks = torch.randint(0, 256, (experts, out, WIDTH // 32, 16), generator=g, device="cuda")
        scales = torch.randint(121, 124, (experts, out, WIDTH // 32), generator=g, device="cuda")
        return blocks.to(torch.uint8), scales.to(torch.uint8)

    b1 = torch.randn(experts, 2 * WIDTH, generator=g, device="cuda").bfloat16()
    return x, mxfp4(2 * WIDTH), b1, mxfp4(WIDTH), bounds


def exact_products(x: torch.Tensor, blocks, scales, bounds) -> torch.Tensor:
    """float64 x W[e]^T of the bf16 rows and the exactly decoded weights (no rounding)."""
    return mxfp4_gemm.reference_dequantized(x.double(), blocks, scales, bounds)


def ideal_fc1(x, blocks, scales, bias, bounds, addend=None) -> torch.Tensor:
    """The dequantize-then-bf16 path's roundings on exact sums: products rounded to bf16 (the addend added
    and the sum rounded to bf16 again), bias and SwiGLU in float64 on them, rounded to bf16."""
    h = exact_products(x, blocks, scales, bounds).bfloat16().double()
    if addend is not None:
        h = (h + addend.double()).bfloat16().double()
    h = h + bias.double()[fused_moe.expert_of_rows(bounds, h.shape[0])]
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return ((up + 1) * gate * torch.sigmoid(gate * ALPHA)).bfloat16()


def row_mismatch(ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the fraction of values that differ from ref's, and ||ours - ref|| / ||ref||."""
    differ = (ours != ref).double().mean(dim=1)
    rel = (ours.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-30)
    return differ, rel


def assert_rounds_as(name: str, ours: torch.Tensor, ref: torch.Tensor, differ_max: float = 0.01):
    """At most `differ_max` of a row's values differ from ref and each row within 2e-3 (a bf16 GEMM's
    results differ from the correctly rounded ones only where the fp32 sum order crosses a rounding
    boundary)."""
    differ, rel = row_mismatch(ours, ref)
    print(f"{name}: values differing per row mean {differ.mean():.2e} max {differ.max():.2e}, row error "
          f"max {rel.max():.2e}")  # fmt: skip
    assert differ.max() <= differ_max, (name, differ.max().item())
    assert rel.max() <= 2e-3, (name, rel.max().item())


def check_paths(tokens: int, paths: tuple[str, ...]) -> None:
    """fc1 + SwiGLU and fc2 forwards and fc2's input gradient of each path against float64 with the bf16
    path's roundings and against the dequantize-then-bf16 path (`path="reference"`)."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    h_ideal = ideal_fc1(x, b1, s1, bias, bounds)
    pre = exact_products(x, b1, s1, bounds)
    assert (pre[:, :WIDTH] > LIMIT).any() and (pre[:, WIDTH:].abs() > LIMIT).any()
    h_lib = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="reference")
    g = torch.randn(
        x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)
    ).bfloat16()
    for path in paths:
        h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path=path)
        assert_rounds_as(f"{path} fc1 vs float64, {tokens} tokens", h, h_ideal)
        assert_rounds_as(f"{path} fc1 vs dequantized bf16", h, h_lib, differ_max=0.02)
        rows = h.detach().clone().requires_grad_()
        y = grouped_linear_mxfp4(rows, b2, s2, bounds, path=path)
        y_ideal = exact_products(h, b2, s2, bounds).bfloat16()
        assert_rounds_as(f"{path} fc2 vs float64", y, y_ideal)
        y_lib = grouped_linear_mxfp4(h, b2, s2, bounds, "reference")
        assert_rounds_as(f"{path} fc2 vs dequantized bf16", y, y_lib, differ_max=0.02)
        y.backward(g)
        w2 = mxfp4_gemm.dequantize(b2, s2, torch.float64)
        edges = bounds.tolist()
        grad_ideal = torch.cat(
            [g.double()[edges[e] : edges[e + 1]] @ w2[e] for e in range(EXPERTS)]
        ).bfloat16()
        assert_rounds_as(f"{path} grad_x vs float64", rows.grad, grad_ideal)


@pytest.mark.parametrize("tokens", [64, 256, 2048])
def test_both_paths_round_as_the_dequantized_bf16_path(tokens):
    """Decode sizes (64, 256 engine slots) and a prefill size: the auto path (the portable kernel with its
    ptx decoding at decode sizes, the dequantized path above them on Hopper), the portable, the scaled and
    the dequantized paths, and the scaled kernel did not fall back."""
    check_paths(tokens, ("auto", "portable", "scaled", "dequantized"))
    small = torch.zeros(mxfp4_gemm.PORTABLE_MAX_ROWS, WIDTH, device="cuda", dtype=torch.bfloat16)
    large = torch.zeros(mxfp4_gemm.PORTABLE_MAX_ROWS + 1, WIDTH, device="cuda", dtype=torch.bfloat16)
    assert mxfp4_gemm.kernel_for(small, "auto") == "portable"
    if torch.cuda.get_device_capability() >= (9, 0):
        assert mxfp4_gemm.kernel_for(large, "auto") == mxfp4_gemm.kernel_for(large, "dequantized")
        assert mxfp4_gemm.kernel_for(large, "auto") == "dequantized"
        assert mxfp4_gemm.kernel_for(large, "scaled") == "scaled"
        assert mxfp4_gemm.kernel_for(large.half(), "auto") == "scaled"
    assert not mxfp4_gemm.scaled_failures()


def test_scaled_kernel_with_the_weight_on_the_left():
    """The auto path's tl.dot_scaled kernel with `swap` (the weight's bytes on the left): rounds as the
    dequantized bf16 path at 64 tokens, fc1 and fc2, without falling back."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(64)
    rows = x.shape[0]
    cfg1, cfg2 = (
        dataclasses.replace(mxfp4_gemm.default_config(rows, EXPERTS, x.device, gated), swap=True)
        for gated in (True, False)
    )
    h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="auto", config=cfg1)
    assert_rounds_as("auto swap fc1 vs float64", h, ideal_fc1(x, b1, s1, bias, bounds))
    y = grouped_linear_mxfp4(h, b2, s2, bounds, path="auto", config=cfg2)
    assert_rounds_as("auto swap fc2 vs float64", y, exact_products(h, b2, s2, bounds).bfloat16())
    assert not mxfp4_gemm.scaled_failures()


@pytest.mark.parametrize("tokens", [64, 256])
def test_addends_round_as_the_dequantized_bf16_path(tokens):
    """fc1 + SwiGLU and fc2 with bf16 addends N(0, 1) (an adapter's update) at engine decode sizes, each path
    per row against float64 with the bf16 path's roundings (products rounded, the addend added and the sum
    rounded again) and against the dequantized path; on Hopper the portable kernel equals it bit for bit."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    g = torch.Generator(device="cuda").manual_seed(5)
    a1 = torch.randn(x.shape[0], 2 * WIDTH, generator=g, device="cuda").bfloat16()
    a2 = torch.randn(x.shape[0], WIDTH, generator=g, device="cuda").bfloat16()
    h_ideal = ideal_fc1(x, b1, s1, bias, bounds, a1)
    h_lib = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="reference", addend=a1)
    results = {}
    for path in ("auto", "portable", "scaled", "dequantized"):
        h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path=path, addend=a1)
        assert_rounds_as(f"{path} fc1 + addend vs float64, {tokens} tokens", h, h_ideal)
        assert_rounds_as(f"{path} fc1 + addend vs dequantized bf16", h, h_lib, differ_max=0.02)
        y = grouped_linear_mxfp4(h, b2, s2, bounds, path=path, addend=a2)
        y_ideal = (exact_products(h, b2, s2, bounds).bfloat16().double() + a2.double()).bfloat16()
        assert_rounds_as(f"{path} fc2 + addend vs float64", y, y_ideal)
        y_lib = grouped_linear_mxfp4(h, b2, s2, bounds, "reference", addend=a2)
        assert_rounds_as(f"{path} fc2 + addend vs dequantized bf16", y, y_lib, differ_max=0.02)
        results[path] = (h, y)
    if mxfp4_gemm.kernel_for(x, "dequantized") == "dequantized":
        h, y = results["dequantized"]
        assert torch.equal(results["portable"][0], h)
        assert torch.equal(grouped_linear_mxfp4(h, b2, s2, bounds, path="portable", addend=a2), y)
    assert not mxfp4_gemm.scaled_failures()


def test_ptx_decoding_is_exact():
    """The portable kernel's PTX decoding (decode="ptx"): every byte under every scale byte 2..240, read back
    through one-hot rows (each product a single decoded value), equals `dequantize` in bf16."""
    scales = torch.arange(2, 241, dtype=torch.uint8, device="cuda")[None, :, None].expand(1, 239, 16)
    blocks = torch.arange(256, device="cuda").to(torch.uint8).reshape(1, 1, 16, 16).expand(1, 239, 16, 16)
    x = torch.eye(512, device="cuda", dtype=torch.bfloat16)
    bounds = torch.tensor([0, 512], dtype=torch.int32, device="cuda")
    cfg = dataclasses.replace(mxfp4_gemm.default_config(512, 1, x.device, False), decode="ptx")
    y = grouped_linear_mxfp4(x, blocks.contiguous(), scales.contiguous(), bounds, path="portable", config=cfg)
    assert torch.equal(y.t(), mxfp4_gemm.dequantize(blocks, scales, torch.bfloat16)[0])


@pytest.mark.parametrize("decode", ["bytes", "groups", "ptx"])
@pytest.mark.parametrize("tokens", [64, 256])
def test_portable_decodings_equal_the_dequantized_path(decode, tokens):
    """The portable kernel with each decoding (`Mxfp4Config.decode`), fc1 and fc2 at engine decode sizes,
    default tiles otherwise: rounds as float64 with the bf16 path's roundings and, on Hopper, equals the
    dequantized path (the learner's) bit for bit. Its fp32 sums run over K in the library GEMM's order; the
    products of the even and of the odd columns summed apart differed in ~2e-5 of the values, and the
    engine/learner log-prob mismatch of tests/rl/test_mismatch_gpu.py's MXFP4 runs rose tenfold."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    cfg1, cfg2 = (
        dataclasses.replace(mxfp4_gemm.default_config(x.shape[0], EXPERTS, x.device, gated), decode=decode)
        for gated in (True, False)
    )
    h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="portable", config=cfg1)
    assert_rounds_as(f"portable {decode} fc1 vs float64", h, ideal_fc1(x, b1, s1, bias, bounds))
    y = grouped_linear_mxfp4(h, b2, s2, bounds, path="portable", config=cfg2)
    assert_rounds_as(f"portable {decode} fc2 vs float64", y, exact_products(h, b2, s2, bounds).bfloat16())
    if mxfp4_gemm.kernel_for(x, "dequantized") == "dequantized":
        assert torch.equal(h, fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="dequantized"))
        assert torch.equal(y, grouped_linear_mxfp4(h, b2, s2, bounds, path="dequantized"))


@pytest.mark.parametrize("tokens", [64, 256])
def test_relaid_weights_equal_the_row_major_kernel(tokens):
    """The forward kernel over the weights re-laid (`mxfp4_relaid.kernel_weights`: tiled, each byte format,
    both), default tiles with the ptx decoding and with sub_k 64: fc1 (SwiGLU) and fc2 (plus bias) bit for
    bit what it computes over the checkpoint's layout (the "pairs" format's PTX decoding relies on Triton
    handing its inline assembly the 4 bytes of one word at a time: a wrong grouping fails here)."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    g = torch.Generator(device="cuda").manual_seed(5)
    bias2 = torch.randn(EXPERTS, WIDTH, generator=g, device="cuda").bfloat16()
    for (blocks, scales), b, gated in (((b1, s1), bias, True), ((b2, s2), bias2, False)):
        default = mxfp4_gemm.default_config(x.shape[0], EXPERTS, x.device, gated)
        for cfg in (default, dataclasses.replace(default, sub_k=64)):
            ref = mxfp4_gemm._forward(
                x, blocks, scales, b, None, bounds, gated, LIMIT, ALPHA, "portable", cfg
            )
            formats = (
                (True, "checkpoint"),
                (False, "shuffled"),
                (True, "shuffled"),
                (False, "pairs"),
                (True, "pairs"),
            )
            for tiled, byte_format in formats:
                relaid = mxfp4_relaid.kernel_weights(
                    blocks, scales, gated, cfg.block_n, cfg.block_k, tiled, byte_format
                )
                ours = mxfp4_relaid.forward_kernel_weights(x, relaid, b, bounds, LIMIT, ALPHA, cfg)
                assert ours.abs().sum() > 0 and torch.equal(ours, ref), (gated, cfg.sub_k, tiled, byte_format)


def held_tiled(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint blocks and scales as a model holds them "tiled_pairs"."""
    return mxfp4_bytes.held_blocks(blocks, "tiled_pairs"), mxfp4_bytes.held_scales(scales, "tiled_pairs")


@pytest.mark.parametrize("held", ["pairs", "tiled_pairs"])
@pytest.mark.parametrize("tokens", [64, 256, 2048])
def test_pairs_byte_format_equals_the_checkpoint_bytes(tokens, held):
    """Weights held in byte format "pairs" (`mxfp4_bytes.pair_words`; the inputs' scales 2^-6 .. 2^-4 lie in
    its range), row-major or tile by tile (`tile_experts`): fc1 + SwiGLU, fc2 and fc2's input gradient on
    the auto path (the portable kernel with the pairs' inline assembly up to 1,024 rows, the dequantized path
    above) bit for bit what the checkpoint's bytes give, though their default K steps differ (64 values
    against 128: the products' fp32 sums run over K in the same order)."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    p1, p2 = mxfp4_bytes.pair_words(b1), mxfp4_bytes.pair_words(b2)
    q1, q2 = s1, s2
    if held == "tiled_pairs":
        p1, p2, q1, q2 = (mxfp4_bytes.tile_experts(t) for t in (p1, p2, s1, s2))
    h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA)
    assert torch.equal(fc1_swiglu_mxfp4(x, p1, q1, bias, bounds, LIMIT, ALPHA, byte_format=held), h)
    hs = [h.clone().requires_grad_(True) for _ in range(2)]
    y = grouped_linear_mxfp4(hs[0], b2, s2, bounds)
    y_pairs = grouped_linear_mxfp4(hs[1], p2, q2, bounds, byte_format=held)
    assert torch.equal(y_pairs, y)
    g = torch.randn_like(y)
    y.backward(g)
    y_pairs.backward(g)
    assert hs[0].grad.abs().sum() > 0 and torch.equal(hs[1].grad, hs[0].grad)


@pytest.mark.parametrize("tokens", [256, 512])
def test_half_height_tail_tiles_change_no_bit(tokens):
    """`Mxfp4Config.half_tail` (fc1's default): at 1,024 / 2,048 rows (64- / 128-row tiles, about half the
    experts' rows fitting half a tile) the programs that run half-height tiles give every output bit for bit
    as the full-height tiles do, fc1 + SwiGLU (with and without an addend) and fc2, over the pairs held
    tile by tile."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    (p1, q1), (p2, q2) = held_tiled(b1, s1), held_tiled(b2, s2)
    counts = (bounds[1:] - bounds[:-1]).tolist()

    def configs(gated: bool) -> list[mxfp4_gemm.Mxfp4Config]:
        cfg = mxfp4_gemm.default_config(x.shape[0], EXPERTS, x.device, gated, "tiled_pairs")
        assert cfg.half_tail is gated and cfg.block_m >= 64  # fc1's default
        assert 0 < sum(0 < c <= cfg.block_m // 2 for c in counts) < EXPERTS, (counts, cfg.block_m)  # both run
        return [dataclasses.replace(cfg, half_tail=half) for half in (True, False)]

    h = [fc1_swiglu_mxfp4(x, p1, q1, bias, bounds, LIMIT, ALPHA, "portable", c, byte_format="tiled_pairs")
         for c in configs(True)]  # fmt: skip
    assert h[0].abs().sum() > 0 and torch.equal(h[0], h[1])
    update = 0.1 * torch.randn(x.shape[0], 2 * WIDTH, device="cuda").bfloat16()  # an adapter's, as in LoRA
    h_add = [fc1_swiglu_mxfp4(x, p1, q1, bias, bounds, LIMIT, ALPHA, "portable", c, update, "tiled_pairs")
             for c in configs(True)]  # fmt: skip
    assert not torch.equal(h_add[0], h[0]) and torch.equal(h_add[0], h_add[1])
    y = [
        grouped_linear_mxfp4(h[0], p2, q2, bounds, "portable", c, byte_format="tiled_pairs")
        for c in configs(False)
    ]
    assert y[0].abs().sum() > 0 and torch.equal(y[0], y[1])


@pytest.mark.parametrize("tokens", [256, 512])
def test_column_blocks_of_two_tiles_change_no_bit(tokens):
    """Weights held "tiled_pairs" read 128 columns a program over 8 warps (two stored 64-row tiles a block,
    `SUB_ROWS`): every output bit for bit what one tile a program gives, fc1 + SwiGLU and fc2."""
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    (p1, q1), (p2, q2) = held_tiled(b1, s1), held_tiled(b2, s2)

    def configs(gated: bool) -> list[mxfp4_gemm.Mxfp4Config]:
        one = mxfp4_gemm.default_config(x.shape[0], EXPERTS, x.device, gated, "tiled_pairs")
        return [one, dataclasses.replace(one, block_n=128, warps=8)]

    h = [fc1_swiglu_mxfp4(x, p1, q1, bias, bounds, LIMIT, ALPHA, "portable", c, byte_format="tiled_pairs")
         for c in configs(True)]  # fmt: skip
    assert h[0].abs().sum() > 0 and torch.equal(h[0], h[1])
    y = [
        grouped_linear_mxfp4(h[0], p2, q2, bounds, "portable", c, byte_format="tiled_pairs")
        for c in configs(False)
    ]
    assert y[0].abs().sum() > 0 and torch.equal(y[0], y[1])


@pytest.mark.parametrize("held", ["checkpoint", "tiled_pairs"])
@pytest.mark.parametrize("tokens", [64, 256, 512])
def test_fc2_bias_in_the_epilogue_changes_no_bit(tokens, held):
    """The engine's fc2 (`fc2_bias_mxfp4`: the bias added in the kernel's epilogue) gives in bf16 exactly
    what `grouped_linear_mxfp4` then `fused_moe.expert_bias` give, with an adapter's addend and without."""
    x, _, _, (b2, s2), bounds = inputs(tokens)
    if held == "tiled_pairs":
        b2, s2 = held_tiled(b2, s2)
    bias = torch.randn(EXPERTS, WIDTH, device="cuda").bfloat16()
    for addend in (None, 0.1 * torch.randn(x.shape[0], WIDTH, device="cuda").bfloat16()):
        y = grouped_linear_mxfp4(x, b2, s2, bounds, "portable", addend=addend, byte_format=held)
        ours = mxfp4_gemm.fc2_bias_mxfp4(x, b2, s2, bias, bounds, "portable", addend=addend, byte_format=held)
        assert ours.abs().sum() > 0 and torch.equal(ours, fused_moe.expert_bias(y, bias, bounds))


@pytest.mark.parametrize("tokens", [64, 512])
def test_programmatic_dependent_launch_changes_no_bit(tokens):
    """fc1 then fc2 launched with programmatic dependent launch (`Mxfp4Config.pdl`; fc2 starts while fc1
    ends and waits for its writes), replayed from a CUDA graph as the engine runs them, over the pairs held
    tile by tile: every output bit for bit as launched one after the other."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens)
    (p1, q1), (p2, q2) = held_tiled(b1, s1), held_tiled(b2, s2)
    bias2 = torch.randn(EXPERTS, WIDTH, device="cuda").bfloat16()

    def layer(pdl: bool) -> torch.Tensor:
        c1, c2 = (
            dataclasses.replace(
                mxfp4_gemm.default_config(x.shape[0], EXPERTS, x.device, gated, "tiled_pairs"), pdl=pdl
            )
            for gated in (True, False)
        )
        h = fc1_swiglu_mxfp4(x, p1, q1, bias, bounds, LIMIT, ALPHA, "portable", c1, byte_format="tiled_pairs")
        return mxfp4_gemm.fc2_bias_mxfp4(h, p2, q2, bias2, bounds, "portable", c2, byte_format="tiled_pairs")

    outs = []
    for pdl in (False, True):
        layer(pdl)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(pdl)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


def test_portable_path_with_pre_hopper_matrix_instructions():
    """The portable kernels compiled with DISABLE_MMA_V3=1 (Triton's mma.sync, the instructions of Ampere
    and Ada: no wgmma, no tensor descriptors) in a child process with its own kernel cache: same checks,
    and the compiled kernels hold no wgmma."""
    with tempfile.TemporaryDirectory() as cache:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "DISABLE_MMA_V3": "1", "TRITON_CACHE_DIR": cache, "PYTHONPATH": path}
        done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        print(done.stdout[-4000:], done.stderr[-4000:])
        assert done.returncode == 0
        ptx = [p.read_text() for p in Path(cache).rglob("*.ptx")]
        assert ptx and any("mxfp4" in text for text in ptx)
        assert not any("wgmma" in text for text in ptx) and any("mma.sync" in text for text in ptx)


if __name__ == "__main__":  # the child process of the test above
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    check_paths(256, ("portable",))


def test_dequantize_kernel_on_every_byte_and_scale():
    """The one-launch decoding on the GPU: every byte with every scale byte of its range (0 .. 240,
    subnormal values included), the same bits as `dequantize` in bf16 and fp32."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(241, 2).reshape(241, 2, 16, 16).cuda()
    scales = torch.arange(241, dtype=torch.uint8)[:, None, None].expand(241, 2, 16).contiguous().cuda()
    for dtype in (torch.bfloat16, torch.float32):
        ours = mxfp4_gemm.dequantize_kernel(blocks, scales, dtype)
        assert torch.equal(ours, mxfp4_gemm.dequantize(blocks, scales, dtype))


@pytest.mark.parametrize("chunk_experts", [0, 5])
def test_dequantized_path_is_the_bf16_learner_path(monkeypatch, chunk_experts):
    """The dequantized path (auto above PORTABLE_MAX_ROWS rows) gives the bf16 experts' learner path
    (`torch._grouped_mm` on the dequantized weights, autograd's input gradient) bit for bit: fc1 + SwiGLU,
    fc2, and the input gradient through both; also with the experts decoded in chunks of 5 (the bounds read
    on the host, chunks of rows multiplied apart)."""
    if chunk_experts:
        per_expert = 2 * WIDTH * WIDTH * 2
        monkeypatch.setattr(mxfp4_gemm, "DEQUANTIZE_CHUNK_BYTES", chunk_experts * per_expert)
    x, (b1, s1), bias, (b2, s2), bounds = inputs(2048)
    w1 = mxfp4_gemm.dequantize(b1, s1, torch.bfloat16)
    w2 = mxfp4_gemm.dequantize(b2, s2, torch.bfloat16)
    assert mxfp4_gemm.kernel_for(x, "auto") == "dequantized"
    with torch.no_grad():
        h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA)
        h_ref = fused_moe.swiglu_bias(
            torch._grouped_mm(x, w1.transpose(1, 2), offs=bounds[1:]), bias, bounds, LIMIT, ALPHA
        )
    assert torch.equal(h, h_ref)
    ours_in, ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = grouped_linear_mxfp4(
        fused_moe.swiglu_bias(grouped_linear_mxfp4(ours_in, b1, s1, bounds), bias, bounds, LIMIT, ALPHA),
        b2, s2, bounds,
    )  # fmt: skip
    y_ref = torch._grouped_mm(
        fused_moe.swiglu_bias(
            torch._grouped_mm(ref_in, w1.transpose(1, 2), offs=bounds[1:]), bias, bounds, LIMIT, ALPHA
        ),
        w2.transpose(1, 2),
        offs=bounds[1:],
    )
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(ours_in.grad, ref_in.grad)


@pytest.mark.parametrize("tokens", [16, 64, 2048])
def test_gpt_oss_120b_expert_count(tokens):
    """gpt-oss-120b's 128 experts (top-4, width 2880): decode sizes (few rows per expert, many experts
    without rows) and a learner size, where the dequantized path decodes fc1 in two chunks (4.2 GB in bf16):
    each path's fc1 + SwiGLU, fc2 and fc2's input gradient round as the dequantize-then-bf16 path."""
    experts = 128
    x, (b1, s1), bias, (b2, s2), bounds = inputs(tokens, experts=experts)
    per_expert = 2 * WIDTH * WIDTH * 2
    assert experts * per_expert > mxfp4_gemm.DEQUANTIZE_CHUNK_BYTES  # the chunked decoding runs
    h_lib = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path="reference")
    seeded = torch.Generator(device="cuda").manual_seed(3)
    g = torch.randn(x.shape, device="cuda", generator=seeded).bfloat16()
    rows_lib = h_lib.clone().requires_grad_()
    y_lib = grouped_linear_mxfp4(rows_lib, b2, s2, bounds, "reference")
    y_lib.backward(g)
    for path in ("auto", "portable", "dequantized"):
        h = fc1_swiglu_mxfp4(x, b1, s1, bias, bounds, LIMIT, ALPHA, path=path)
        assert_rounds_as(f"{path} fc1, 128 experts, {tokens} tokens", h, h_lib, differ_max=0.02)
        rows = h_lib.clone().requires_grad_()
        y = grouped_linear_mxfp4(rows, b2, s2, bounds, path=path)
        assert_rounds_as(f"{path} fc2, 128 experts", y, y_lib.detach(), differ_max=0.02)
        y.backward(g)
        assert_rounds_as(f"{path} grad_x, 128 experts", rows.grad, rows_lib.grad, differ_max=0.02)
