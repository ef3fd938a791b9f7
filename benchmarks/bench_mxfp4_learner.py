"""The learner's expert layer over MXFP4 weights, forward and input gradient, on each path, at gpt-oss-20b
widths, one GPU: where `mxfp4_gemm`'s auto path should stop running the portable kernel.

    python benchmarks/bench_mxfp4_learner.py --tokens 256,1024,4096,16384
    TRITON_INTERPRET=1 python benchmarks/bench_mxfp4_learner.py --tiny     # the CPU (fp32, toy widths)

The layer as the learner composes it (`model.moe`'s MXFP4 experts): fc1 by `grouped_linear_mxfp4`, then
`fused_moe.swiglu_bias`, fc2 by `grouped_linear_mxfp4`, then `fused_moe.expert_bias`, over weights held in
`--format` (a model's `model.mxfp4_byte_format`). Rows (tokens x top-4) sorted by expert. Paths:

    auto           what the learner runs (the portable kernel up to `mxfp4_gemm.PORTABLE_MAX_ROWS` rows, above
                   them the dequantized path; the kernel that ran in brackets)
    portable       the portable kernel at any size, forward and input-gradient kernels
    dequantized    the weights decoded to bf16, then `torch._grouped_mm`, forward and backward
    bf16 library   the same weights held dequantized in bf16 (the bf16 base's learner path)

Two timings per path, eagerly as the learner runs them (events around `--layers` calls, a different
layer's weights each, median of `--reps`): the forward alone under `torch.no_grad()` (the log-prob pass),
and the forward with the backward to the input (a frozen base: no weight gradient). Check: each MXFP4
path's output and input gradient against the bf16 library's (within 1e-2 relative; the same values, the
products' order aside).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mxfp4_gemm as gemm_bench  # noqa: E402
from bench_moe_decode import rel_err, time_per_layer  # noqa: E402
from bench_mxfp4_gemm import ALPHA, LIMIT, TOLERANCE, TOPK, Layers  # noqa: E402

from megatron_gptoss.ops import fused_moe, mxfp4_bytes, mxfp4_gemm  # noqa: E402

PATHS = ("auto", "portable", "dequantized")


def held_weights(layers: Layers, byte_format: str) -> list[tuple[tuple, tuple]]:
    """Each layer's (fc1, fc2) (blocks, scales) as a model holds them in `byte_format`."""

    def held(blocks, scales):
        return mxfp4_bytes.held_blocks(blocks, byte_format), mxfp4_bytes.held_scales(scales, byte_format)

    return [(held(*layers.fc1[i]), held(*layers.fc2[i])) for i in range(layers.count)]


def learner_layer(path: str, layers: Layers, held: list[tuple[tuple, tuple]], byte_format: str):
    """(x, i, bounds) -> y of layer i's experts as the learner composes them on MXFP4 `path`, or on the bf16
    weights with `path` "bf16" (the library's grouped GEMM on CUDA, the reference elsewhere)."""

    def gemm(x, i: int, bounds, second: bool):
        if path == "bf16":
            return gemm_bench.library_gemm(x, layers, i, bounds, second)
        blocks, scales = held[i][1 if second else 0]
        return mxfp4_gemm.grouped_linear_mxfp4(x, blocks, scales, bounds, path, byte_format=byte_format)

    def layer(x, i: int, bounds):
        h = fused_moe.swiglu_bias(gemm(x, i, bounds, False), layers.b1[i], bounds, LIMIT, ALPHA)
        return fused_moe.expert_bias(gemm(h, i, bounds, True), layers.b2[i], bounds)

    return layer


def output_and_grad(layer, x, bounds, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, dL/dx) of layer 0 for the upstream gradient `grad`."""
    rows = x.detach().requires_grad_(True)
    y = layer(rows, 0, bounds)
    (dx,) = torch.autograd.grad(y, rows, grad)
    return y.detach(), dx


def run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    sz = gemm_bench.sizes(args)
    if sz is None:
        return 2
    mxfp4_bytes.check_held_format(args.format)
    if sz.device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(sz.device)}; torch {torch.__version__}")
    layers = Layers(sz.count, sz.experts, sz.width, sz.width, sz.dtype, sz.device)
    held = held_weights(layers, args.format)
    table, ok = [], True
    print(f"check (layer 0, against the bf16 library, tolerance {TOLERANCE}):")
    for tokens in sz.tokens:
        bounds, (x, grad) = gemm_bench.routed_rows(tokens, sz, columns=2)
        base = learner_layer("bf16", layers, held, args.format)
        y_ref, dx_ref = output_and_grad(base, x, bounds, grad)
        for path in (*PATHS, "bf16"):
            layer = learner_layer(path, layers, held, args.format)
            if path == "bf16":
                name = "bf16 library"
            else:
                name = f"mxfp4 {path} ({mxfp4_gemm.kernel_for(x, path, args.format)})"
                y, dx = output_and_grad(layer, x, bounds, grad)
                ey, edx = rel_err(y, y_ref), rel_err(dx, dx_ref)
                good = ey <= TOLERANCE and edx <= TOLERANCE
                ok &= good
                verdict = "ok" if good else "FAILED"
                print(f"  {x.shape[0]:6d} rows {name:28s} y {ey:.2e}  dx {edx:.2e}  {verdict}")

            def forward(i: int, f=layer, x=x, bounds=bounds):
                with torch.no_grad():
                    return f(x, i, bounds)

            def backward(i: int, f=layer, x=x, bounds=bounds, grad=grad):
                rows = x.detach().requires_grad_(True)
                return torch.autograd.grad(f(rows, i, bounds), rows, grad)

            ms_f = time_per_layer(forward, sz.count, sz.reps, sz.device, graph=False)
            ms_b = time_per_layer(backward, sz.count, sz.reps, sz.device, graph=False)
            table.append((tokens, x.shape[0], name, ms_f, ms_b))
            print(f"  {x.shape[0]:6d} rows {name}: forward {ms_f * 1e3:.0f} us, with the input gradient "
                  f"{ms_b * 1e3:.0f} us", flush=True)  # fmt: skip
    print(f"\nper layer: {sz.experts} experts, hidden = intermediate = {sz.width}, top-{TOPK}, {sz.dtype}, "
          f"weights held {args.format}, {sz.count} layers cycled, eager")  # fmt: skip
    print("| tokens | rows | path | forward (us) | forward + input gradient (us) | / bf16 library |")
    print("|---|---|---|---|---|---|")
    library = {rows: ms_b for _, rows, name, _, ms_b in table if name == "bf16 library"}
    for tokens, rows, name, ms_f, ms_b in table:
        print(f"| {tokens} | {rows} | {name} | {ms_f * 1e3:.0f} | {ms_b * 1e3:.0f} | "
              f"{ms_b / library[rows]:.2f}x |")  # fmt: skip
    print(f"({time.perf_counter() - began:.0f} s in all){'' if ok else '  CHECK FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = gemm_bench.size_arguments(__doc__, "256,1024,4096,16384", 10, "timed repetitions")
    parser.add_argument("--format", default="tiled_pairs", help="the held byte format (HELD_FORMATS)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
