"""Convert an HF GPT-OSS directory (bf16, or MXFP4 experts) into the sharded checkpoint that a parallel
run of the given layout writes (`megatron_gptoss.checkpoint.distributed`), in one process.

    python tools/convert_hf_to_dist.py /path/to/gpt-oss-120b /ckpt/gpt-oss-120b-tp1pp4ep8 \\
        --world 64 --pp 4 --ep 8

The output is a checkpoint directory (manifest.json, .metadata, one file per rank) holding the model
parameters at step 0: resume a run from it (`--resume <dir>`, any layout: it reshards on load) or
convert it back with tools/convert_dist_to_hf.py. Streams piece by piece (peak host memory about
4 x --chunk-mb); prints a progress bar and, at the end, bytes, seconds, GB/s and the peak RSS.

Everything read is verified: config.json, every shard's safetensors header, every tensor's shape and dtype
against the model, and its values (a NaN or an infinity, which a flipped bit often makes, stops the
conversion naming the file and tensor). Bad input (a missing or corrupt file, an existing output, a layout
that does not divide the model) ends in one line naming it and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megatron_gptoss.checkpoint.dist_convert import conversion_report, hf_to_dist
from megatron_gptoss.config import ParallelConfig
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.utils.cli import one_line_errors


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("hf_dir", help="HF GPT-OSS directory (config.json + safetensors)")
    parser.add_argument("out", help="output checkpoint directory (must not exist)")
    parser.add_argument("--world", type=int, default=1, help="ranks of the layout (tp x pp x dp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
    parser.add_argument("--vpp", type=int, default=1, help="virtual_pipeline_model_parallel_size")
    parser.add_argument("--pipeline-layers", default="", help="layers per (virtual) stage, e.g. 8,10,10,8")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored dtype")
    parser.add_argument("--chunk-mb", type=int, default=256, help="largest stored chunk, MiB")
    parser.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="vocabulary padding multiple (per tp)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.pipeline_layers.split(",")] if args.pipeline_layers else None
    except ValueError:
        parser.error(f"--pipeline-layers {args.pipeline_layers!r}: comma-separated integers expected")
    if args.chunk_mb < 0:
        parser.error(f"--chunk-mb must be >= 0, got {args.chunk_mb}")
    if Path(args.out).exists():
        raise ConfigError(f"{args.out} exists; choose a new output directory")
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        virtual_pipeline_model_parallel_size=args.vpp,
    )
    start = time.perf_counter()
    out = hf_to_dist(
        args.hf_dir,
        args.out,
        parallel,
        args.world,
        dtype=getattr(torch, args.dtype),
        max_chunk_bytes=args.chunk_mb << 20,
        pipeline_layers=counts,
        progress=not args.no_progress,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    seconds = time.perf_counter() - start
    report = conversion_report(out, seconds)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    with one_line_errors():
        main()
