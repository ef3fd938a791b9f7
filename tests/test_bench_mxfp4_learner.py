"""benchmarks/bench_mxfp4_learner.py (Triton interpreter, fp32): each MXFP4 path of the learner's expert
layer, over weights held tile by tile, gives the output and input gradient of the layer over the same weights
dequantized (within 1e-6 in fp32), and the benchmark's check would see a wrong gradient."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_mxfp4_learner as bench  # noqa: E402
from bench_moe_decode import rel_err  # noqa: E402
from bench_mxfp4_gemm import Layers  # noqa: E402

from megatron_gptoss.ops import fused_moe  # noqa: E402


def test_learner_paths_match_the_dequantized_layer():
    layers = Layers(1, 4, 64, 64, torch.float32, torch.device("cpu"))
    held = bench.held_weights(layers, "tiled_pairs")
    g = torch.Generator().manual_seed(5)
    bounds = fused_moe.sort_by_expert(torch.rand(5, 4, generator=g).topk(2, dim=-1).indices, 4)[1]
    x, grad = torch.randn(10, 64, generator=g), torch.randn(10, 64, generator=g)
    base = bench.learner_layer("bf16", layers, held, "tiled_pairs")
    y_ref, dx_ref = bench.output_and_grad(base, x, bounds, grad)
    assert y_ref.abs().sum() > 0 and dx_ref.abs().sum() > 0
    for path in bench.PATHS:
        layer = bench.learner_layer(path, layers, held, "tiled_pairs")
        y, dx = bench.output_and_grad(layer, x, bounds, grad)
        assert rel_err(y, y_ref) <= 1e-6 and rel_err(dx, dx_ref) <= 1e-6, path
    doubled = bench.output_and_grad(lambda r, i, b: layer(r, i, b) * 1.02, x, bounds, grad)[1]
    assert rel_err(doubled, dx_ref) > bench.TOLERANCE  # the check can fail
