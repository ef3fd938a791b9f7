"""Hugging Face GPT-OSS checkpoint directories <-> our single-device model.

A directory holds `config.json` and either `model.safetensors.index.json` (its `weight_map` gives the
shard file of every HF tensor) with the shards, or a single `model.safetensors`. Tensors are bf16
(any float dtype is accepted), or MXFP4 for the expert weights (`<name>_blocks` / `<name>_scales`,
see `mxfp4`). Names and layouts go through the one table in `names`; `convert` assembles them.

Import and export stream tensor by tensor; neither ever holds two copies of the model in host memory.

What import reads is verified (safetensors carries no checksum): the header by safetensors (a file whose
header or byte ranges do not fit it cannot be opened), every tensor's shape against the model, its dtype
(floating point, or uint8 for MXFP4 blocks and scales), and its values, which must be finite (`check_values`:
a flipped bit often makes a NaN or an infinity; no trained GPT-OSS holds one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from megatron_gptoss.config import ConfigError, ModelConfig
from megatron_gptoss.errors import CheckpointError, CorruptCheckpointError
from megatron_gptoss.hf.convert import iter_hf_tensors, load_hf_tensors
from megatron_gptoss.hf.mxfp4 import (
    QUANTIZATION_CONFIG,
    pack_expert_weight,
    packed_shapes,
    unpack_expert_weight,
)
from megatron_gptoss.hf.names import Match, hf_shapes, match_hf
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.utils.files import fsync_path

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BLOCKS, SCALES = "_blocks", "_scales"
# Shard size bound of `save_hf`: export holds at most one shard of this size besides the model.
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
# ModelConfig fields that decide which tensors exist and their shapes (`check_hf_config`): HF key of each.
SHAPE_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "sliding_window": "sliding_window",
    "layer_types": "layer_types",
    "num_experts": "num_local_experts",
    "moe_router_topk": "num_experts_per_tok",
    "add_bias_linear": "attention_bias",
}
# ModelConfig fields config.json does not carry (implementation choices of this project).
LOCAL_FIELDS = (
    "make_vocab_size_divisible_by",
    "attention_backend",
    "expert_backend",
    "expert_format",
    "activation_checkpointing",
    "moe_router_fp32",
    "lora",
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Import
def read_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ModelConfig of an HF GPT-OSS directory (from its config.json), with `overrides` applied."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{Path(path)} is not an HF checkpoint directory: it has no {CONFIG_FILE}")
    try:
        return ModelConfig.from_hf_config(json.loads(file.read_text()), **overrides)
    except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as err:
        raise CheckpointError(f"{file} is not a valid GPT-OSS config: {err!r}") from err


def check_hf_config(path: str | os.PathLike, model: ModelConfig) -> None:
    """Check that the HF GPT-OSS directory (or config.json file) `path` describes the model `model`
    configures, before any weight is read.

    Raises ConfigError naming the file when it is not GPT-OSS (`model_type` gpt_oss, `architectures`
    GptOssForCausalLM), and, in one message, every shape field (SHAPE_FIELDS) on which the two disagree
    with both values; logs a warning for each other differing field (RoPE / YaRN, SwiGLU constants,
    epsilon, token ids). Raises CheckpointError when config.json is missing or is not JSON."""
    file = Path(path)
    if file.suffix != ".json":
        file = file / CONFIG_FILE
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read the HF config {file}: {err}") from err
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "gpt_oss" or "GptOssForCausalLM" not in architectures:
        raise ConfigError(
            f"{file} is not a GPT-OSS checkpoint: model_type={hf.get('model_type')!r}, "
            f"architectures={architectures!r} (expected 'gpt_oss', ['GptOssForCausalLM'])"
        )
    local = {name: getattr(model, name) for name in LOCAL_FIELDS}
    try:
        theirs = ModelConfig.from_hf_config(hf, **local)
    except KeyError as err:
        raise ConfigError(f"{file} has no {err.args[0]!r}") from None
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"{file} is not a valid GPT-OSS config: {err}") from err
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in LOCAL_FIELDS]
    differ = [name for name in names if not _same(getattr(model, name), getattr(theirs, name))]
    shape = [
        f"model.{name}={getattr(model, name)!r} vs {SHAPE_FIELDS[name]}={getattr(theirs, name)!r}"
        for name in differ
        if name in SHAPE_FIELDS
    ]
    if shape:
        raise ConfigError(f"the model config disagrees with {file} on the shapes: " + "; ".join(shape))
    for name in differ:
        log.warning(
            "model.%s=%r differs from %s, which has %r",
            name,
            getattr(model, name),
            file,
            getattr(theirs, name),
        )


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def load_hf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu", **overrides
) -> GPTOSSModel:
    """A GPTOSSModel with the weights of the HF GPT-OSS directory `path`, parameters in `dtype` on `device`.
    `overrides` set ModelConfig fields that config.json does not carry (attention_backend,
    expert_backend, make_vocab_size_divisible_by, activation_checkpointing, moe_router_fp32).

    The model is built on the meta device and its parameters are allocated empty (no random
    initialisation), then every parameter is written exactly once from the checkpoint. Tensors are
    read one at a time (safetensors memory-maps the shards). Peak host memory: the model itself (when
    `device` is the CPU) plus the tensors in flight: one HF tensor and its re-laid-out copy, the q/k/v
    parts of a fused QKV until all three have arrived (one layer's when shards follow layer order), and
    for MXFP4 one blocks/scales pair and its dequantized weight. tests/checkpoint/test_hf.py measures it.

    Raises CheckpointError naming the tensor for a missing tensor, an unexpected tensor or a wrong shape
    (both shapes given), and naming the file for a missing config.json, index or shard, or an
    unreadable (truncated, corrupt) safetensors file."""
    path = Path(path)
    config = read_config(path, **overrides)
    if config.expert_format != "bf16":
        raise ConfigError(
            f"load_hf builds float experts (model.expert_format='bf16'), got {config.expert_format!r}: "
            "MXFP4 experts load through parallel.loading.load_hf_parallel"
        )
    model = _empty_model(config, dtype, device)
    load_hf_tensors(model, config, iter_checkpoint(path, config, dtype))
    return model


def _empty_model(config: ModelConfig, dtype: torch.dtype, device) -> GPTOSSModel:
    """GPTOSSModel whose parameters are allocated but not initialised (buffers are computed as usual)."""
    model = GPTOSSModel(config, dtype=dtype, device="meta")
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty_like(param, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
    return model


def iter_checkpoint(
    path: str | os.PathLike, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every tensor of the directory, shard by shard, one tensor at a time, in the
    stored dtype. An MXFP4 pair `<name>_blocks` / `<name>_scales` comes out once, as `<name>` dequantized
    to `dtype` in the HF orientation (the scales may live in another shard)."""
    path = Path(path)
    weight_map = weight_map_of(path)
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    for file, names in files.items():
        with open_shard(path, file) as handle:
            for name in names:
                packed = _packed_match(name)
                if packed is None:
                    yield name, check_values(_get(handle, file, name), name, path / file)
                    continue
                base, match = packed
                if name.endswith(BLOCKS):
                    yield base, _read_packed(path, handle, file, match, base, weight_map, config, dtype)
                elif base + BLOCKS not in weight_map:
                    raise CheckpointError(
                        f"missing tensor {base + BLOCKS!r}: the checkpoint has {name!r} only"
                    )


def weight_map_of(path: Path) -> dict[str, str]:
    """hf_name -> shard file name, from the index or from the single-file checkpoint."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index: {err!r}") from err
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        return weight_map
    if (path / SINGLE_FILE).is_file():
        with open_shard(path, SINGLE_FILE) as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)
    raise CheckpointError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")


@contextmanager
def open_shard(path: Path, file: str):
    """safe_open of one shard; any failure to read it becomes a CheckpointError naming the file."""
    full = path / file
    if not full.is_file():
        raise CheckpointError(f"shard file {str(full)!r} listed in the checkpoint does not exist")
    try:
        handle = safe_open(str(full), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read safetensors file {str(full)!r}: {err}") from err
    with handle:
        yield handle


def check_values(tensor: torch.Tensor, name: str, file: str | os.PathLike) -> torch.Tensor:
    """`tensor` (HF tensor `name`, read from `file`) once it is floating point and every value is finite;
    else CorruptCheckpointError naming the file, the tensor and, for non-finite values, how many and the
    first one's index. A sum screens the values (it is finite only when every value is; about 30 GB/s on
    one CPU core); they are counted only when it is not."""
    if not tensor.is_floating_point():
        raise CorruptCheckpointError(
            f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype"
        )
    if tensor.numel() == 0 or bool(tensor.sum().isfinite()):
        return tensor
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    if count:
        first = [int(i) for i in bad.nonzero()[0]]
        raise CorruptCheckpointError(
            f"{file}: tensor {name!r} holds {count} non-finite value(s) (NaN or inf), the first at {first}: "
            "the file is corrupt (or holds weights that diverged)"
        )
    return tensor  # finite values whose sum overflows


def _get(handle, file: str, name: str) -> torch.Tensor:
    if name not in handle.keys():
        raise CheckpointError(f"tensor {name!r} is listed in the index but absent from {file!r}")
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read tensor {name!r} from {file!r}: {err}") from err


def _packed_match(name: str) -> tuple[str, Match] | None:
    """(`<name>`, its rule) when `name` is the blocks or scales of an MXFP4 expert weight, else None."""
    for suffix in (BLOCKS, SCALES):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            match = match_hf(base)
            if match is not None and match.rule.kind in ("fc1", "fc2"):
                return base, match
    return None


def _read_packed(
    path: Path,
    handle,
    file: str,
    match: Match,
    base: str,
    weight_map: dict[str, str],
    config: ModelConfig,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Read, check and dequantize the MXFP4 pair of the HF expert weight `base`."""
    blocks_name, scales_name = base + BLOCKS, base + SCALES
    if scales_name not in weight_map:
        raise CheckpointError(f"missing tensor {scales_name!r} (the scales of {blocks_name!r})")
    if match.layer is not None and match.layer >= config.num_layers:
        raise CheckpointError(
            f"unexpected tensor {blocks_name!r}: layer {match.layer} "
            f"but the model has {config.num_layers} layers"
        )
    hf_shape = dict(zip(match.hf, hf_shapes(match, config)))[base]
    shapes = packed_shapes(hf_shape)
    if shapes is None:
        raise CheckpointError(f"tensor {blocks_name!r}: {base!r} of shape {hf_shape} cannot be MXFP4")
    blocks = _get(handle, file, blocks_name)
    if weight_map[scales_name] == file:
        scales = _get(handle, file, scales_name)
    else:
        with open_shard(path, weight_map[scales_name]) as other:
            scales = _get(other, weight_map[scales_name], scales_name)
    for name, tensor, expected in ((blocks_name, blocks, shapes[0]), (scales_name, scales, shapes[1])):
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        if tensor.dtype != torch.uint8:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, expected torch.uint8 (MXFP4)")
    return check_values(
        unpack_expert_weight(blocks, scales, dtype), scales_name, path / weight_map[scales_name]
    )


