"""Weights straight into this rank's part of a parallel model: an HF GPT-OSS checkpoint (bf16, or MXFP4
experts) read slice by slice, or a random initialisation that does not depend on the layout.

    our parameter name -> its rule in the name table (`hf.names`) -> the HF tensor(s)
    its ShardSpec (dim, group, vocab) -> the rows / columns of those HF tensors that make this rank's chunk
    safetensors `get_slice` reads only them -> `names.from_hf` on the slice (a full import's layout change)

Slicing per layout kind: `same` slices the same dimension; `vocab` slices rows (rows past the real
vocabulary are zero padding); `qkv` slices whole KV groups, read as the q, k and v rows of those groups;
`fc1` / `fc2` / `fc1_bias` slice experts (dim 0; fc1 and fc2 also the hidden dimension); MXFP4 expert
weights slice the experts of their `_blocks` and `_scales`. No process ever reads a whole sharded tensor,
so gpt-oss-120b never sits whole in one process; peak memory is this rank's parameters plus one slice.
`HFTensors` reads full HF tensors already in memory (the bridge's stream into a sharded rollout engine)
through the same slicing: `shard_of_hf` is this rank's chunk of one parameter from its HF tensor(s).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Container, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.io import BLOCKS, SCALES, open_shard, weight_map_of
from megatron_gptoss.hf.mxfp4 import packed_shapes, quantize_mxfp4, unpack_expert_weight
from megatron_gptoss.hf.names import Match, fc1_rows_from_hf, from_hf, hf_shapes, match_ours
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight, mxfp4_weights
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import ShardSpec, get_shard, local_shard

# Our dimension -> HF dimension, per layout kind (absent: that dimension cannot be sliced).
_HF_DIM = {
    "vocab": {0: 0},
    "qkv": {0: 0},
    "fc1": {0: 0, 2: 1},
    "fc1_bias": {0: 0},
    "fc2": {0: 0, 1: 2, 2: 1},
}


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate every meta parameter of `model` on `device`, uninitialised, keeping its tags (ShardSpec,
    gradient group); meta buffers (MXFP4 expert weights) are allocated zeroed, the others move to `device`
    with their values."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                new = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                new.__dict__.update(param.__dict__)
                setattr(module, name, new)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros_like(buffer, device=device)
            elif buffer is not None:
                module._buffers[name] = buffer.to(device)


# ------------------------------------------------------------------------------------------------
# HF checkpoints
def chunk_range(spec: ShardSpec | None, local: int, dims: ParallelDims) -> tuple[int, int]:
    """[start, stop) of this rank's chunk along the spec's dim, in our full tensor's coordinates."""
    if spec is None:
        return 0, local
    start = dims.coord(spec.group) * local
    return start, start + local


