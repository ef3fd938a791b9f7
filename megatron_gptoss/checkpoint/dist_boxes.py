"""Where each rank's tensors sit inside the full, unpadded tensors of a sharded checkpoint: pure
arithmetic on boxes (no processes, no tensors), shared by the training save/load and the converters.

A box is a hyper-rectangle (offsets, sizes) of a full tensor. Every stored tensor is the full
single-device tensor with the vocabulary padding removed, so its shape does not depend on the layout:

    parameter (ShardSpec dim d over group g)   box = its chunk along d: offset coord(g) x local size
    vocabulary rows (embedding, output layer)  the chunk's rows past `vocab_size` (padding) are dropped
    optimizer state of a flat range [a, b)     `flat_boxes`: at most 2 x ndim - 1 boxes, each one a
        of a parameter's local tensor          contiguous run of the flat range, shifted like the parameter

Boxes larger than a byte bound are cut along their first dimension of size > 1 (`split_box`); since the
dimensions after it are whole, every cut stays a contiguous run of its tensor.

Who writes what (`writes_param`): a replicated dense parameter is written by the rank with tp = cp = dp
= 0 of its pipeline stage, a tp-sharded one by the cp = dp = 0 rank of each tp position, an expert
parameter by the edp = 0 rank of each ep position; so every element is written exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.hf.names import match_ours
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.value import VALUE_HEAD
from megatron_gptoss.parallel.dims import Layout
from megatron_gptoss.parallel.pipeline import split_layers
from megatron_gptoss.parallel.sharding import ShardSpec


@dataclass(frozen=True)
class Box:
    """offsets[i] <= index[i] < offsets[i] + sizes[i] in every dimension i of a full tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def is_vocab(name: str) -> bool:
    """Whether parameter `name` has vocabulary rows (padded in the model, unpadded in checkpoints)."""
    if name == VALUE_HEAD or is_adapter_param(name):
        return False
    return match_ours(name).rule.kind == "vocab"


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's stored (full, unpadded) shape, in the model's parameter order."""
    model = GPTOSSModel(config, device="meta")
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        out[name] = (config.vocab_size, *shape[1:]) if is_vocab(name) else shape
    return out


def shard_spec_of(name: str, tp: int) -> ShardSpec | None:
    """The ShardSpec `parallelize` gives parameter `name` under tensor-parallel size `tp` (the parallel
    plans of `parallel/`; the distributed tests check the two agree on every rank)."""
    if ".mlp.experts." in name:
        return ShardSpec(0, "ep")
    if tp == 1:
        return None
    if is_vocab(name):
        return ShardSpec(0, "tp", vocab=True)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "softmax_offset", "linear_qkv.lora.b")):
        return ShardSpec(0, "tp")
    if name.endswith(("linear_proj.weight", "linear_proj.lora.a")):
        return ShardSpec(1, "tp")
    return None


def local_box(
    name: str, spec: ShardSpec | None, local_shape: Sequence[int], coords: dict[str, int], vocab_size: int
) -> Box:
    """The box of the full unpadded tensor that a rank's local tensor of parameter `name` holds (its
    real rows only: a vocabulary chunk entirely in the padding gives a box of 0 rows)."""
    offsets = [0] * len(local_shape)
    sizes = list(local_shape)
    if spec is not None:
        offsets[spec.dim] = coords[spec.group] * local_shape[spec.dim]
    if is_vocab(name):
        sizes[0] = max(0, min(sizes[0], vocab_size - offsets[0]))
    return Box(tuple(offsets), tuple(sizes))


def writes_param(spec: ShardSpec | None, coords: dict[str, int]) -> bool:
    """Whether the rank at `coords` writes its copy of a parameter tagged `spec` (module docstring)."""
    if spec is None:
        return coords["tp"] == 0 and coords["dp"] == 0 and coords.get("cp", 0) == 0
    if spec.group == "tp":
        return coords["dp"] == 0 and coords.get("cp", 0) == 0
    return coords["edp"] == 0


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """The flat range [start, stop) of a row-major tensor of `shape` as (flat offset, box) pairs in
    order; each box (in the tensor's own coordinates) is a contiguous run of the range."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [(0, Box((), ()))]
    inner = math.prod(shape[1:])
    out: list[tuple[int, Box]] = []

    def rows_of(row: int, lo: int, hi: int) -> None:
        for offset, box in flat_boxes(shape[1:], lo, hi):
            out.append((row * inner + offset, Box((row, *box.offsets), (1, *box.sizes))))

    first = start // inner
    if start % inner:
        end = min(stop, (first + 1) * inner)
        rows_of(first, start - first * inner, end - first * inner)
        first, start = first + 1, end
    if start >= stop:
        return out
    full_end = stop // inner
    if full_end > first:
        out.append((first * inner, Box((first, *[0] * (len(shape) - 1)), (full_end - first, *shape[1:]))))
    if stop > full_end * inner:
        rows_of(full_end, 0, stop - full_end * inner)
    return out


def split_box(box: Box, itemsize: int, max_bytes: int) -> list[tuple[Box, int, int, int]]:
    """`box` cut into boxes of at most `max_bytes` (one unit of the cut dimension at least) along its
    first dimension of size > 1: (box, dim, start, length) with start/length relative to `box`."""
    if box.numel * itemsize <= max_bytes or box.numel == 0:
        return [(box, 0, 0, box.sizes[0] if box.sizes else 1)]
    dim = next(d for d, s in enumerate(box.sizes) if s > 1)
    unit = math.prod(box.sizes[dim + 1 :]) * itemsize
    step = max(1, max_bytes // unit)
    out = []
    for start in range(0, box.sizes[dim], step):
        length = min(step, box.sizes[dim] - start)
        offsets = list(box.offsets)
        sizes = list(box.sizes)
        offsets[dim] += start
        sizes[dim] = length
        out.append((Box(tuple(offsets), tuple(sizes)), dim, start, length))
    return out


def narrow(tensor: torch.Tensor, box: Box, origin: Sequence[int]) -> torch.Tensor:
    """The view of `tensor` (whose element 0 sits at `origin` of the full tensor) covering `box`."""
    for d, (offset, size) in enumerate(zip(box.offsets, box.sizes)):
        tensor = tensor.narrow(d, offset - origin[d], size)
    return tensor


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One parameter as one rank of a layout holds it."""

    name: str
    spec: ShardSpec | None
    local_shape: tuple[int, ...]


def rank_slots(
    layout: Layout, config: ModelConfig, rank: int, counts: Sequence[int] | None = None
) -> list[Slot]:
    """The parameters rank `rank` of `layout` holds (its pipeline stages'; `counts`: layers per virtual
    stage as `split_layers` takes them), with their ShardSpec and local (padded) shape."""
    coords = layout.coords(rank)
    ranges = split_layers(config.num_layers, layout.pp * layout.vpp, counts)
    stages = [coords["pp"] + c * layout.pp for c in range(layout.vpp)]
    layers = {layer for s in stages for layer in ranges[s]}
    first, last = 0 in stages, layout.pp * layout.vpp - 1 in stages
    padded = config.padded_vocab_size(layout.tp)
    out = []
    for name, shape in full_shapes(config).items():
        if name.startswith("decoder.layers."):
            if int(name.split(".")[2]) not in layers:
                continue
        elif name.startswith("embedding.") and not first:
            continue
        elif not name.startswith("embedding.") and not last:
            continue
        spec = shard_spec_of(name, layout.tp)
        local = list(shape)
        if is_vocab(name):
            local[0] = padded
        if spec is not None:
            local[spec.dim] //= layout.tp if spec.group == "tp" else layout.ep
        out.append(Slot(name, spec, tuple(local)))
    return out
