"""The MXFP4 forward kernel's K loop as the GPU would run it, counted without a GPU: each byte layout of the
weights (`mxfp4_relaid.kernel_weights`) compiled for sm_90 by the installed Triton (its bundled ptxas), the
SASS of the innermost loop (one K step of one program) counted by instruction, with the registers a thread
holds. A static view of the decoding's cost, to weigh a layout before a GPU times it (`bench_mxfp4_gemm.py
--relaid`), and to catch a change that brings back per-byte shared-memory reads.

    python benchmarks/sass_mxfp4.py                        # fc1 and fc2 at gpt-oss-20b width, 16 rows
    python benchmarks/sass_mxfp4.py --block-m 64 --sub-k 64 --formats checkpoint,pairs

Arguments as a launch at gpt-oss-20b width would pass them (32 experts, hidden = intermediate = 2880, bf16
rows), with Triton's specialization of integers divisible by 16 and 16-byte aligned pointers. Columns:
registers a thread, bytes a thread spilled to local memory, shared memory a program, programs that fit an
SM at once (its registers, shared memory and warps: how many warps hide each other's latency), instructions
in the loop, the loop's shared-memory reads of the weight bytes (`LDS.U8` one byte, `LDSM` a matrix-unit
fragment), byte permutes (`PRMT`), the decoding's bf16x2 arithmetic, the matrix unit's instructions
(`HGMMA`) and the block's barriers (`BAR.SYNC`: each one holds every warp of the program until the slowest
arrives, so a K step's barriers chain its warps' latencies).

    python benchmarks/sass_mxfp4.py --formats pairs --block-m 64 --block-k 64 --stages 4   # 256 slots' tiles
    python benchmarks/sass_mxfp4.py --formats pairs --block-m 64 --block-k 64 --maxnreg 128  # 4 an SM
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_gptoss.ops import mxfp4_bytes, mxfp4_gemm, mxfp4_kernels, mxfp4_relaid

EXPERTS, WIDTH = 32, 2880
TARGET = GPUTarget("cuda", 90, 32)
COUNTED = ("LDS.U8", "LDSM", "PRMT", "HFMA2", "HMUL2", "HGMMA", "BAR.SYNC")


# An SM of sm_90 (H100, H200): registers, shared memory a program may be given, warps
SM_REGISTERS, SM_SHARED, SM_WARPS = 65536, 228 * 1024, 64


@dataclasses.dataclass
class LoopCount:
    """One compiled kernel's innermost loop: instructions by opcode (with modifiers, e.g. LDS.U8), with the
    kernel's registers a thread and spilled bytes a thread (its stack)."""

    registers: int
    instructions: int
    ops: collections.Counter
    stack: int = 0

    def count(self, name: str) -> int:
        """Instructions whose opcode is `name` or starts with `name.` (LDSM counts LDSM.16.M88.4)."""
        return sum(n for op, n in self.ops.items() if op == name or op.startswith(name + "."))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def tools_present() -> bool:
    """Whether the installed Triton carries the CUDA tools this needs (ptxas, cuobjdump, nvdisasm)."""
    return all(os.access(_tool(t), os.X_OK) for t in ("ptxas", "cuobjdump", "nvdisasm"))


