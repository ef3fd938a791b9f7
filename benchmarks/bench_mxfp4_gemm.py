"""MXFP4 expert GEMMs (`ops.mxfp4_gemm`) against the dequantized bf16 path at gpt-oss-20b widths, one GPU.

    python benchmarks/bench_mxfp4_gemm.py                          # check, then the table (~1-2 minutes)
    python benchmarks/bench_mxfp4_gemm.py --tokens 64,256,4096 --paths auto,portable
    python benchmarks/bench_mxfp4_gemm.py --tokens 64,256 --sweep     # and the fastest of SWEEP's tiles
    python benchmarks/bench_mxfp4_gemm.py --tokens 64,256 --decodes bytes,groups,ptx --sweep portable/ptx
                                    # the portable kernel's decodings, and DECODE_SWEEP's tiles with PTX
    DISABLE_MMA_V3=1 python benchmarks/bench_mxfp4_gemm.py --paths portable   # Ampere/Ada instructions
    python benchmarks/bench_mxfp4_gemm.py --floor   # and the same loads and products without the decoding,
                                    # also over the bytes re-laid tile by tile (`mxfp4_relaid.kernel_weights`)
    python benchmarks/bench_mxfp4_gemm.py --tokens 64,256 --relaid --sweep pairs/ptx
                                    # the portable kernel over the weights re-laid (RELAID), and the
                                    # fastest of DECODE_SWEEP's tiles for one of them
    python benchmarks/bench_mxfp4_gemm.py --tokens 256,512 --relaid --full-tiles
                                    # and every program at its full row tile (no half-height tails)
    python benchmarks/bench_mxfp4_gemm.py --tiny                   # toy widths: CPU (TRITON_INTERPRET=1)

Shapes: 32 experts (`--experts`; gpt-oss-120b has 128), top-4 random routing of N tokens (N * 4 expert-sorted
rows), hidden = intermediate = 2880, bf16 rows, MXFP4 weights with every code and scales 2^-6 .. 2^-4, bf16
biases. One expert layer = fc1 + bias + clamped SwiGLU, then fc2 + bias:
    mxfp4 <path>   `fc1_swiglu_mxfp4`, then `grouped_linear_mxfp4` + `fused_moe.expert_bias`
    mxfp4 portable/<decode>  the same with the portable kernel's decoding `Mxfp4Config.decode` (`--decodes`)
    mxfp4 <relaid>/<decode>  the portable kernel over the weights re-laid (`--relaid`: RELAID's layouts by
                   `mxfp4_relaid.kernel_weights`, run by `forward_kernel_weights`; fc2's bias added in its
                   epilogue)
    mxfp4 <held>   the portable kernel over the weights as a model holds them in HELD's byte formats
                   (`--held`; `model.mxfp4_byte_format`): `fc1_swiglu_mxfp4`, then `fc2_bias_mxfp4` (the
                   engine's calls; `--pdl`: also launched with programmatic dependent launch)
    bf16 library   the same weights dequantized to bf16: `torch._grouped_mm` + `fused_moe.swiglu_bias`, then
                   `torch._grouped_mm` + `fused_moe.expert_bias` (the learner's path)
    bf16 decode    `moe_decode.decode_fc1` / `decode_fc2` on the dequantized weights (the engine's bf16 path;
                   at most 64 rows per expert)

Check (layer 0): each path's fc1 and fc2 against the dequantize-then-compute reference
(`mxfp4_gemm.reference_dequantized`), ||a - b|| / ||b|| <= 1e-2.

Timing: `--layers` layers of weights, a different layer per call (a layer's bf16 experts take 1.6 GB, its
MXFP4 ones 0.42 GB: both far beyond the 50 MB L2), one CUDA graph replaying the calls over all layers,
median of `--reps` replays / layers; a path that runs "dequantized" (the auto path above `PORTABLE_MAX_ROWS`
rows) is timed eagerly, as it runs: under a graph's capture the auto path runs the portable kernel.
Roofline = bytes / peak bandwidth: the weights (4.25 bits a value in MXFP4, 16 in bf16) and biases of the
experts hit (an expert without rows is not read), plus the activations (x read, h written and read, y
written, bf16). Peak: H100 SXM 3.35 TB/s, H200 4.8 TB/s by the device name, else the measured copy rate
(2 x bytes / time of a 1 GiB device-to-device copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import triton
import triton.language as tl
from bench_moe_decode import copy_rate, rel_err, time_per_layer

from megatron_gptoss.ops import fused_moe, moe_decode, mxfp4_bytes, mxfp4_gemm, mxfp4_relaid
from megatron_gptoss.ops.mxfp4_gemm import Mxfp4Config

LIMIT, ALPHA, TOPK = 7.0, 1.702, 4
TOLERANCE = 1e-2
PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # SXM / HBM3(e) spec bandwidth, by device name
DECODE_ROWS_PER_EXPERT = 64
FLOOR = "load floor (no decoding, values unchecked):"
# (row tile factor, block_n, block_k, warps, stages, swap) tried by --sweep: block_m =
# `moe_decode.row_tile(rows, experts, factor)` (factor 2 is `default_config`'s); swap (the weight on the left
# of tl.dot_scaled) only for the auto path's scaled kernel
SWEEP = [
    (2, 64, 128, 4, 3, 0), (2, 64, 128, 4, 3, 1), (2, 32, 128, 4, 3, 0), (2, 128, 128, 4, 3, 0),
    (2, 128, 128, 4, 3, 1), (2, 64, 256, 4, 3, 0), (2, 64, 64, 4, 4, 0), (2, 64, 128, 8, 3, 0),
    (2, 64, 128, 4, 2, 0), (2, 64, 128, 4, 5, 0), (1, 64, 128, 4, 3, 0), (2, 32, 256, 4, 4, 0),
]  # fmt: skip
# the same fields and `Mxfp4Config.sub_k`, tried by --sweep portable/<decode> for the block-vector decodings
# (sm_90, fc1 at 16 rows, PTX: 73 registers a thread at K step 64, 158 at 128, 106 at 256 in pieces of 64); an
# eighth field caps the registers a thread (`Mxfp4Config.maxnreg`). The later rows, by purpose:
DECODE_SWEEP = [
    (2, 64, 64, 4, 4, 0, 0), (2, 64, 128, 4, 4, 0, 64), (2, 64, 256, 4, 3, 0, 64), (2, 64, 256, 4, 3, 0, 128),
    (2, 128, 128, 8, 4, 0, 64), (2, 64, 128, 4, 3, 0, 0), (2, 64, 128, 8, 3, 0, 0), (2, 32, 128, 4, 4, 0, 64),
    (2, 64, 256, 8, 3, 0, 64), (1, 64, 128, 4, 4, 0, 64),
    # 64-row tiles of the pairs bytes (`benchmarks/sass_mxfp4.py --block-m 64`): fc1 at K step 64 holds 167
    # registers, 3 programs an SM against 2 at 128; fc2 with 2 stages 128 registers, 4 an SM
    (2, 64, 64, 4, 3, 0, 0), (2, 64, 128, 4, 2, 0, 0),
    # the same capped: 4 and 5 programs an SM (fc1 spills 128 / 160 bytes a thread)
    (2, 64, 64, 4, 3, 0, 0, 128), (2, 64, 64, 4, 4, 0, 0, 128), (2, 64, 64, 4, 3, 0, 0, 96),
    # 128 weight rows a program over two warpgroups (each decodes its own 64 rows), so each K step's tile of
    # x, loaded once for them all, serves twice the columns: at 2,048 rows x's tiles (re-read by every column
    # block: 531 MB a layer from L2 at 64 columns) outweigh the weight bytes (141 MB for fc2) 4 to 1
    (2, 128, 64, 8, 3, 0, 0), (2, 128, 64, 8, 4, 0, 0),
    # the 64 x 64 tiles a model's "tiled_pairs" holds with more of its K steps in flight (5 and 6 stages: at
    # 16-row tiles about 6.3 KB a stage, so 3 programs an SM still fit), or on two warps (mma.sync, no
    # warpgroup)
    (2, 64, 64, 4, 5, 0, 0), (2, 64, 64, 4, 6, 0, 0), (2, 64, 64, 2, 4, 0, 0),
]  # fmt: skip
# the weights re-laid for the forward kernel (`mxfp4_relaid.kernel_weights`): (tiled, byte format) by name
RELAID = {
    "tiled": (True, "checkpoint"), "shuffled": (False, "shuffled"), "tiled+shuffled": (True, "shuffled"),
    "pairs": (False, "pairs"), "tiled+pairs": (True, "pairs"),
}  # fmt: skip
# the byte formats a model holds besides the checkpoint's (`mxfp4_bytes.HELD_FORMATS`), timed by --held
HELD = ("pairs", "tiled_pairs")


class Layers:
    """`count` layers of MXFP4 expert weights with their bf16 dequantization and bf16 biases."""

    def __init__(self, count: int, experts: int, hidden: int, inter: int, dtype, device):
        g = torch.Generator(device=device).manual_seed(0)

        def mxfp4(out: int, width: int):
            blocks = torch.randint(0, 256, (experts, out, width // 32, 16), generator=g, device=device)
            scales = torch.randint(121, 124, (experts, out, width // 32), generator=g, device=device)
            return blocks.to(torch.uint8), scales.to(torch.uint8)

        self.fc1 = [mxfp4(2 * inter, hidden) for _ in range(count)]
        self.fc2 = [mxfp4(hidden, inter) for _ in range(count)]
        self.w1 = [mxfp4_gemm.dequantize(b, s, dtype) for b, s in self.fc1]
        self.w2 = [mxfp4_gemm.dequantize(b, s, dtype) for b, s in self.fc2]
        self.b1 = [
            torch.randn(experts, 2 * inter, generator=g, device=device).to(dtype) for _ in range(count)
        ]
        self.b2 = [torch.randn(experts, hidden, generator=g, device=device).to(dtype) for _ in range(count)]
        self.count, self.experts, self.hidden, self.inter = count, experts, hidden, inter


def mxfp4_layer(
    path: str, cfg1: Mxfp4Config | None = None, cfg2: Mxfp4Config | None = None, decode: str = "bytes"
):
    """(fc1, fc2) of the MXFP4 path (tiles: `default_config` with `decode`, or cfg1 / cfg2): each (x, layers,
    i, bounds) -> rows."""

    def tiles(cfg: Mxfp4Config | None, rows, layers: Layers, gated: bool) -> Mxfp4Config | None:
        if cfg is not None or decode == "bytes":
            return cfg
        default = mxfp4_gemm.default_config(rows.shape[0], layers.experts, rows.device, gated)
        return dataclasses.replace(default, decode=decode)

    def fc1(x, layers: Layers, i: int, bounds):
        blocks, scales = layers.fc1[i]
        cfg = tiles(cfg1, x, layers, True)
        return mxfp4_gemm.fc1_swiglu_mxfp4(x, blocks, scales, layers.b1[i], bounds, LIMIT, ALPHA, path, cfg)

    def fc2(h, layers: Layers, i: int, bounds):
        blocks, scales = layers.fc2[i]
        y = mxfp4_gemm.grouped_linear_mxfp4(h, blocks, scales, bounds, path, tiles(cfg2, h, layers, False))
        return fused_moe.expert_bias(y, layers.b2[i], bounds)

    return fc1, fc2


def held_layer(
    byte_format: str, cfg1: Mxfp4Config | None = None, cfg2: Mxfp4Config | None = None, pdl: bool = False
):  # fmt: skip
    """(fc1, fc2) of the portable kernel over each layer's weights held in `byte_format` (HELD; encoded once
    per benchmark): `fc1_swiglu_mxfp4` and `fc2_bias_mxfp4`, the engine's calls, at cfg1 / cfg2's tiles,
    else `default_config`'s for that format (`pdl`: launched with programmatic dependent launch,
    `Mxfp4Config.pdl`)."""
    cache: dict[tuple[int, bool], tuple] = {}

    def tiles(cfg: Mxfp4Config | None, rows, layers: Layers, gated: bool) -> Mxfp4Config | None:
        if cfg is None and pdl:
            cfg = mxfp4_gemm.default_config(rows.shape[0], layers.experts, rows.device, gated, byte_format)
        return cfg if cfg is None else dataclasses.replace(cfg, pdl=pdl or cfg.pdl)

    def held(blocks, scales, i: int, gated: bool):
        if (i, gated) not in cache:
            cache[i, gated] = (
                mxfp4_bytes.held_blocks(blocks, byte_format),
                mxfp4_bytes.held_scales(scales, byte_format),
            )
        return cache[i, gated]

    def fc1(x, layers: Layers, i: int, bounds):
        blocks, scales = held(*layers.fc1[i], i, True)
        return mxfp4_gemm.fc1_swiglu_mxfp4(x, blocks, scales, layers.b1[i], bounds, LIMIT, ALPHA, "portable",
                                           tiles(cfg1, x, layers, True), byte_format=byte_format)  # fmt: skip

    def fc2(h, layers: Layers, i: int, bounds):
        blocks, scales = held(*layers.fc2[i], i, False)
        cfg = tiles(cfg2, h, layers, False)
        return mxfp4_gemm.fc2_bias_mxfp4(h, blocks, scales, layers.b2[i], bounds, "portable", cfg,
                                         byte_format=byte_format)  # fmt: skip

    return fc1, fc2


def layer_of(path: str, cfg1: Mxfp4Config, cfg2: Mxfp4Config):
    """(fc1, fc2) of a swept path at these tiles: a RELAID layout, a HELD format or an MXFP4 path."""
    if path in RELAID:
        return relaid_layer(path, cfg1, cfg2)
    return held_layer(path, cfg1, cfg2) if path in HELD else mxfp4_layer(path, cfg1, cfg2)


def sweep(path: str, layers: Layers, x, bounds, reps: int, device, decode: str = "bytes"):
    """(best fc1 config, best fc2 config) of `path` over SWEEP (DECODE_SWEEP with the portable kernel's
    `decode` other than "bytes") at these rows: each config checked, then fc1 and fc2 timed alone; the three
    fastest of each printed. A config that does not compile or run is skipped."""
    found: dict[str, list[tuple[float, Mxfp4Config]]] = {"fc1": [], "fc2": []}
    h = mxfp4_layer("portable" if path in RELAID or path in HELD else path)[0](x, layers, 0, bounds)
    for factor, block_n, block_k, warps, stages, swap, *rest in SWEEP if decode == "bytes" else DECODE_SWEEP:
        sub_k, maxnreg = (*rest, 0, 0)[:2]
        if swap and (path in RELAID or path in HELD or mxfp4_gemm.kernel_for(x, path) != "scaled"):
            continue
        block_m = moe_decode.row_tile(x.shape[0], layers.experts, factor)
        cfg = Mxfp4Config(
            block_m, block_n, block_k, warps, stages, bool(swap), decode=decode, sub_k=sub_k, maxnreg=maxnreg
        )
        fc1, fc2 = layer_of(path, cfg, cfg)
        try:
            if not check(f"{path} {describe(cfg)}", fc1, fc2, layers, x, bounds, verbose=False):
                print(f"    {path} {describe(cfg)}: wrong results, skipped")
                continue
            for name, fn, rows_in in (("fc1", fc1, x), ("fc2", fc2, h)):

                def call(i: int, f=fn, r=rows_in):
                    return f(r, layers, i, bounds)

                found[name].append((time_per_layer(call, layers.count, reps, device), cfg))
        except Exception as exc:  # noqa: BLE001 - a config beyond the device's resources is skipped
            first = str(exc).splitlines()[0][:90] if str(exc) else ""
            print(f"    {path} {describe(cfg)}: {type(exc).__name__}: {first}")
    best = []
    for name, results in found.items():
        results.sort(key=lambda r: r[0])
        print(
            f"  {x.shape[0]} rows, {path} {name} fastest: "
            + ", ".join(f"{ms * 1e3:.0f} us {describe(c)}" for ms, c in results[:3])
        )
        best.append(results[0][1] if results else None)
    return best[0], best[1]


def describe(cfg: Mxfp4Config) -> str:
    swap = " swap" if cfg.swap else ""
    decode = "" if cfg.decode == "bytes" else f" {cfg.decode}"
    sub_k = f"/{cfg.sub_k}" if cfg.sub_k else ""
    regs = f" r{cfg.maxnreg}" if cfg.maxnreg else ""
    tiles = f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k}{sub_k}"
    return f"{tiles} w{cfg.warps} s{cfg.stages}{regs}{swap}{decode}"


def library_gemm(x, layers: Layers, i: int, bounds, second: bool):
    """Layer i's fc1 (fc2 with `second`) product on its bf16 weights: the library's grouped GEMM on CUDA,
    the dequantize-then-compute reference elsewhere."""
    if x.is_cuda:
        weight = layers.w2[i] if second else layers.w1[i]
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=bounds[1:])
    blocks, scales = layers.fc2[i] if second else layers.fc1[i]
    return mxfp4_gemm.reference_dequantized(x, blocks, scales, bounds)


def library_fc1(x, layers: Layers, i: int, bounds):
    gemm = library_gemm(x, layers, i, bounds, False)
    return fused_moe.swiglu_bias(gemm, layers.b1[i], bounds, LIMIT, ALPHA)


def library_fc2(h, layers: Layers, i: int, bounds):
    return fused_moe.expert_bias(library_gemm(h, layers, i, bounds, True), layers.b2[i], bounds)


def decode_fc1(x, layers: Layers, i: int, bounds):
    return moe_decode.decode_fc1(x, layers.w1[i], layers.b1[i], bounds, LIMIT, ALPHA)


def decode_fc2(h, layers: Layers, i: int, bounds):
    return moe_decode.decode_fc2(h, layers.w2[i], layers.b2[i], bounds)


@triton.jit
def _load_floor_kernel(
    X, Wb, Ws, Out, bounds, N, K, NB, KT, stride_x, stride_wbe, stride_wbn, stride_wse, stride_wsn,
    stride_out, GATED: tl.constexpr, TILED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The forward kernel's grid, loads and matrix products without the decoding (a timing floor; the values
    mean nothing): each weight byte converted to x's dtype as an integer and multiplied by x's first K / 2
    columns, the scale bytes summed into the products. TILED: the weights in `mxfp4_relaid.kernel_weights`'s
    tile-contiguous layout (NB column blocks, KT K steps; the strides unused), where the [BLOCK_N,
    BLOCK_K / 2] bytes and [BLOCK_N, BLOCK_K / 32] scales one program reads at one K step are each one
    contiguous run, not BLOCK_N runs of BLOCK_K / 2 bytes a row apart."""
    e = tl.program_id(1)
    start = tl.load(bounds + e)
    end = tl.load(bounds + e + 1)
    if start >= end:
        return
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    HALVES: tl.constexpr = 2 if GATED else 1
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wb = Wb + e.to(tl.int64) * stride_wbe
    ws = Ws + e.to(tl.int64) * stride_wse
    in_bytes = tl.arange(0, BLOCK_N)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    in_scales = tl.arange(0, BLOCK_N)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    for r0 in range(start, end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + tl.arange(0, HALF)
            kg = k0 // 32 + tl.arange(0, GROUPS)
            kx = k0 + tl.arange(0, HALF)
            x_ok = (kx < K) if TILED else (kb < K // 2)
            x = tl.load(X + rows[:, None] * stride_x + kx[None, :], mask=row_ok[:, None] & x_ok[None, :],
                        other=0.0)  # fmt: skip
            for half in tl.static_range(HALVES):
                if TILED:
                    tile = ((e.to(tl.int64) * HALVES + half) * NB + tl.program_id(0)) * KT + k0 // BLOCK_K
                    b = tl.load(Wb + tile * (BLOCK_N * HALF) + in_bytes, eviction_policy="evict_first")
                    sc = tl.load(Ws + tile * (BLOCK_N * GROUPS) + in_scales, eviction_policy="evict_first")
                else:
                    w_rows = (cols + half * N)[:, None]
                    b_ok = col_ok[:, None] & (kb < K // 2)[None, :]
                    s_ok = col_ok[:, None] & (kg < K // 32)[None, :]
                    b = tl.load(wb + w_rows * stride_wbn + kb[None, :], mask=b_ok, other=0,
                                eviction_policy="evict_first")  # fmt: skip
                    sc = tl.load(ws + w_rows * stride_wsn + kg[None, :], mask=s_ok, other=0,
                                 eviction_policy="evict_first")  # fmt: skip
                acc = tl.dot(b.to(x.dtype), tl.trans(x), acc)
                acc += tl.sum(sc.to(tl.float32), axis=1)[:, None]
        out_ptrs = Out + rows[None, :] * stride_out + cols[:, None]
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])


def tiles_of(cache: dict, blocks, scales, gated: bool, i: int, block_n: int, block_k: int, tiled: bool = True,
             byte_format: str = "checkpoint"):  # fmt: skip
    """Layer i's fc1 (`gated`) or fc2 weights re-laid by `mxfp4_relaid.kernel_weights` for (block_n, block_k)
    tiles, once per benchmark (kept in `cache`)."""
    key = (i, gated, block_n, block_k, tiled, byte_format)
    if key not in cache:
        cache[key] = mxfp4_relaid.kernel_weights(blocks, scales, gated, block_n, block_k, tiled, byte_format)
    return cache[key]


def relaid_layer(
    layout: str, cfg1: Mxfp4Config | None = None, cfg2: Mxfp4Config | None = None, decode: str = "ptx",
    half_tail: bool | None = None,
):  # fmt: skip
    """(fc1, fc2) of the portable kernel over the weights re-laid as RELAID[layout] (`mxfp4_gemm.
    forward_kernel_weights`; the tiles of cfg1 / cfg2, else `default_config`'s with `decode`, and
    `half_tail` where given): the time were the experts stored that way."""
    tiled, byte_format = RELAID[layout]
    cache: dict[tuple, mxfp4_relaid.KernelWeights] = {}

    def run(x, blocks, scales, bias, bounds, gated: bool, i: int, cfg: Mxfp4Config | None):
        if cfg is None:
            held = mxfp4_relaid.held_like(byte_format)
            cfg = mxfp4_gemm.default_config(x.shape[0], blocks.shape[0], x.device, gated, held)
            cfg = dataclasses.replace(cfg, decode=decode)
            cfg = cfg if half_tail is None else dataclasses.replace(cfg, half_tail=half_tail)
        weights = tiles_of(cache, blocks, scales, gated, i, cfg.block_n, cfg.block_k, tiled, byte_format)
        return mxfp4_relaid.forward_kernel_weights(x, weights, bias, bounds, LIMIT, ALPHA, cfg)

    def fc1(x, layers: Layers, i: int, bounds):
        return run(x, *layers.fc1[i], layers.b1[i], bounds, True, i, cfg1)

    def fc2(h, layers: Layers, i: int, bounds):
        return run(h, *layers.fc2[i], layers.b2[i], bounds, False, i, cfg2)

    return fc1, fc2


def floor_layer(block_k: int | None = None, tiled: bool = False):
    """(fc1, fc2) of `_load_floor_kernel` at `default_config`'s tiles (with `block_k`): the time to stream
    the MXFP4 bytes with the kernels' grid and tiles when decoding costs nothing; `tiled`: over every
    layer's weights re-laid in tiles once (`mxfp4_relaid.kernel_weights`: the time were they stored tile by
    tile)."""
    cache: dict[tuple, mxfp4_relaid.KernelWeights] = {}

    def launch(x, blocks, scales, bounds, gated: bool, i: int):
        e, rows_w = blocks.shape[:2]
        n = rows_w // 2 if gated else rows_w
        cfg = mxfp4_gemm.default_config(x.shape[0], e, x.device, gated)
        if block_k is not None and x.is_cuda:
            cfg = dataclasses.replace(cfg, block_k=block_k)
        nb, kt = triton.cdiv(n, cfg.block_n), 0
        if tiled:
            weights = tiles_of(cache, blocks, scales, gated, i, cfg.block_n, cfg.block_k)
            blocks, scales, nb, kt = weights.blocks, weights.scales, *weights.blocks.shape[2:4]
        out = x.new_empty(x.shape[0], n)
        _load_floor_kernel[(nb, e)](
            x, blocks, scales, out, bounds, n, x.shape[1], nb, kt, x.stride(0), blocks.stride(0),
            blocks.stride(1), scales.stride(0), scales.stride(1), out.stride(0), GATED=gated, TILED=tiled,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps,
            num_stages=cfg.stages,
        )  # fmt: skip
        return out

    def fc1(x, layers: Layers, i: int, bounds):
        return launch(x, *layers.fc1[i], bounds, True, i)

    def fc2(h, layers: Layers, i: int, bounds):
        return launch(h, *layers.fc2[i], bounds, False, i)

    return fc1, fc2


def check(name: str, fc1, fc2, layers: Layers, x, bounds, verbose: bool = True) -> bool:
    (b1, s1), (b2, s2) = layers.fc1[0], layers.fc2[0]
    h_ref = mxfp4_gemm.reference_dequantized(x, b1, s1, bounds, layers.b1[0], (LIMIT, ALPHA))
    h = fc1(x, layers, 0, bounds)
    y_ref = mxfp4_gemm.reference_dequantized(h, b2, s2, bounds, layers.b2[0])
    e1, e2 = rel_err(h, h_ref), rel_err(fc2(h, layers, 0, bounds), y_ref)
    ok = e1 <= TOLERANCE and e2 <= TOLERANCE
    if verbose:
        print(f"  {x.shape[0]:6d} rows {name:16s} fc1 {e1:.2e}  fc2 {e2:.2e}  {'ok' if ok else 'FAILED'}")
    return ok


def peak_bandwidth(device) -> tuple[float | None, str]:
    """(bytes / s, where it comes from): the device name's spec (SXM parts), else the measured copy rate."""
    if device.type != "cuda":
        return None, "no GPU"
    name = torch.cuda.get_device_name(device)
    copy = copy_rate(device)
    assert copy is not None
    print(f"copy rate: {copy / 1e12:.2f} TB/s (2 x 1 GiB / time of a device-to-device copy)")
    for key, peak in PEAK_BYTES_PER_S.items():
        if key in name and "PCIe" not in name:
            return peak, f"{key} spec {peak / 1e12:.2f} TB/s"
    return copy, f"measured copy rate {copy / 1e12:.2f} TB/s"


def roofline_bytes(layers: Layers, bounds, rows: int, bits: float) -> tuple[float, float]:
    """(fc1 bytes, fc2 bytes): weights of the experts hit at `bits` a value, their bf16 biases, and the
    bf16 activations (fc1: x read, h written; fc2: h read, y written)."""
    hit = int((bounds[1:] > bounds[:-1]).sum())
    h, i = layers.hidden, layers.inter
    fc1 = hit * (2 * i * h * bits / 8 + 2 * i * 2) + rows * (h + i) * 2
    fc2 = hit * (h * i * bits / 8 + h * 2) + rows * (i + h) * 2
    return fc1, fc2


def size_arguments(doc: str | None, tokens: str, reps: int, reps_help: str) -> argparse.ArgumentParser:
    """A parser with the arguments `sizes` reads: --tokens, --layers, --reps, --experts and --tiny."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=tokens, help="tokens per call, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="layers of weights cycled through")
    parser.add_argument("--reps", type=int, default=reps, help=reps_help)
    parser.add_argument("--experts", type=int, default=32, help="experts a layer (gpt-oss-120b: 128)")
    parser.add_argument("--tiny", action="store_true", help="toy widths (4 experts, 64 wide, 1 layer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = size_arguments(__doc__, "64,256,4096", 20, "graph replays timed")
    parser.add_argument("--paths", default="auto,portable", help="MXFP4 paths timed, comma-separated")
    decodes = ",".join(mxfp4_gemm.DECODES)
    parser.add_argument("--decodes", default="bytes", help=f"portable decodings timed ({decodes})")
    parser.add_argument("--sweep", nargs="?", const="", default=None,
                        help="also time the SWEEP tiles of each MXFP4 path; with a value, of these comma-"
                        "separated paths, portable/<decode>, <RELAID name>/<decode> or <HELD format>/ptx "
                        "(DECODE_SWEEP's "
                        "tiles)")  # fmt: skip
    parser.add_argument("--floor", action="store_true", help="also time the loads without decoding")
    parser.add_argument("--relaid", action="store_true",
                        help="also time the portable kernel over the weights re-laid (RELAID)")  # fmt: skip
    parser.add_argument(
        "--held",
        action="store_true",
        help="also time the portable kernel over the weights as a model holds them (HELD)",
    )
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="with --held: also time them launched with programmatic dependent launch",
    )
    parser.add_argument("--full-tiles", action="store_true",
                        help="with --relaid: also time every program at its full row tile (no half-height "
                        "tail tiles, `Mxfp4Config.half_tail`)")  # fmt: skip
    args = parser.parse_args(argv)
    with torch.no_grad():
        return run(args)


@dataclasses.dataclass
class Sizes:
    """What a run times: the device, the rows' dtype, experts and width of a layer, layers cycled, timed
    repetitions and the token counts."""

    device: torch.device
    dtype: torch.dtype
    experts: int
    width: int
    count: int
    reps: int
    tokens: list[int]


def sizes(args: argparse.Namespace) -> Sizes | None:
    """The run's `Sizes` from `--tiny` (toy widths, fp32 on the CPU: the interpreter's bf16 products are
    not modelled) or `--experts`, `--layers`, `--reps` and `--tokens` at gpt-oss-20b width on a GPU; None
    (said why) without a GPU or `--tiny`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return Sizes(device, dtype, 4, 64, 1, 1, [3, 16])
    if device.type != "cuda":
        print("no CUDA device: run with --tiny (TRITON_INTERPRET=1) on the CPU")
        return None
    tokens = [int(t) for t in args.tokens.split(",")]
    return Sizes(device, torch.bfloat16, args.experts, 2880, args.layers, args.reps, tokens)


def routed_rows(tokens: int, sz: Sizes, columns: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(bounds, [x, ...]): `tokens` tokens routed top-4 at random (seeded by the count), then `columns`
    random tensors of their rows [tokens x 4, width] sorted by expert."""
    g = torch.Generator().manual_seed(tokens)
    indices = torch.rand(tokens, sz.experts, generator=g).topk(TOPK, dim=-1).indices.to(sz.device)
    bounds = fused_moe.sort_by_expert(indices, sz.experts)[1]
    made = [torch.randn(tokens * TOPK, sz.width, generator=g).to(sz.device, sz.dtype) for _ in range(columns)]
    return bounds, made


def run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    sz = sizes(args)
    if sz is None:
        return 2
    device, dtype, experts, width, count, reps = sz.device, sz.dtype, sz.experts, sz.width, sz.count, sz.reps
    tokens_list = sz.tokens
    if device.type == "cuda":
        import triton

        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton "
              f"{triton.__version__}")  # fmt: skip
    layers = Layers(count, experts, width, width, dtype, device)
    peak, source = peak_bandwidth(device)
    paths = [p for p in args.paths.split(",") if p]
    decodes = [d for d in args.decodes.split(",") if d]
    for decode in decodes:
        if decode not in mxfp4_gemm.DECODES:
            raise SystemExit(f"--decodes: {decode!r} is not one of {mxfp4_gemm.DECODES}")
    swept = paths if args.sweep == "" else [p for p in (args.sweep or "").split(",") if p]
    table, ok = [], True
    print(f"check (layer 0, tolerance {TOLERANCE}):")
    for tokens in tokens_list:
        bounds, (x,) = routed_rows(tokens, sz)
        rows = x.shape[0]
        candidates = [(f"mxfp4 {p}", *mxfp4_layer(p), 4.25) for p in paths]
        candidates += [
            (f"mxfp4 portable/{d}", *mxfp4_layer("portable", decode=d), 4.25) for d in decodes if d != "bytes"
        ]
        if device.type == "cuda":
            for item in swept:
                p, _, decode = item.partition("/")
                cfg1, cfg2 = sweep(p, layers, x, bounds, max(reps // 2, 1), device, decode or "bytes")
                if cfg1 is not None and cfg2 is not None:
                    layer = layer_of(p, cfg1, cfg2)
                    candidates.append((f"mxfp4 {p} best: {describe(cfg1)} / {describe(cfg2)}", *layer, 4.25))
        if args.relaid:
            decode = "ptx" if device.type == "cuda" else "groups"
            candidates += [(f"mxfp4 {r}/{decode}", *relaid_layer(r, decode=decode), 4.25) for r in RELAID]
            if args.full_tiles:
                candidates += [
                    (
                        f"mxfp4 {r}/{decode} full-height tiles",
                        *relaid_layer(r, decode=decode, half_tail=False),
                        4.25,
                    )
                    for r in RELAID
                ]
        if args.held:
            candidates += [(f"mxfp4 {f}", *held_layer(f), 4.25) for f in HELD]
            if args.pdl:
                candidates += [(f"mxfp4 {f} pdl", *held_layer(f, pdl=True), 4.25) for f in HELD]
        if args.floor:
            candidates += [(f"{FLOOR} k{k}", *floor_layer(k), 4.25) for k in (64, 128, 256)]
            ks = (64, 128, 256) if device.type == "cuda" else (32,)
            candidates += [(f"{FLOOR} tiled k{k}", *floor_layer(k, tiled=True), 4.25) for k in ks]
        candidates.append(("bf16 library", library_fc1, library_fc2, 16.0))
        if rows <= DECODE_ROWS_PER_EXPERT * experts and device.type == "cuda":
            candidates.append(("bf16 decode", decode_fc1, decode_fc2, 16.0))
        for name, fc1, fc2, bits in candidates:
            try:
                ok &= name.startswith(FLOOR) or check(name, fc1, fc2, layers, x, bounds)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile fails alone
                print(f"  {rows:6d} rows {name}: {type(exc).__name__}: {str(exc)[:300]}  FAILED")
                ok = False
                continue
            graph = True
            if name.startswith("mxfp4"):  # the kernel that ran (the auto path may have fallen back)
                path = name.split()[1].split("/")[0].rstrip(":")
                portable = path in RELAID or path in HELD
                kernel = mxfp4_gemm.kernel_for(x, "portable" if portable else path)
                # the dequantized path runs eagerly (under a graph's capture "auto" runs the portable kernel)
                graph = kernel != "dequantized"
                name = f"{name} ({kernel}{'' if graph else ', eager'})"
            h = fc1(x, layers, 0, bounds)

            def one(f, rows_in, b=bounds):
                return lambda i: f(rows_in, layers, i, b)

            def both(f1, f2, rows_in=x, b=bounds):
                return lambda i: f2(f1(rows_in, layers, i, b), layers, i, b)

            ms1 = time_per_layer(one(fc1, x), count, reps, device, graph)
            ms2 = time_per_layer(one(fc2, h), count, reps, device, graph)
            ms = time_per_layer(both(fc1, fc2), count, reps, device, graph)
            table.append((tokens, rows, name, ms1, ms2, ms, roofline_bytes(layers, bounds, rows, bits)))
            print(f"  {rows:6d} rows {name}: fc1 {ms1 * 1e3:.0f} us, fc2 {ms2 * 1e3:.0f} us, layer "
                  f"{ms * 1e3:.0f} us", flush=True)  # fmt: skip
    print(f"\nper layer: {experts} experts, hidden = intermediate = {width}, top-{TOPK}, {dtype}, {count} "
          f"layers cycled; roofline at {source}")  # fmt: skip
    print("| tokens | rows | path | fc1 (us) | fc2 (us) | layer (us) | roofline (us) | layer / roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens, rows, name, ms1, ms2, ms, (bytes1, bytes2) in table:
        floor = (bytes1 + bytes2) / peak * 1e6 if peak else None
        ratio = f"{ms * 1e3 / floor:.2f}x" if floor else "-"
        floor_text = f"{floor:.0f}" if floor else "-"
        print(f"| {tokens} | {rows} | {name} | {ms1 * 1e3:.0f} | {ms2 * 1e3:.0f} | {ms * 1e3:.0f} | "
              f"{floor_text} | {ratio} |")  # fmt: skip
    for (device_name, cfg, gated), why in mxfp4_gemm.scaled_failures().items():
        print(
            f"tl.dot_scaled failed ({device_name}, {describe(cfg)}, gated {gated}), portable ran: {why[:200]}"
        )
    print(f"({time.perf_counter() - began:.0f} s in all){'' if ok else '  CHECK FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