# ------------------------------------------------------------------------------------------------
# Export
def save_hf(
    model: GPTOSSModel,
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `model` as an HF GPT-OSS directory that transformers' GptOssForCausalLM loads: safetensors
    shards `model-0000i-of-0000n.safetensors` of at most `max_shard_bytes` each (a larger single tensor
    gets a shard of its own), `model.safetensors.index.json` and `config.json`. Tensors are written in
    `dtype` (bf16 by default), with HF names and layouts; the vocabulary padding is dropped.

    Parameters are converted one at a time into the shard being filled, which is written once it
    reaches the bound. Peak host memory: the model plus one shard plus one tensor in conversion.

    The directory is written under a temporary name beside `path`, then renamed into place, so an
    interrupted save leaves any previous checkpoint at `path` intact. An existing `path` is replaced
    only if it is empty or holds a config.json (a previous checkpoint); anything else raises
    FileExistsError. Returns `path`."""
    return save_hf_tensors(iter_hf_tensors(model, model.config), model.config, path, max_shard_bytes, dtype)


def save_hf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    experts: str = "bf16",
) -> Path:
    """`save_hf` of a stream of (HF name, full unpadded tensor) pairs, e.g. the bridge's export of a
    sharded model gathered on one rank; written as they come (the stream is consumed once). `experts`:
    "bf16" writes the expert weights in `dtype` like every tensor, "mxfp4" as the released checkpoints store
    them (`<name>_blocks` / `<name>_scales` by `mxfp4.pack_expert_weight`, the released
    `quantization_config` in config.json)."""
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts={experts!r} not in ('bf16', 'mxfp4')")
    path = Path(path)
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        writer = _ShardWriter(staging, max_shard_bytes)
        for name, tensor in tensors:
            match = match_hf(name) if experts == "mxfp4" else None
            if match is not None and match.rule.kind in ("fc1", "fc2"):
                blocks, scales = pack_expert_weight(tensor)
                writer.add(name + BLOCKS, blocks.cpu())
                writer.add(name + SCALES, scales.cpu())
                continue
            writer.add(name, tensor.to(device="cpu", dtype=dtype, copy=True).contiguous())
        weight_map, total_bytes = writer.finish()
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(staging / INDEX_FILE, index)
        hf_config = config.to_hf_config()
        hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
        if experts == "mxfp4":
            hf_config["quantization_config"] = QUANTIZATION_CONFIG
        _write_json(staging / CONFIG_FILE, hf_config)
        _replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


class _ShardWriter:
    """Fills shards up to `max_bytes` and writes each as soon as the next tensor would overflow it."""

    def __init__(self, directory: Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}")
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        file = self.directory / f"shard-{len(self.shards)}.partial"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        fsync_path(file)
        self.shards.append(list(self.pending))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> tuple[dict[str, str], int]:
        """Write the last shard, give the shards their final names; returns (weight_map, total bytes)."""
        if self.pending:
            self._flush()
        count = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.rename(self.directory / f"shard-{i}.partial", self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        return weight_map, self.total_bytes


def _check_replaceable(path: Path) -> None:
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if any(path.iterdir()) and not (path / CONFIG_FILE).is_file():
        raise FileExistsError(f"{path} is a non-empty directory without {CONFIG_FILE}: not replacing it")


def _replace(staging: Path, path: Path) -> None:
    """Move the finished `staging` directory to `path`; a previous `path` is removed only afterwards."""
    if path.exists():
        retired = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, retired)
        os.rename(staging, path)
        shutil.rmtree(retired)
    else:
        os.rename(staging, path)
    fsync_path(path.parent)


def _write_json(file: Path, value: dict) -> None:
    file.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    fsync_path(file)
