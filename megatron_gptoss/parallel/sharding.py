"""How a parameter of a parallelised model relates to its full single-device tensor.

A parallel plan tags each sharded parameter with a `ShardSpec`: the full tensor is cut into equal
contiguous chunks along `dim` over the ranks of group `group` ("tp" or "ep"), and this rank holds
chunk number `dims.coord(group)`. With `vocab=True` the full tensor's real rows are first padded with
zeros to the layout's padded vocabulary (a multiple of 128 x tp). Untagged parameters are replicated.
Loading (from a full model or an HF slice), gradient gathering in tests, and the bridge's export all
use these tags, so no other code needs to know a layer's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_ATTR = "_megatron_gptoss_shard"


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    group: str  # "tp" or "ep"
    vocab: bool = False


def set_shard(param: torch.Tensor, spec: ShardSpec) -> None:
    setattr(param, _ATTR, spec)


def get_shard(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, _ATTR, None)


def local_shard(
    full: torch.Tensor, spec: ShardSpec | None, dims, padded_rows: int | None = None
) -> torch.Tensor:
    """This rank's piece of `full` (a view where possible). `padded_rows` is required for vocab specs."""
    if spec is None:
        return full
    if spec.vocab:
        if padded_rows is None:
            raise ValueError("a vocab-parallel shard needs padded_rows")
        if full.shape[0] < padded_rows:
            full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
        else:
            full = full[:padded_rows]
    size = dims.tp if spec.group == "tp" else dims.ep
    if full.shape[spec.dim] % size:
        raise ValueError(f"dim {spec.dim} of size {full.shape[spec.dim]} does not split over {size} ranks")
    return full.chunk(size, dim=spec.dim)[dims.coord(spec.group)]


def gather_full(
    local: torch.Tensor, spec: ShardSpec | None, dims, vocab_size: int | None = None
) -> torch.Tensor:
    """Inverse of `local_shard` (collective over the spec's group); vocab padding dropped when given."""
    if spec is None:
        return local
    group = dims.group(spec.group)
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    full = torch.cat(pieces, dim=spec.dim)
    if spec.vocab and vocab_size is not None:
        full = full[:vocab_size]
    return full
