"""Conversion between HF GPT-OSS directories and sharded checkpoints, in one process, streaming.

    hf_to_dist   HF directory (bf16, or MXFP4 experts) -> the sharded checkpoint that the ranks of a
                 layout would write (`__<rank>_0.distcp` per rank, `.metadata`, manifest.json; model
                 parameters only, step 0). Rank by rank, piece by piece: each piece (a box of one of our
                 tensors, at most `max_chunk_bytes`) is read from the HF slices that make it
                 (safetensors `get_slice`; MXFP4 experts dequantized by expert range), verified (shape,
                 dtype, finite values: `hf.io.check_values`), written, freed.
    dist_to_hf   sharded checkpoint of any layout -> HF bf16 safetensors shards of at most
                 `max_shard_bytes`, `model.safetensors.index.json`, `config.json` (what `save_hf` writes,
                 loadable by transformers and vLLM). Each HF tensor is streamed into its shard file in
                 blocks of at most `block_bytes` along its first dimension (vocabulary rows, experts, or
                 rows); the fused QKV (one layer's attention, small) is converted whole. With
                 `experts="mxfp4"` the expert weights are written as the released checkpoints store them
                 (`<name>_blocks` / `<name>_scales`, `hf.mxfp4.quantize_mxfp4`, the released
                 `quantization_config` in config.json).

Peak host memory, beyond the interpreter: hf_to_dist about 4 x max_chunk_bytes (the HF slice as read,
its re-laid-out copy, the dtype cast, DCP's serialisation buffer; MXFP4 dequantizes in fp32, 2x a bf16
piece); dist_to_hf about 4 x block_bytes plus the stored chunks a block overlaps (each read whole, at
most the checkpoint's chunk size), or one layer's QKV; with MXFP4 experts the block is read in fp32 and
the scales of one expert weight wait in memory for their place after its blocks (1/16 of the blocks'
bytes). Memory-mapped pages of the HF files are dropped after each read. Both write into a temporary
directory beside the output and rename it at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from megatron_gptoss.checkpoint.dist_boxes import (
    Box,
    full_shapes,
    local_box,
    rank_slots,
    split_box,
    writes_param,
)
from megatron_gptoss.checkpoint.dist_experts import experts_from_hf, experts_from_mxfp4, experts_to_hf
from megatron_gptoss.checkpoint.dist_planner import CheckpointReader, Piece, write_virtual_ranks
from megatron_gptoss.checkpoint.distributed import FORMAT, RunState, layout_dict
from megatron_gptoss.checkpoint.manager import MANIFEST, read_manifest, write_manifest
from megatron_gptoss.config import ModelConfig, ParallelConfig
from megatron_gptoss.errors import CheckpointError, CorruptCheckpointError
from megatron_gptoss.hf.io import (
    BLOCKS,
    CONFIG_FILE,
    INDEX_FILE,
    SCALES,
    check_values,
    open_shard,
    read_config,
    weight_map_of,
)
from megatron_gptoss.hf.mxfp4 import QUANTIZATION_CONFIG, pack_expert_weight, packed_shapes
from megatron_gptoss.hf.names import from_hf, hf_shapes, match_ours, our_names, to_hf
from megatron_gptoss.parallel.dims import validate_layout

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_SHARD_BYTES = 4 << 30
# How `dist_to_hf` writes the expert weights: in the export dtype like every tensor, or MXFP4.
EXPERT_FORMATS = ("bf16", "mxfp4")
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}


# ------------------------------------------------------------------------------------------------
# HF -> sharded
class _HFSlices:
    """Boxes of our tensors read from an HF directory: only the HF rows / experts a box needs."""

    def __init__(self, path: Path, config: ModelConfig):
        self.path, self.config = path, config
        self.weight_map = weight_map_of(path)
        self.stack: ExitStack | None = None
        known = {hf for _, hf, _ in _hf_tensors(config, torch.float32)}
        known |= {name + part for name in known for part in (BLOCKS, SCALES)}
        unexpected = sorted(set(self.weight_map) - known)
        if unexpected:
            raise CheckpointError(
                f"{path}: {len(unexpected)} tensor(s) the model does not have (layers "
                f"{config.num_layers}, experts {config.num_experts}): {unexpected[:8]}"
            )

    def _read(
        self, name: str, index: tuple[slice, ...], expected: Sequence[int], packed: bool = False
    ) -> torch.Tensor:
        """A slice of HF tensor `name`: a view of the memory-mapped file, valid until `box` returns. Its
        values are verified (`check_values`) unless it is MXFP4 (`packed`: blocks or scales, checked by the
        caller)."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        assert self.stack is not None, "read inside box()"
        handle = self.stack.enter_context(open_shard(self.path, file))
        if name not in handle.keys():
            raise CheckpointError(
                f"tensor {name!r} is listed in the index but absent from {str(self.path / file)!r}"
            )
        piece = handle.get_slice(name)
        shape = tuple(piece.get_shape())
        if shape != tuple(expected):
            raise CheckpointError(
                f"{self.path / file}: tensor {name!r} has shape {shape}, expected {tuple(expected)}"
            )
        return piece[index] if packed else check_values(piece[index], name, self.path / file)

    def _experts(self, kind: str, name: str, start: int, stop: int, expected, dtype) -> torch.Tensor:
        """Experts [start, stop) of the HF expert weight `name` (bf16, or MXFP4 dequantized) in our layout
        and `dtype`."""
        if name in self.weight_map or name + BLOCKS not in self.weight_map:
            return experts_from_hf(kind, self._read(name, (slice(start, stop),), expected), dtype)
        shapes = packed_shapes(tuple(expected))
        if shapes is None:
            raise CheckpointError(f"tensor {name + BLOCKS!r}: {name!r} of shape {expected} cannot be MXFP4")
        blocks = self._read(name + BLOCKS, (slice(start, stop),), shapes[0], packed=True)
        scales = self._read(name + SCALES, (slice(start, stop),), shapes[1], packed=True)
        for part, tensor in ((BLOCKS, blocks), (SCALES, scales)):
            if tensor.dtype != torch.uint8:
                raise CheckpointError(
                    f"tensor {name + part!r} has dtype {tensor.dtype}, expected torch.uint8"
                )
        experts = experts_from_mxfp4(kind, blocks, scales, dtype)
        return check_values(experts, name + SCALES, self.path / self.weight_map[name + SCALES])

    def box(self, ours: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """Box `box` of our tensor `ours` (unpadded full coordinates) in `dtype`, a tensor of its own
        (the files are closed again, so their mapped pages are released)."""
        with ExitStack() as self.stack:
            out = self._box(ours, box, dtype)
        self.stack = None
        return out

    def _box(self, ours: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        match = match_ours(ours)
        kind, expected = match.rule.kind, hf_shapes(match, self.config)
        if kind in ("same", "vocab"):  # our layout is HF's: slice every dimension
            index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
            return self._read(match.hf[0], index, expected[0]).to(dtype, copy=True)
        if kind == "qkv":  # whole KV groups covering the rows, then the rows
            per, d = self.config.num_attention_heads // self.config.num_query_groups, self.config.head_dim
            size = (per + 2) * d
            g0, g1 = box.offsets[0] // size, -(-(box.offsets[0] + box.sizes[0]) // size)
            ranges = ((g0 * per * d, g1 * per * d), (g0 * d, g1 * d), (g0 * d, g1 * d))
            parts = [self._read(n, (slice(a, b),), e) for n, (a, b), e in zip(match.hf, ranges, expected)]
            local = ModelConfig(
                **{
                    **_fields(self.config),
                    "num_attention_heads": per * (g1 - g0),
                    "num_query_groups": g1 - g0,
                }
            )
            full = from_hf(match, parts, local).to(dtype)
            return _narrow(full, box, (g0 * size, *[0] * (len(box.sizes) - 1)))
        # fc1 / fc1_bias / fc2: experts [e0, e1) whole, re-laid out, then the box
        e0, e1 = box.offsets[0], box.offsets[0] + box.sizes[0]
        if kind == "fc1_bias":
            experts = from_hf(match, [self._read(match.hf[0], (slice(e0, e1),), expected[0])], self.config)
        else:
            experts = self._experts(kind, match.hf[0], e0, e1, expected[0], dtype)
        return _narrow(experts.to(dtype), box, (e0, *[0] * (len(box.sizes) - 1)))


def _fields(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)  # nested sections (model.lora) as mappings


def _narrow(tensor: torch.Tensor, box: Box, origin: Sequence[int]) -> torch.Tensor:
    for d, (offset, size) in enumerate(zip(box.offsets, box.sizes)):
        tensor = tensor.narrow(d, offset - origin[d], size)
    return tensor


def hf_to_dist(
    hf_path: str | os.PathLike,
    out: str | os.PathLike,
    parallel: ParallelConfig,
    world: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pipeline_layers: Sequence[int] | None = None,
    progress: bool = True,
    **config_overrides,
) -> Path:
    """Write the sharded checkpoint (model parameters in `dtype`, step 0) that the `world` ranks of layout
    `parallel` would write, from the HF directory `hf_path`. `config_overrides` set ModelConfig fields
    config.json does not carry (make_vocab_size_divisible_by). A layout that does not divide the model
    raises ConfigError naming the numbers; a missing or misshapen HF tensor raises CheckpointError, one of
    another dtype or holding a non-finite value CorruptCheckpointError naming its file (`check_values`)."""
    hf_path, out = Path(hf_path), Path(out)
    config = read_config(hf_path, **config_overrides)
    layout = validate_layout(parallel, config, world)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new output directory")
    source = _HFSlices(hf_path, config)
    shapes = full_shapes(config)
    ranks = []
    total = 0
    for rank in range(world):
        coords = layout.coords(rank)
        pieces = []
        for slot in rank_slots(layout, config, rank, pipeline_layers):
            if not writes_param(slot.spec, coords):
                continue
            box = local_box(slot.name, slot.spec, slot.local_shape, coords, config.vocab_size)
            for sub, _, _, _ in split_box(box, dtype.itemsize, max_chunk_bytes):
                if sub.numel:
                    read = _reader(source, slot.name, sub, dtype)
                    pieces.append(Piece(f"model/{slot.name}", shapes[slot.name], sub, dtype, read))
                    total += sub.numel * dtype.itemsize
        blobs = {"run": {**RunState(0).__dict__, "optimizer": None}} if rank == 0 else {}
        ranks.append((pieces, blobs))
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="hf->dist", disable=not progress) as bar:
            write_virtual_ranks(staging, ranks, on_piece=lambda p: bar.update(p.box.numel * dtype.itemsize))
        meta = {
            "format": FORMAT,
            "model": _fields(config),
            "layout": layout_dict(layout, None, pipeline_layers),
            "contents": {"modules": ["model"], "optimizer": False},
            "config": {"source": str(hf_path), "dtype": str(dtype).removeprefix("torch.")},
        }
        write_manifest(staging, 0, meta)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _reader(source: _HFSlices, name: str, box: Box, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: source.box(name, box, dtype).contiguous()


# ------------------------------------------------------------------------------------------------
# sharded -> HF
class _StreamingShard:
    """One safetensors file written tensor by tensor, block by block: the header (every tensor's dtype,
    shape and byte range) first, then the bytes in header order."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        at = 0
        for name, shape, dtype in tensors:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [at, at + size],
            }
            at += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.end = 8 + len(text) + at

    def write(self, block: torch.Tensor) -> None:
        self.file.write(block.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self.file.tell() != self.end:
            raise RuntimeError(
                f"{self.file.name}: {self.file.tell()} bytes written, the header says {self.end}"
            )
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class _Entry(NamedTuple):
    """One tensor of the HF directory `dist_to_hf` writes."""

    ours: str  # our parameter it is made of
    hf: str  # its HF name: `base`, or `base` + "_blocks" / "_scales" (MXFP4)
    shape: tuple[int, ...]
    dtype: torch.dtype
    base: str  # the HF tensor's name (`hf` without the MXFP4 suffix)
    base_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _export_entries(config: ModelConfig, dtype: torch.dtype, experts: str) -> list[_Entry]:
    """The tensors of the HF directory, in table order: each expert weight as its blocks then its scales when
    `experts` is "mxfp4", everything else (and with "bf16" everything) in `dtype`."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r} not in {EXPERT_FORMATS}")
    out = []
    for ours, hf, shape in _hf_tensors(config, dtype):
        if experts == "mxfp4" and match_ours(ours).rule.kind in ("fc1", "fc2"):
            packed = packed_shapes(shape)
            if packed is None:
                raise CheckpointError(
                    f"{hf} {shape} cannot be MXFP4: its input width is not a multiple of 32"
                )
            out.append(_Entry(ours, hf + BLOCKS, packed[0], torch.uint8, hf, shape))
            out.append(_Entry(ours, hf + SCALES, packed[1], torch.uint8, hf, shape))
        else:
            out.append(_Entry(ours, hf, shape, dtype, hf, shape))
    return out


def _hf_tensors(config: ModelConfig, dtype: torch.dtype) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our name, HF name, HF shape) of every HF tensor, in table order."""
    out = []
    for ours in our_names(config):
        match = match_ours(ours)
        out += [(ours, hf, tuple(shape)) for hf, shape in zip(match.hf, hf_shapes(match, config))]
    return out


def dist_to_hf(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    block_bytes: int = DEFAULT_CHUNK_BYTES,
    prefix: str = "model",
    progress: bool = True,
    verify_values: bool = True,
    experts: str = "bf16",
) -> Path:
    """Write the HF directory of the module group `prefix` of the sharded checkpoint `path` (any layout).
    `experts`: "bf16" writes the expert weights in `dtype` like every other tensor; "mxfp4" writes them as the
    released checkpoints do, `<name>_blocks` [E, out, in / 32, 16] and `<name>_scales` [E, out, in / 32]
    uint8 (gate_up_proj's rows HF's interleaved gate/up), quantized from the stored values (read in fp32) by
    `quantize_mxfp4`, with the released `quantization_config` in config.json. Raises CheckpointError for a
    directory that is not such a checkpoint or lacks a tensor, and, with `verify_values`,
    CorruptCheckpointError for a non-finite value (naming the tensor); checksums are the caller's
    (`CheckpointManager.verify`)."""
    path, out = Path(path), Path(out)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: it has no {MANIFEST}")
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    missing = sorted(name for name in manifest["files"] if not (path / name).is_file())
    if missing:
        raise CorruptCheckpointError(f"{path}: files listed in {MANIFEST} are missing: {missing}")
    if prefix not in manifest["contents"]["modules"]:
        raise CheckpointError(f"{path} holds no {prefix!r} parameters ({manifest['contents']['modules']})")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new output directory")
    config = ModelConfig(**manifest["model"])
    reader = CheckpointReader(path)
    tensors = _export_entries(config, dtype, experts)
    shards: list[list[_Entry]] = [[]]
    filled = 0
    for entry in tensors:
        if shards[-1] and filled + entry.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += entry.nbytes
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    total = sum(entry.nbytes for entry in tensors)
    weight_map = {}
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="dist->hf", disable=not progress) as bar:
            cache: dict[str, list[tuple[str, torch.Tensor]]] = {}
            scales: dict[str, torch.Tensor] = {}  # MXFP4 scales waiting for their place after the blocks
            for i, entries in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                shard = _StreamingShard(staging / file, [(e.hf, e.shape, e.dtype) for e in entries])
                for entry in entries:
                    fqn = f"{prefix}/{entry.ours}"
                    if entry.hf.endswith(SCALES) and entry.dtype == torch.uint8:
                        shard.write(scales.pop(entry.hf))
                        bar.update(entry.nbytes)
                    elif entry.hf.endswith(BLOCKS) and entry.dtype == torch.uint8:
                        read_dtype, parts = torch.float32, []
                        for block in _hf_blocks(
                            reader, fqn, entry.base, entry.base_shape, config, read_dtype, block_bytes, cache
                        ):
                            packed, block_scales = pack_expert_weight(
                                check_values(block, entry.base, path) if verify_values else block
                            )
                            shard.write(packed)
                            parts.append(block_scales)
                            bar.update(packed.numel())
                        scales[entry.base + SCALES] = torch.cat(parts)
                    else:
                        blocks = _hf_blocks(
                            reader, fqn, entry.hf, entry.shape, config, dtype, block_bytes, cache
                        )
                        for block in blocks:
                            shard.write(check_values(block, entry.hf, path) if verify_values else block)
                            bar.update(block.numel() * dtype.itemsize)
                    weight_map[entry.hf] = file
                shard.close()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        hf_config = config.to_hf_config()
        hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
        if experts == "mxfp4":
            hf_config["quantization_config"] = QUANTIZATION_CONFIG
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _hf_blocks(reader, fqn, hf, shape, config, dtype, block_bytes, cache):
    """HF tensor `hf` (made from our `ours`) as consecutive blocks along its first dimension."""
    match = match_ours(fqn.split("/", 1)[1])
    if match.rule.kind == "qkv":  # q, k and v of one layer: convert the fused tensor once
        if fqn not in cache:
            cache.clear()
            cache[fqn] = to_hf(match, reader.read(fqn, dtype=dtype), config)
        yield dict(cache[fqn])[hf]
        return
    stored = reader.shape(fqn)  # dim 0 of ours is dim 0 of HF (vocabulary rows, experts, rows)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    cuts = reader.row_cuts(fqn)
    for start, stop in row_blocks(cuts, stored[0], max(1, block_bytes // max(1, row_bytes))):
        rows = stop - start
        box = Box((start, *[0] * (len(stored) - 1)), (rows, *stored[1:]))
        block = reader.read(fqn, box, dtype=dtype)
        if match.rule.kind in ("fc1", "fc2"):
            yield experts_to_hf(match.rule.kind, block)
            continue
        ((_, converted),) = to_hf(match, block, config)
        yield converted


def row_blocks(cuts: Sequence[int], rows: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) blocks covering rows [0, rows), at most `max_rows` each, ending at the stored chunks'
    row boundaries `cuts` where they can (so each stored chunk is read once)."""
    ends = sorted({c for c in cuts if 0 < c < rows} | {rows})
    out: list[tuple[int, int]] = []
    start = 0
    while start < rows:
        fitting = [e for e in ends if start < e <= start + max_rows]
        stop = fitting[-1] if fitting else min(rows, start + max_rows)
        out.append((start, stop))
        start = stop
    return out


def conversion_report(out: Path, seconds: float, **extra: object) -> dict[str, object]:
    """What a conversion tool prints: `extra`, then the bytes of the files written in `out`, the seconds,
    the rate (GB/s written) and this process's peak RSS."""
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {
        **extra,
        "out": str(out),
        "bytes_written": written,
        "seconds": round(seconds, 2),
        "GB_per_s": round(written / seconds / 1e9, 3),
        "peak_rss_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    }
