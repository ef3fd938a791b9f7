"""benchmarks/bench_mxfp4_gemm.py over the tile-contiguous layout (Triton interpreter, fp32): the tiled floor
kernel, reading the re-laid weights tile by tile, computes exactly what the row-major floor kernel computes
from the original layout, and the benchmark's tiled layer and its layers over the weights as a model holds
them pass its check against the reference."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_mxfp4_gemm  # noqa: E402

from megatron_gptoss.ops import fused_moe, mxfp4_gemm  # noqa: E402


def test_tiled_floor_computes_the_row_major_floor():
    layers = bench_mxfp4_gemm.Layers(1, 4, 64, 64, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    indices = torch.rand(5, 4, generator=g).topk(2, dim=-1).indices
    bounds = fused_moe.sort_by_expert(indices, 4)[1]
    x = torch.randn(10, 64, generator=g)
    assert mxfp4_gemm.default_config(10, 4, x.device, True).block_k == 32  # the CPU tiles: both kernels
    for tiled, plain in zip(bench_mxfp4_gemm.floor_layer(32, tiled=True), bench_mxfp4_gemm.floor_layer()):
        ours, ref = tiled(x, layers, 0, bounds), plain(x, layers, 0, bounds)
        assert ref.abs().sum() > 0 and torch.equal(ours, ref)


def test_tiled_layer_passes_the_check():
    layers = bench_mxfp4_gemm.Layers(1, 4, 64, 64, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    bounds = fused_moe.sort_by_expert(torch.rand(6, 4, generator=g).topk(2, dim=-1).indices, 4)[1]
    x = torch.randn(12, 64, generator=g)
    fc1, fc2 = bench_mxfp4_gemm.relaid_layer("tiled+shuffled", decode="groups")
    assert bench_mxfp4_gemm.check("tiled", fc1, fc2, layers, x, bounds, verbose=False)
    off = bench_mxfp4_gemm.check("off", lambda *a: fc1(*a) * 1.02, fc2, layers, x, bounds, verbose=False)
    assert not off  # the check can fail


def test_held_layers_pass_the_check():
    """The benchmark's layers over weights as a model holds them (`held_layer`: the pairs, row-major and
    tile by tile, the latter also in column blocks of two 64-row tiles) pass its check against the
    reference; a tile the held tiles cannot serve is refused by name."""
    layers = bench_mxfp4_gemm.Layers(1, 4, 128, 128, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    bounds = fused_moe.sort_by_expert(torch.rand(6, 4, generator=g).topk(2, dim=-1).indices, 4)[1]
    x = torch.randn(12, 128, generator=g)
    for byte_format in bench_mxfp4_gemm.HELD:
        fc1, fc2 = bench_mxfp4_gemm.held_layer(byte_format)
        assert bench_mxfp4_gemm.check(byte_format, fc1, fc2, layers, x, bounds, verbose=False), byte_format
    tiled = mxfp4_gemm.default_config(12, 4, x.device, True, "tiled_pairs")
    two = dataclasses.replace(tiled, block_n=128)
    fc1, fc2 = bench_mxfp4_gemm.held_layer("tiled_pairs", two, two)
    assert bench_mxfp4_gemm.check("two tiles", fc1, fc2, layers, x, bounds, verbose=False)
    fc1, _ = bench_mxfp4_gemm.held_layer("tiled_pairs", dataclasses.replace(tiled, block_n=32))
    with pytest.raises(ValueError, match="multiple of 64"):
        fc1(x, layers, 0, bounds)
