"""Decode expert GEMMs (`ops.moe_decode`) against the library path at gpt-oss-20b widths, one GPU.

    python benchmarks/bench_moe_decode.py               # check, tile sweep, table (~2-3 minutes on an H100)
    python benchmarks/bench_moe_decode.py --check-only  # bf16 errors of both paths only (seconds)
    python benchmarks/bench_moe_decode.py --tiny        # toy widths: CPU (TRITON_INTERPRET=1) or a GPU

Shapes: 32 experts, top-4 random routing of N tokens (N * 4 expert-sorted rows), hidden = intermediate =
2880, bf16, random weights and biases. Library path: `torch._grouped_mm` + `fused_moe.swiglu_bias` (fc1),
`torch._grouped_mm` + `fused_moe.expert_bias` (fc2). Decode path: `decode_fc1`, `decode_fc2`.

Check: per N, h = fc1 output and y = fc2 output (each path's fc2 on its own h) of both paths against an
fp32 reference (per-expert fp32 GEMMs; TF32 off), and the decode path against the library path; every
error ||a - b|| / ||b|| must be <= 1e-2. Every swept tile config is checked the same way before it is timed.

Timing: `--layers` layers of weights (24 x 1.6 GB), a different layer per call, so every call streams its
weights from HBM (L2 holds 50 MB). One CUDA graph replays the op over all layers; the time per layer is the
replay's time (CUDA events) over the layers, median of `--reps` replays. Bandwidth = bytes of the weights
and biases of the experts hit (an expert without rows is not read) / time. The copy rate is 2 x bytes /
time of a 1 GiB device-to-device copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from megatron_gptoss.model.moe import grouped_linear
from megatron_gptoss.ops import fused_moe, moe_decode
from megatron_gptoss.ops.moe_decode import DecodeConfig

LIMIT, ALPHA, TOPK = 7.0, 1.702, 4
TOLERANCE = 1e-2
# (row tile factor, block_n, block_k, warps, stages, swap, tma) tried at each N, the likeliest first:
# block_m = `row_tile(rows, experts, factor)` (factor 2 is `default_config`'s); a config that does not
# compile or run (shared memory, registers) is skipped
SWEEP = [
    (2, 64, 128, 4, 4, True, True), (2, 64, 128, 4, 4, True, False), (2, 64, 64, 4, 3, True, True),
    (2, 64, 64, 4, 3, True, False), (2, 64, 128, 4, 2, True, True), (2, 64, 128, 4, 3, True, True),
    (2, 128, 64, 4, 4, True, True), (2, 128, 128, 8, 3, True, True), (2, 64, 256, 4, 3, True, True),
    (2, 64, 128, 8, 4, True, True), (2, 64, 128, 4, 3, True, False), (2, 64, 64, 4, 6, True, False),
    (2, 128, 64, 4, 4, True, False), (2, 32, 128, 4, 4, True, True), (1, 64, 128, 4, 4, True, True),
    (1, 64, 128, 4, 4, True, False), (2, 64, 128, 4, 4, False, True), (1, 64, 128, 4, 4, False, False),
    (2, 32, 256, 4, 4, True, False), (2, 128, 128, 8, 3, True, False),
]  # fmt: skip
TINY_SWEEP = [(1, 16, 16, 1, 1, True, True), (2, 32, 16, 1, 1, False, False)]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


class Layers:
    """`count` layers of expert weights and biases, bf16 (fp32 on the CPU), drawn on the device."""

    def __init__(self, count: int, experts: int, hidden: int, inter: int, dtype, device):
        def rand(*shape, std):
            return torch.empty(*shape, dtype=dtype, device=device).normal_(0.0, std)

        # std chosen so that the gate and up products pass the SwiGLU limit on about one percent of entries
        self.w1 = [rand(experts, 2 * inter, hidden, std=0.05) for _ in range(count)]
        self.b1 = [rand(experts, 2 * inter, std=0.5) for _ in range(count)]
        self.w2 = [rand(experts, hidden, inter, std=0.02) for _ in range(count)]
        self.b2 = [rand(experts, hidden, std=0.5) for _ in range(count)]
        self.count, self.experts, self.hidden, self.inter = count, experts, hidden, inter


def routing(tokens: int, experts: int, device) -> torch.Tensor:
    """bounds int32 [E + 1] of `tokens` tokens each routed to TOPK distinct random experts."""
    g = torch.Generator().manual_seed(tokens)
    indices = torch.rand(tokens, experts, generator=g).topk(TOPK, dim=-1).indices
    return fused_moe.sort_by_expert(indices.to(device), experts)[1]


def library_fc1(x, w1, b1, bounds):
    gemm = "grouped_mm" if x.is_cuda else "loop"
    return fused_moe.swiglu_bias(grouped_linear(x, w1, bounds, gemm), b1, bounds, LIMIT, ALPHA)


def library_fc2(h, w2, b2, bounds):
    gemm = "grouped_mm" if h.is_cuda else "loop"
    return fused_moe.expert_bias(grouped_linear(h, w2, bounds, gemm), b2, bounds)


def decode_fc1(cfg: DecodeConfig | None):
    return lambda x, w1, b1, bounds: moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, cfg)


def decode_fc2(cfg: DecodeConfig | None):
    return lambda h, w2, b2, bounds: moe_decode.decode_fc2(h, w2, b2, bounds, cfg)


def errors(layers: Layers, x, bounds, fc1, fc2) -> dict[str, float]:
    """Errors of (fc1, fc2) on layer 0 against the fp32 reference."""
    w1, b1, w2, b2 = layers.w1[0], layers.b1[0], layers.w2[0], layers.b2[0]
    h_ref = moe_decode.fc1_reference(x.float(), w1, b1, bounds, LIMIT, ALPHA)
    y_ref = moe_decode.fc2_reference(h_ref, w2, b2, bounds)
    h = fc1(x, w1, b1, bounds)
    y = fc2(h, w2, b2, bounds)
    return {"h": rel_err(h, h_ref), "y": rel_err(y, y_ref), "_h": h, "_y": y}  # type: ignore[dict-item]


def check(layers: Layers, x, bounds, cfg1=None, cfg2=None, verbose=True) -> bool:
    lib = errors(layers, x, bounds, library_fc1, library_fc2)
    new = errors(layers, x, bounds, decode_fc1(cfg1), decode_fc2(cfg2))
    vs_lib = {"h": rel_err(new["_h"], lib["_h"]), "y": rel_err(new["_y"], lib["_y"])}
    ok = all(v <= TOLERANCE for v in (new["h"], new["y"], vs_lib["h"], vs_lib["y"]))
    if verbose:
        print(
            f"  rows {x.shape[0]:5d}: error vs fp32 ref  library h {lib['h']:.2e} y {lib['y']:.2e} | "
            f"decode h {new['h']:.2e} y {new['y']:.2e} | decode vs library h {vs_lib['h']:.2e} "
            f"y {vs_lib['y']:.2e}  {'ok' if ok else 'FAILED'}"
        )
    return ok


def time_per_layer(
    fn: Callable[[int], object], layers: int, reps: int, device, graph: bool = True
) -> float:  # fmt: skip
    """Median ms per call of fn(layer) over all layers: a CUDA graph of the calls replayed, or with `graph`
    False (and on the CPU) the calls run eagerly (`elapsed_ms`)."""

    def calls() -> None:
        for layer in range(layers):
            fn(layer)

    calls()  # compile and warm up outside the capture
    run, captured = calls, None
    if device.type == "cuda" and graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            calls()
        captured.replay()
        run = captured.replay
    times = [elapsed_ms(run, device) / layers for _ in range(reps)]
    del captured
    return statistics.median(times)


def elapsed_ms(run: Callable[[], object], device) -> float:
    """Milliseconds of one run(): between two events on a CUDA device, by the host's clock elsewhere."""
    if device.type != "cuda":
        began = time.perf_counter()
        run()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def copy_rate(device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * src.element_size() * 10 / (start.elapsed_time(end) / 1e3)


def with_tile(rows: int, experts: int, tile: tuple[int, int, int, int, int, bool, bool]) -> DecodeConfig:
    factor, block_n, block_k, warps, stages, swap, tma = tile
    block_m = moe_decode.row_tile(rows, experts, factor)
    return DecodeConfig(block_m, block_n, block_k, warps, stages, swap, tma)


def sweep(layers: Layers, x, bounds, h, tiles, reps, device, budget_s: float):
    """{"fc1" / "fc2": [(ms per layer, config)] sorted}: each tile config fitted to the shared memory
    (`moe_decode.fit_shared_memory`, per kernel), checked, then timed, until `budget_s` seconds have passed
    (compiling a config takes about a second); a config met twice after fitting is timed once."""
    found: dict[str, list[tuple[float, DecodeConfig]]] = {"fc1": [], "fc2": []}
    seen: dict[str, set[DecodeConfig]] = {"fc1": set(), "fc2": set()}
    deadline = time.perf_counter() + budget_s
    w1, b1, w2, b2 = layers.w1, layers.b1, layers.w2, layers.b2
    for index, tile in enumerate(tiles):
        if time.perf_counter() > deadline:
            print(f"    time budget spent: {len(tiles) - index} configs not tried")
            break
        cfg = with_tile(x.shape[0], layers.experts, tile)
        cfg1, cfg2 = (moe_decode.fit_shared_memory(cfg, x.dtype, gated) for gated in (True, False))
        if cfg1 in seen["fc1"] and cfg2 in seen["fc2"]:
            continue
        try:
            if not check(layers, x, bounds, cfg1, cfg2, verbose=False):
                print(f"    {describe(cfg1)} / {describe(cfg2)}: wrong results, skipped")
                continue
            for name, c, fn in (
                ("fc1", cfg1, lambda i, c=cfg1: decode_fc1(c)(x, w1[i], b1[i], bounds)),
                ("fc2", cfg2, lambda i, c=cfg2: decode_fc2(c)(h, w2[i], b2[i], bounds)),
            ):
                if c not in seen[name]:
                    seen[name].add(c)
                    found[name].append((time_per_layer(fn, layers.count, reps, device), c))
        except Exception as exc:  # noqa: BLE001 - a config beyond the device's resources is skipped
            first = str(exc).splitlines()[0][:90] if str(exc) else ""
            print(f"    {describe(cfg1)} / {describe(cfg2)}: {type(exc).__name__}: {first}")
            continue
    return {name: sorted(results, key=lambda r: r[0]) for name, results in found.items()}


def time_case(layers: Layers, x, bounds, tiles, reps: int, budget_s: float, device):
    """[(path, fc1 ms, fc2 ms, layer ms)] per layer: library, decode with the default tiles, decode with
    the best swept tiles (fc1 and fc2 each timed alone; the layer as fc1 then fc2, layer after layer)."""
    count = layers.count
    w1, b1, w2, b2 = layers.w1, layers.b1, layers.w2, layers.b2
    h_lib = library_fc1(x, w1[0], b1[0], bounds)
    h = moe_decode.decode_fc1(x, w1[0], b1[0], bounds, LIMIT, ALPHA)

    def run(fc1, fc2):
        rows_in = h_lib if fc2 is library_fc2 else h
        return (
            time_per_layer(lambda i: fc1(x, w1[i], b1[i], bounds), count, reps, device),
            time_per_layer(lambda i: fc2(rows_in, w2[i], b2[i], bounds), count, reps, device),
            time_per_layer(
                lambda i: fc2(fc1(x, w1[i], b1[i], bounds), w2[i], b2[i], bounds), count, reps, device
            ),
        )

    rows = [("library", *run(library_fc1, library_fc2))]
    rows.append(("decode, default tiles", *run(decode_fc1(None), decode_fc2(None))))
    if budget_s > 0:
        found = sweep(layers, x, bounds, h, tiles, max(reps // 2, 1), device, budget_s)
        for name, results in found.items():
            top = ", ".join(f"{ms * 1e3:.0f} us {describe(c)}" for ms, c in results[:3])
            print(f"  {name} best: {top}")
        if found["fc1"] and found["fc2"]:
            c1, c2 = found["fc1"][0][1], found["fc2"][0][1]
            name = f"decode, best: fc1 {describe(c1)} / fc2 {describe(c2)}"
            rows.append((name, *run(decode_fc1(c1), decode_fc2(c2))))
    return rows


def describe(cfg: DecodeConfig) -> str:
    return (
        f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.warps} s{cfg.stages}"
        f"{' swap' if cfg.swap else ''}{' tma' if cfg.tma else ''}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="64,256,512,1024", help="decode tokens per step, comma-separated")
    parser.add_argument("--layers", type=int, default=24, help="layers of weights cycled through")
    parser.add_argument("--reps", type=int, default=20, help="graph replays timed (sweep: half)")
    parser.add_argument("--check-only", action="store_true", help="errors only, default tiles")
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--budget-s", type=float, default=120.0, help="seconds for the tile sweep, all N")
    parser.add_argument("--tiny", action="store_true", help="toy widths (4 experts, 32 wide, 2 layers)")
    args = parser.parse_args(argv)
    with torch.no_grad():
        return run(args)


def run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference
    if args.tiny:
        # fp32 on the CPU (the interpreter's bf16 products are wrong); bf16 on a GPU, where the library's
        # float32 grouped GEMM reads its offsets on the host and cannot be captured in a graph
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        experts, width, count, tiles = 4, 32, 2, TINY_SWEEP
        args.tokens, args.reps = "3,16", min(args.reps, 2)
    else:
        experts, width, count, dtype, tiles = 32, 2880, args.layers, torch.bfloat16, SWEEP
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}", end="")
        import triton

        print(f", triton {triton.__version__}")
    if not args.tiny and device.type != "cuda":
        print("no CUDA device: run with --tiny (TRITON_INTERPRET=1) on the CPU")
        return 2
    tokens_list = [int(t) for t in args.tokens.split(",")]
    layers = Layers(1 if args.check_only else count, experts, width, width, dtype, device)
    cases = {}
    print(f"check (layer 0; tolerance {TOLERANCE}):")
    ok = True
    for tokens in tokens_list:
        bounds = routing(tokens, experts, device)
        g = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens * TOPK, width, generator=g, device=device).to(dtype)
        ok &= check(layers, x, bounds)
        cases[tokens] = (x, bounds)
    if not ok:
        print("FAILED: decode path errors above tolerance")
        return 1
    if args.check_only:
        return 0

    rate = copy_rate(device)
    if rate:
        print(f"copy rate: {rate / 1e12:.2f} TB/s (2 x 1 GiB / time of a device-to-device copy)")
    per_expert = (3 * width * width + 3 * width) * torch.empty((), dtype=dtype).element_size()
    rows_out = []
    for tokens, (x, bounds) in cases.items():
        hit = int((bounds[1:] > bounds[:-1]).sum())
        d1, d2 = (moe_decode.default_config(x.shape[0], experts, device, dtype, g) for g in (True, False))
        print(
            f"N = {tokens} tokens ({x.shape[0]} rows, {hit} experts hit); default tiles fc1 {describe(d1)}, "
            f"fc2 {describe(d2)}"
        )
        budget = 0.0 if args.no_sweep else args.budget_s / len(cases)
        timed = time_case(layers, x, bounds, tiles, args.reps, budget, device)
        rows_out.append((tokens, x.shape[0], hit * per_expert, hit, timed))

    print()
    print(f"per layer, {experts} experts, hidden = intermediate = {width}, {dtype}, {count} layers cycled")
    print("| tokens | rows | experts hit | path | fc1 (us) | fc2 (us) | layer (us) | GB/s | x copy rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens, rows, bytes_read, hit, timed in rows_out:
        for name, ms1, ms2, total in timed:
            bw = bytes_read / (total / 1e3)
            frac = f"{bw / rate:.2f}" if rate else "-"
            us = " | ".join(f"{ms * 1e3:.0f}" for ms in (ms1, ms2, total))
            print(f"| {tokens} | {rows} | {hit} | {name} | {us} | {bw / 1e9:.0f} | {frac} |")
        print(f"| {tokens} | | | library / decode best | | | {timed[0][3] / timed[-1][3]:.2f}x | | |")
    print(f"({time.perf_counter() - began:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
