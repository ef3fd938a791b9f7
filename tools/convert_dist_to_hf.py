"""Convert a sharded checkpoint of any layout (`megatron_gptoss.checkpoint.distributed`, or the output of
tools/convert_hf_to_dist.py) into an HF GPT-OSS directory: bf16 safetensors shards (or MXFP4 experts),
index.json and config.json, loadable by transformers and vLLM.

    python tools/convert_dist_to_hf.py /run/checkpoints/step_001000 /export/gpt-oss-120b-step1000
    python tools/convert_dist_to_hf.py /run/checkpoints /export/latest     # the newest verified checkpoint
    python tools/convert_dist_to_hf.py /run/checkpoints /export/mxfp4 --experts mxfp4   # released layout

`--experts mxfp4` writes the expert weights as the released gpt-oss checkpoints store them: `<name>_blocks`
and `<name>_scales` (uint8, quantized along the input dimension in blocks of 32, gate_up_proj's rows HF's
interleaved gate/up; `megatron_gptoss/hf/mxfp4.py` states the rounding rule), everything else in --dtype,
and config.json carries the released `quantization_config`, so transformers loads it as it loads the
original checkpoint. Experts that came from a released checkpoint and were not trained come back byte for
byte (tests/checkpoint/test_mxfp4_export.py). The default, `--experts bf16`, writes them in --dtype like every
other tensor.

A checkpoint root (a directory with `latest`) resolves to its newest checkpoint whose checksums verify.
A step directory has every file's checksum checked first (a corrupted file stops the export, naming it),
and every value exported must be finite (a NaN or an infinity stops the export, naming the tensor);
`--no-verify` skips both. Bad input (a missing or corrupt checkpoint, an existing output) ends in one line
naming it and exit status 1. Streams tensor by tensor in blocks (peak host memory about 4 x --block-mb plus
the stored chunks a block overlaps); prints a progress bar and, at the end, bytes, seconds, GB/s and the
peak RSS.

A LoRA checkpoint (adapters and their optimizer state only, `model.lora.rank > 0`) is exported merged:
the base is rebuilt from the source its manifest names (`run.init_from_hf`, or the random initialisation's
seed), the adapters are loaded, and every adapted weight is written as W + (alpha / rank) * B A, a plain
GPT-OSS that transformers and vLLM load. The whole model is held in host memory (fp32) meanwhile.

    python tools/convert_dist_to_hf.py /run/checkpoints /export/merged            # --lora merge (default)
    python tools/convert_dist_to_hf.py /run/checkpoints /export/adapter --lora peft

A merged export writes the experts in --dtype (W + scale * B A over the base, whatever the base's format),
or re-quantized with `--experts mxfp4`.

`--lora peft` writes the adapters alone in PEFT's format (`megatron_gptoss/hf/peft_format.py` states how
fused QKV, the router and the per-expert adapters map), for `peft.PeftModel.from_pretrained` on the base.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.checkpoint.dist_convert import EXPERT_FORMATS, conversion_report, dist_to_hf
from megatron_gptoss.checkpoint.lora import is_lora_checkpoint, load_policy, read_adapters
from megatron_gptoss.checkpoint.manager import LATEST, CheckpointManager, read_manifest
from megatron_gptoss.errors import CheckpointError, ConfigError
from megatron_gptoss.hf.io import save_hf_tensors
from megatron_gptoss.hf.peft_format import save_peft
from megatron_gptoss.utils.cli import one_line_errors

LORA_BUCKET_BYTES = 256 << 20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a root holding `latest`")
    parser.add_argument("out", help="output HF directory (must not exist)")
    parser.add_argument("--module", default="model", help="module group to export (model, reference)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="HF dtype")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors file, GiB")
    parser.add_argument("--block-mb", type=int, default=256, help="largest block in memory, MiB")
    parser.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every file's sha256 before exporting and every value exported (default); --no-verify "
        "skips both",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--lora",
        default="merge",
        choices=["merge", "peft"],
        help="how a LoRA checkpoint is exported: merge (W + scale * B A into a plain GPT-OSS) or peft "
        "(the adapters in PEFT's format)",
    )
    parser.add_argument(
        "--experts",
        default="bf16",
        choices=list(EXPERT_FORMATS),
        help="expert weights in --dtype (bf16, default) or as the released MXFP4 blocks and scales (mxfp4)",
    )
    args = parser.parse_args(argv)
    if not args.shard_gb > 0 or args.block_mb < 0:
        parser.error(f"--shard-gb must be > 0 and --block-mb >= 0, got {args.shard_gb}, {args.block_mb}")
    path = Path(args.checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if Path(args.out).exists():
        raise ConfigError(f"{args.out} exists; choose a new output directory")
    if (path / LATEST).is_file():
        found = CheckpointManager(path).find_resumable()
        if found is None:
            raise CheckpointError(f"{path} holds no complete, verified checkpoint")
        path = found
    elif args.verify:
        CheckpointManager.verify(path)
    start = time.perf_counter()
    if is_lora_checkpoint(read_manifest(path)):
        if args.lora == "peft":
            out = export_peft(path, args.out, getattr(torch, args.dtype))
        else:
            shard_bytes = int(args.shard_gb * 2**30)
            out = export_merged(path, args.out, getattr(torch, args.dtype), shard_bytes, args.experts)
        report = conversion_report(out, time.perf_counter() - start, checkpoint=str(path), lora=args.lora)
        print(json.dumps(report))
        return report
    out = dist_to_hf(
        path,
        args.out,
        dtype=getattr(torch, args.dtype),
        max_shard_bytes=int(args.shard_gb * 2**30),
        block_bytes=args.block_mb << 20,
        prefix=args.module,
        progress=not args.no_progress,
        verify_values=args.verify,
        experts=args.experts,
    )
    seconds = time.perf_counter() - start
    report = conversion_report(out, seconds, checkpoint=str(path))
    print(json.dumps(report))
    return report


@contextmanager
def _one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the block, unless torch.distributed is initialised already."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own_group:
            dist.destroy_process_group()


def export_merged(
    path: Path, out: str, dtype: torch.dtype, max_shard_bytes: int, experts: str = "bf16"
) -> Path:
    """The LoRA checkpoint at `path` as a merged HF directory `out`, experts in `dtype` or MXFP4."""
    with _one_rank_group():
        model, dims = load_policy(path)
        exporter = WeightExporter([model], model.config, dims, EngineLayout(), LORA_BUCKET_BYTES, dst=0)
        return save_hf_tensors(exporter.pairs(), model.config, out, max_shard_bytes, dtype, experts)


def export_peft(path: Path, out: str, dtype: torch.dtype) -> Path:
    """The adapters of the LoRA checkpoint at `path` as a PEFT adapter directory `out`."""
    with _one_rank_group():
        adapters, config, base = read_adapters(path)
    return save_peft(adapters, config, out, base.get("init_from_hf"), dtype)


if __name__ == "__main__":
    with one_line_errors():
        main()