class _Reader:
    """Open shard files (once each) and read slices of HF tensors, counting the bytes read."""

    def __init__(self, path: Path, stack: ExitStack):
        self.path, self.stack = path, stack
        self.weight_map = weight_map_of(path)
        self.handles: dict[str, object] = {}
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, name: str, index: tuple[slice, ...], expected: tuple[int, ...]) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"missing tensor {name!r}")
        file = self.weight_map[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(open_shard(self.path, file))
        handle = self.handles[file]
        if name not in handle.keys():  # type: ignore[attr-defined]
            raise CheckpointError(f"tensor {name!r} is listed in the index but absent from {file!r}")
        piece = handle.get_slice(name)  # type: ignore[attr-defined]
        shape = tuple(piece.get_shape())
        if shape != tuple(expected):
            raise CheckpointError(f"tensor {name!r} has shape {shape}, expected {tuple(expected)}")
        tensor = piece[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class HFTensors:
    """Full HF tensors in memory, read like a checkpoint: `read` returns a view of the slice."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, index: tuple[slice, ...], expected: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"missing tensor {name!r}")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != tuple(expected):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
            )
        piece = tensor[index]
        self.bytes_read += piece.numel() * piece.element_size()
        return piece


def shard_of_hf(
    tensors: Mapping[str, torch.Tensor],
    param: torch.Tensor,
    name: str,
    config: ModelConfig,
    dims: ParallelDims,
) -> torch.Tensor:
    """This rank's chunk of our parameter `name` (shaped and tagged like `param`) from its full HF tensors
    (`tensors`: every HF name of its rule, e.g. q, k and v for the fused QKV). Only this rank's rows or
    columns are converted; the result may be a view of the inputs."""
    value = _read_param(HFTensors(tensors), match_ours(name), get_shard(param), param.shape, config, dims)
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{name}: the HF tensors give shape {tuple(value.shape)}, the model has {tuple(param.shape)}"
        )
    return value


def _index(ndim: int, dim: int | None, start: int, stop: int) -> tuple[slice, ...]:
    return tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))


def _read_param(
    reader: _Reader | HFTensors,
    match: Match,
    spec: ShardSpec | None,
    shape: torch.Size,
    config: ModelConfig,
    dims,
) -> torch.Tensor:
    """This rank's chunk of our tensor `match.ours` (shape `shape`), built from HF slices."""
    kind = match.rule.kind
    dim = spec.dim if spec is not None else None
    start, stop = chunk_range(spec, shape[dim] if dim is not None else 0, dims)
    hf_dim = dim if kind == "same" or dim is None else _HF_DIM.get(kind, {}).get(dim)
    if dim is not None and hf_dim is None:
        raise CheckpointError(f"{match.ours}: slicing dim {dim} of a {kind!r} tensor is not supported")
    expected = hf_shapes(match, config)
    if kind == "vocab":
        rows = config.padded_vocab_size(dims.tp) if spec is not None else shape[0]
        start, stop = (start, stop) if spec is not None else (0, rows)
        real = reader.read(match.hf[0], _index(2, 0, start, min(stop, config.vocab_size)), expected[0])
        pad = real.new_zeros(stop - start - real.shape[0], real.shape[1])
        return torch.cat([real, pad]) if pad.shape[0] else real
    if kind == "qkv":
        per, d = config.num_attention_heads // config.num_query_groups, config.head_dim
        size = (per + 2) * d
        if dim is None:
            start, stop = 0, shape[0]
        if start % size or stop % size:
            raise CheckpointError(f"{match.ours}: rows [{start}, {stop}) do not cover whole KV groups")
        g0, g1 = start // size, stop // size
        ranges = ((g0 * per * d, g1 * per * d), (g0 * d, g1 * d), (g0 * d, g1 * d))
        parts = [
            reader.read(name, _index(len(exp), 0, a, b), exp)
            for name, (a, b), exp in zip(match.hf, ranges, expected)
        ]
        local = dataclasses.replace(config, num_attention_heads=per * (g1 - g0), num_query_groups=g1 - g0)
        return from_hf(match, parts, local)
    name = match.hf[0]
    if kind in ("fc1", "fc2") and not reader.has(name) and reader.has(name + BLOCKS):
        return from_hf(match, [_read_mxfp4(reader, name, expected[0], hf_dim, start, stop)], config)
    return from_hf(
        match, [reader.read(name, _index(len(expected[0]), hf_dim, start, stop), expected[0])], config
    )


def _read_mxfp4(
    reader: _Reader | HFTensors, name: str, hf_shape, hf_dim, start: int, stop: int
) -> torch.Tensor:
    """Experts [start, stop) of an MXFP4 expert weight, dequantized to fp32 in the HF orientation."""
    if hf_dim not in (None, 0):
        raise CheckpointError(f"{name}: an MXFP4 expert weight is sliced by experts only")
    shapes = packed_shapes(tuple(hf_shape))
    if shapes is None:
        raise CheckpointError(f"tensor {name + BLOCKS!r}: {name!r} of shape {hf_shape} cannot be MXFP4")
    if hf_dim is None:
        start, stop = 0, hf_shape[0]
    blocks = reader.read(name + BLOCKS, _index(4, 0, start, stop), shapes[0])
    scales = reader.read(name + SCALES, _index(3, 0, start, stop), shapes[1])
    for part, tensor in ((BLOCKS, blocks), (SCALES, scales)):
        if tensor.dtype != torch.uint8:
            raise CheckpointError(
                f"tensor {name + part!r} has dtype {tensor.dtype}, expected torch.uint8 (MXFP4)"
            )
    return unpack_expert_weight(blocks, scales, torch.float32)


@torch.no_grad()
def load_hf_parallel(
    models: Sequence[nn.Module],
    path: str | os.PathLike,
    dims: ParallelDims,
    config: ModelConfig,
    skip: Container[str] = (),
) -> dict[str, int]:
    """Write every parameter of this rank's (parallelised) stage models from the HF directory `path`,
    reading only this rank's slices; parameters named in `skip` (ones without an HF counterpart, such as a
    value head) and LoRA adapters are left as they are. Returns {"tensors": parameters written,
    "bytes_read": bytes read}.
    Raises CheckpointError naming the tensor for a missing tensor or a shape that does not match `config`."""
    written = 0
    with ExitStack() as stack:
        reader = _Reader(Path(path), stack)
        for model in models:
            for name, param in model.named_parameters():
                if name in skip or is_adapter_param(name):
                    continue
                value = _read_param(reader, match_ours(name), get_shard(param), param.shape, config, dims)
                if tuple(value.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{name}: the checkpoint gives shape {tuple(value.shape)}, "
                        f"the model has {tuple(param.shape)}"
                    )
                param.copy_(value)
                written += 1
            for name, weight in mxfp4_weights(model).items():
                blocks, scales = _read_packed(reader, name, weight, config, dims)
                weight.copy_packed_(blocks, scales)
                written += 1
        return {"tensors": written, "bytes_read": reader.bytes_read}


def _expert_range(weight: MXFP4Weight, config: ModelConfig, dims: ParallelDims) -> tuple[int, int]:
    """[start, stop) of the experts an MXFP4 weight holds: all of them, or this ep rank's slice."""
    local = weight.shape[0]
    start = 0 if local == config.num_experts else dims.coord("ep") * local
    return start, start + local


def _read_packed(
    reader: _Reader | HFTensors, name: str, weight: MXFP4Weight, config: ModelConfig, dims: ParallelDims
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of this rank's experts of the MXFP4 weight `name`, our row order: the checkpoint's
    MXFP4 bytes as they are (fc1's rows de-interleaved), or its float experts quantized (`quantize_mxfp4`)."""
    match = match_ours(name)
    hf_name, hf_shape = match.hf[0], hf_shapes(match, config)[0]
    start, stop = _expert_range(weight, config, dims)
    if not reader.has(hf_name + BLOCKS) and reader.has(hf_name):
        dense = reader.read(hf_name, _index(3, 0, start, stop), hf_shape)
        return quantize_mxfp4(from_hf(match, [dense], config))
    shapes = packed_shapes(tuple(hf_shape))
    if shapes is None:
        raise CheckpointError(f"tensor {hf_name + BLOCKS!r}: {hf_name!r} of shape {hf_shape} cannot be MXFP4")
    blocks = reader.read(hf_name + BLOCKS, _index(4, 0, start, stop), shapes[0])
    scales = reader.read(hf_name + SCALES, _index(3, 0, start, stop), shapes[1])
    for part, tensor in ((BLOCKS, blocks), (SCALES, scales)):
        if tensor.dtype != torch.uint8:
            raise CheckpointError(
                f"tensor {hf_name + part!r} has dtype {tensor.dtype}, expected torch.uint8 (MXFP4)"
            )
    if match.rule.kind == "fc1":
        blocks, scales = fc1_rows_from_hf(blocks), fc1_rows_from_hf(scales)
    return blocks, scales


# ------------------------------------------------------------------------------------------------
# Random initialisation
def _generator(seed: int, name: str, device: torch.device, index: int = 0) -> torch.Generator:
    key = zlib.crc32(f"{seed}:{name}:{index}".encode())
    return torch.Generator(device=device).manual_seed(key)


@torch.no_grad()
def init_parallel(
    models: Sequence[nn.Module],
    config: ModelConfig,
    dims: ParallelDims,
    seed: int,
    adapters_only: bool = False,
) -> None:
    """Random weights that are the same full tensors under every layout: a parameter's full tensor comes
    from a generator seeded by (seed, name) (experts: by (seed, name, expert), so a rank draws only its
    experts), and each rank keeps its chunk. Norms 1, biases 0, the rest Normal(0, config.init_std_of(name)),
    padded vocabulary rows 0 (the conventions of `GPTOSSModel.init_weights`); LoRA adapters as `LoRA.reset`: A
    uniform in +-1/sqrt(in), B zero. `adapters_only`: the adapters alone (a base loaded from HF).
    MXFP4 expert weights: each of this rank's experts drawn as its parameter would be (the generator of
    (seed, name, expert)), then quantized once (`quantize_mxfp4`)."""
    for model in models:
        for name, weight in [] if adapters_only else mxfp4_weights(model).items():
            std, device = config.init_std_of(name), weight.device
            start, stop = _expert_range(weight, config, dims)
            for i, e in enumerate(range(start, stop)):
                values = torch.randn(
                    weight.shape[1:], generator=_generator(seed, name, device, e), device=device
                )
                blocks, scales = quantize_mxfp4(values.mul_(std))
                weight.copy_experts_(i, blocks[None], scales[None])
        for name, param in model.named_parameters():
            if adapters_only and not is_adapter_param(name):
                continue
            spec = get_shard(param)
            if name.endswith(("layer_norm_weight", "layernorm.weight")):
                param.fill_(1.0)
                continue
            if name.endswith(".bias") or (is_adapter_param(name) and name.endswith(".b")):
                param.zero_()
                continue
            device = param.device
            adapter = is_adapter_param(name)

            std = config.init_std_of(name)

            def draw(shape, gen, adapter=adapter, device=device, std=std):
                if adapter:  # A [..., r, in]: the bound of the full tensor's input width
                    bound = 1.0 / math.sqrt(shape[-1])
                    return torch.rand(shape, generator=gen, device=device).mul_(2 * bound).sub_(bound)
                return torch.randn(shape, generator=gen, device=device).mul_(std)

            if spec is not None and spec.group == "ep" and spec.dim == 0:
                start, stop = chunk_range(spec, param.shape[0], dims)
                for i, e in enumerate(range(start, stop)):
                    param[i].copy_(draw(param.shape[1:], _generator(seed, name, device, e)))
                continue
            full_shape = _full_shape(name, param, spec, config, dims)
            full = draw(full_shape, _generator(seed, name, device))
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full[config.vocab_size :] = 0
            param.copy_(local_shard(full, spec, dims, config.padded_vocab_size(dims.tp)))


def _full_shape(
    name: str, param: torch.Tensor, spec: ShardSpec | None, config: ModelConfig, dims
) -> list[int]:
    shape = list(param.shape)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        shape[0] = config.padded_vocab_size()
    elif spec is not None:
        shape[spec.dim] *= dims.tp if spec.group == "tp" else dims.ep
    return shape
