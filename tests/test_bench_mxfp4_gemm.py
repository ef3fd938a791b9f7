"""benchmarks/bench_mxfp4_gemm.py's load floor over the tile-contiguous layout (Triton interpreter, fp32): the
re-laid bytes hold every byte and scale of the weights, and the tiled floor kernel, reading them tile by
tile, computes exactly what the row-major floor kernel computes from the original layout."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_mxfp4_gemm  # noqa: E402

from megatron_gptoss.ops import fused_moe, mxfp4_gemm  # noqa: E402


@pytest.mark.parametrize("gated", [True, False])
def test_tile_layout_keeps_every_byte(gated):
    g = torch.Generator().manual_seed(0)
    experts, rows, width = 2, 2 * 24 if gated else 24, 96  # 24 rows: not a whole number of 16-row tiles
    blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 130, (experts, rows, width // 32), generator=g, dtype=torch.uint8)
    tiled, tiled_scales, nb, kt = bench_mxfp4_gemm.tile_layout(blocks, scales, gated, 16, 64)
    halves, n = (2, rows // 2) if gated else (1, rows)
    assert (nb, kt) == (2, 2) and tiled.shape == (experts, halves, nb, kt, 16, 32)
    # byte j of row r of half h sits in tile (r // 16, j // 32) at (r % 16, j % 32); the padding is zero
    untiled = tiled.permute(0, 1, 2, 4, 3, 5).reshape(experts, halves, nb * 16, kt * 32)
    assert torch.equal(
        untiled[:, :, :n, : width // 2].reshape(experts, rows, -1), blocks.reshape(experts, rows, -1)
    )
    assert untiled[:, :, n:].eq(0).all() and untiled[..., width // 2 :].eq(0).all()
    scales_back = tiled_scales.permute(0, 1, 2, 4, 3, 5).reshape(experts, halves, nb * 16, kt * 2)
    assert torch.equal(scales_back[:, :, :n, : width // 32].reshape(experts, rows, -1), scales)


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