def _arguments(gated: bool, tiled: bool, cfg: mxfp4_gemm.Mxfp4Config) -> dict[str, int]:
    """The forward kernel's integer arguments at gpt-oss-20b width (meta tensors: nothing allocated)."""
    rows = 2 * WIDTH if gated else WIDTH
    blocks = torch.empty(EXPERTS, rows, WIDTH // 32, 16, dtype=torch.uint8, device="meta")
    scales = torch.empty(EXPERTS, rows, WIDTH // 32, dtype=torch.uint8, device="meta")
    if tiled:
        halves, nb, kt = (2 if gated else 1), triton.cdiv(WIDTH, cfg.block_n), triton.cdiv(WIDTH, cfg.block_k)
        shape = (EXPERTS, halves, nb, kt, cfg.block_n)
        blocks = torch.empty(*shape, cfg.block_k // 2, dtype=torch.uint8, device="meta")
        scales = torch.empty(*shape, cfg.block_k // 32, dtype=torch.uint8, device="meta")
        weights = mxfp4_relaid.KernelWeights(
            blocks, scales, WIDTH, WIDTH, gated, cfg.block_n, cfg.block_k, True, "checkpoint"
        )
        layout = weights.layout
    else:
        layout = mxfp4_gemm._row_major_layout(blocks, scales, WIDTH, cfg)
    names = ("wb_half", "wb_col", "wb_step", "wb_row", "ws_half", "ws_col", "ws_step", "ws_row")
    out = (2 if gated else 1) * WIDTH
    return {
        "N": WIDTH, "K": WIDTH, "stride_x": WIDTH, "stride_wbe": blocks.stride(0),
        "stride_wse": scales.stride(0), "stride_be": out, "stride_add": out, "stride_out": WIDTH,
        **dict(zip(names, layout)),
    }  # fmt: skip


def compile_forward(
    gated: bool, tiled: bool, byte_format: str, cfg: mxfp4_gemm.Mxfp4Config, target: GPUTarget = TARGET,
    prefetch: bool | None = None,
):  # fmt: skip
    """The forward kernel (ptx decoding, bias, no addend) compiled for `target` (sm_90) as a launch would
    (`prefetch`: the scale bytes loaded a step ahead or not; None: as `mxfp4_gemm.prefetch_scales`)."""
    prefetch = mxfp4_gemm.prefetch_scales() if prefetch is None else prefetch
    pointers = {"X": "*bf16", "Wb": "*u8", "Ws": "*u8", "Bias": "*bf16", "Add": "*bf16", "Out": "*bf16",
                "bounds": "*i32"}  # fmt: skip
    constants = {
        "GATED": gated, "HAS_BIAS": True, "HAS_ADD": False, "SCALED": False, "SWAP": False,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "DOT_PRECISION": "tf32",
        "X_FORMAT": "bf16", "DECODE": mxfp4_gemm.DECODES.index("ptx"), "SUB_K": cfg.sub_k or cfg.block_k,
        "BYTE_FORMAT": mxfp4_gemm.BYTE_FORMATS.index(byte_format), "PREFETCH_SCALES": prefetch,
        "HALF_TAIL": mxfp4_gemm.half_tail(cfg, "portable"),
        "SUB_ROWS": mxfp4_bytes.TILE_ROWS if tiled else 0,
        "PDL": cfg.pdl,
    }  # fmt: skip
    integers = _arguments(gated, tiled, cfg)
    names = list(inspect.signature(mxfp4_kernels.mxfp4_fwd_kernel.fn).parameters)
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in constants:
            signature[name] = "constexpr"
        elif name in ("limit", "alpha"):
            signature[name] = "fp32"
        else:
            value = integers[name]
            signature[name] = "i64" if name in ("stride_wbe", "stride_wse") else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    source = ASTSource(
        fn=mxfp4_kernels.mxfp4_fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    options = {"num_warps": cfg.warps, "num_stages": cfg.stages, **mxfp4_gemm._registers(cfg)}
    return triton.compile(source, target=target, options=options)


def _compile(fn, types: dict[str, str], constants: dict, aligned: tuple[str, ...], target: GPUTarget):
    """`fn` compiled for `target` with these argument types, constants and 16-divisible arguments."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options={"num_warps": 4, "num_stages": 2})


def compile_others(byte_format: str, capability: int) -> None:
    """The forward (fc1 at 16 rows), input-gradient and whole-weight decoding kernels for `byte_format`
    compiled for sm_`capability` (bf16, their assembly where it applies; the pairs also as a model holds them
    tile by tile, "tiled_pairs"): a compiler failure raises (the interpreter never compiles)."""
    target = GPUTarget("cuda", capability, 32)
    cfg = mxfp4_gemm.Mxfp4Config(block_m=16, block_n=64, block_k=128, warps=4, stages=3, decode="ptx")
    compile_forward(True, False, byte_format, cfg, target)
    fmt, ptx = mxfp4_gemm.BYTE_FORMATS.index(byte_format), byte_format != "checkpoint"
    names = ("N", "K", "stride_g", "stride_wbn", "stride_wsn", "stride_gx", "groups", "wb_col", "wb_step",
             "ws_col", "ws_step", "row_groups", "expert_groups")  # fmt: skip
    types = {**dict.fromkeys(names, "i32"), "G": "*bf16", "Wb": "*u8", "Ws": "*u8", "GX": "*bf16",
             "bounds": "*i32", "stride_wbe": "i64", "stride_wse": "i64", "blocks_ptr": "*u8",
             "scales_ptr": "*u8", "out_ptr": "*bf16"}  # fmt: skip
    aligned = ("G", "Wb", "Ws", "GX", "bounds", "N", "K", "stride_g", "stride_wbn", "stride_gx", "stride_wbe")
    tiles = (0, mxfp4_bytes.TILE_ROWS) if byte_format == "pairs" else (0,)
    for tile_rows in tiles:
        backward = {"BLOCK_M": 64, "BLOCK_R": 64, "BLOCK_K": 64, "DOT_PRECISION": "tf32", "BYTE_FORMAT": fmt,
                    "PTX": ptx, "TILE_ROWS": tile_rows}  # fmt: skip
        _compile(mxfp4_kernels.mxfp4_bwd_kernel, types, backward, aligned, target)
        dequant = {"BLOCK_G": 64, "BYTE_FORMAT": fmt, "PTX": ptx, "TILE_ROWS": tile_rows,
                   "TILE_GROUPS": mxfp4_bytes.TILE_K // mxfp4_bytes.BLOCK}  # fmt: skip
        pointers = ("blocks_ptr", "scales_ptr", "out_ptr")
        _compile(mxfp4_kernels.mxfp4_dequant_kernel, types, dequant, pointers, target)


def innermost_loop(cubin: bytes) -> LoopCount:
    """The registers of the kernel and the opcodes of its shortest loop (a backward branch's body)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        sass = subprocess.run(
            [_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    code, labels, label = [], {}, None
    for line in sass.splitlines():
        found = re.match(r"\s*\.L_x_(\d+):", line)
        if found:
            label = found.group(1)
            continue
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            address = int(found.group(1), 16)
            code.append((address, found.group(2).strip()))
            if label is not None:
                labels[label], label = address, None
    loops = []
    for address, text in code:
        target = re.search(r"\bBRA\b.*\.L_x_(\d+)", text)
        if target and target.group(1) in labels and labels[target.group(1)] < address:
            loops.append([t for a, t in code if labels[target.group(1)] <= a <= address])
    body = min(loops, key=len)
    ops = collections.Counter()
    for text in body:
        found = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
        if found:
            ops[found.group(1)] += 1
    return LoopCount(registers, len(body), ops, stack)


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of `warps` warps that fit one sm_90 SM at once: registers allocated 256 a warp at a time,
    1 KiB of shared memory reserved a program."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared + 1024), SM_WARPS // warps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--formats", default="checkpoint,shuffled,pairs", help="byte formats, comma-separated"
    )
    parser.add_argument("--block-m", type=int, default=16, help="rows a tile (16: 64 decode slots at top-4)")
    parser.add_argument("--block-n", type=int, default=64, help="output columns a program (of each half)")
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--sub-k", type=int, default=0, help="K values decoded at once (0: block_k)")
    parser.add_argument("--warps", type=int, default=0, help="warps a program (0: `default_config`'s)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument(
        "--maxnreg", type=int, default=0, help="registers a thread at most (0: the compiler's choice)"
    )
    parser.add_argument("--compile-others", action="store_true", help="also compile the input-gradient and "
                        "decoding kernels per format, for sm_80 and sm_90")  # fmt: skip
    parser.add_argument(
        "--tiled", action="store_true", help="the tile-contiguous layout (same code, other strides)"
    )
    parser.add_argument(
        "--prefetch", choices=("auto", "on", "off"), default="auto",
        help="scale bytes loaded a step ahead (auto: `mxfp4_gemm.prefetch_scales`)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    prefetch = mxfp4_gemm.prefetch_scales() if args.prefetch == "auto" else args.prefetch == "on"
    if not tools_present():
        print(f"the installed Triton ({triton.__version__}) carries no ptxas / cuobjdump / nvdisasm")
        return 2
    pieces = f" in pieces of {args.sub_k}" if args.sub_k else ""
    print(f"Triton {triton.__version__}, sm_90, gpt-oss-20b width, {args.block_m} rows a tile, K step "
          f"{args.block_k}{pieces}, {args.warps or 'default'} warps, {args.stages} stages, "
          f"{args.maxnreg or 'any'} registers at most, scales "
          f"{'a step ahead' if prefetch else 'in their step'}, one K step of one program:")  # fmt: skip
    print("| layer | bytes | registers | spilled bytes | shared KiB | programs an SM | instructions | "
          + " | ".join(COUNTED) + " |")  # fmt: skip
    print("|---|---|---|---|---|---|---|" + "---|" * len(COUNTED))
    for gated in (True, False):
        for byte_format in args.formats.split(","):
            warps = args.warps or mxfp4_gemm.default_warps(args.block_m, gated, byte_format)
            cfg = mxfp4_gemm.Mxfp4Config(
                block_m=args.block_m, block_n=args.block_n, block_k=args.block_k, warps=warps,
                stages=args.stages, decode="ptx", sub_k=args.sub_k, maxnreg=args.maxnreg,
            )  # fmt: skip
            kernel = compile_forward(gated, args.tiled, byte_format, cfg, prefetch=prefetch)
            loop = innermost_loop(kernel.asm["cubin"])
            shared = kernel.metadata.shared
            programs = programs_per_sm(loop.registers, shared, warps)
            counts = " | ".join(str(loop.count(name)) for name in COUNTED)
            print(f"| {'fc1' if gated else 'fc2'} | {byte_format} | {loop.registers} | {loop.stack} | "
                  f"{shared // 1024} | {programs} | {loop.instructions} | {counts} |")  # fmt: skip
    if args.compile_others:
        for byte_format in ("checkpoint", "pairs"):
            for capability in (80, 90):
                compile_others(byte_format, capability)
                print(f"compiled: forward, input gradient and decoding, {byte_format} bytes, sm_{capability}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
