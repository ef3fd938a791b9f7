"""What one rank of a parallel run puts into a sharded checkpoint, and how it takes it back, in a form
that does not depend on the layout (see `dist_boxes`).

    <prefix>/<name>              parameters of the model chunks under `prefix` ("model", "reference"),
                                 in their dtype, full unpadded shape
    optim/master/<name>          the distributed optimizer's fp32 master weights,
    optim/exp_avg/<name>         AdamW's first and second moments: each parameter's full unpadded
    optim/exp_avg_sq/<name>      shape, fp32, whatever the bucket layout and dp sharding
    blobs                        `rng_state()` of each rank, the optimizer's step counts

Who writes what: parameters as `dist_boxes.writes_param` says; optimizer state by the rank that owns it
in the distributed optimizer (its [lo, hi) of each bucket; every rank 1/g of the bucket when the state
is not sharded), replicated-over-tp parameters' state by tp rank 0 only. So every element is written by
one rank, and a rank writes nothing it does not hold.

Who reads what: every rank reads all it holds (its parameters, its whole optimizer range) from whatever
chunks the checkpoint has. Vocabulary padding rows are zero after a load, as after initialisation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_gptoss.checkpoint.dist_boxes import (
    Box,
    flat_boxes,
    is_vocab,
    local_box,
    split_box,
    writes_param,
)
from megatron_gptoss.checkpoint.dist_planner import Piece, Target
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.sharding import ShardSpec, get_shard

OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


def _pieces(
    fqn: str,
    shape: tuple[int, ...],
    box: Box,
    view: torch.Tensor,
    max_bytes: int,
) -> list[Piece]:
    """`view` (= box of the full tensor) cut into pieces of at most `max_bytes`."""
    out = []
    for sub, dim, start, length in split_box(box, view.element_size(), max_bytes):
        part = view.narrow(dim, start, length) if view.dim() else view
        out.append(Piece(fqn, shape, sub, view.dtype, part))
    return out


# ------------------------------------------------------------------------------------------------
# Parameters
def module_pieces(
    prefix: str,
    models: Sequence[nn.Module],
    coords: dict[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    vocab_size: int,
    max_bytes: int,
    adapters_only: bool = False,
) -> list[Piece]:
    """The pieces of the parameters of `models` this rank writes (views of the parameters); only the LoRA
    adapters' with `adapters_only`."""
    out = []
    for model in models:
        for name, p in model.named_parameters():
            if adapters_only and not is_adapter_param(name):
                continue
            spec = get_shard(p)
            if not writes_param(spec, coords):
                continue
            box = local_box(name, spec, p.shape, coords, vocab_size)
            view = p.detach()[: box.sizes[0]] if is_vocab(name) else p.detach()
            out += _pieces(f"{prefix}/{name}", shapes[name], box, view, max_bytes)
    return out


def module_targets(
    prefix: str,
    models: Sequence[nn.Module],
    coords: dict[str, int],
    vocab_size: int,
    adapters_only: bool = False,
) -> list[Target]:
    """Every parameter of `models` (only the LoRA adapters with `adapters_only`) as a load target (padding
    rows zeroed now; the load fills the rest)."""
    out = []
    for model in models:
        for name, p in model.named_parameters():
            if adapters_only and not is_adapter_param(name):
                continue
            box = local_box(name, get_shard(p), p.shape, coords, vocab_size)
            data = p.data
            if is_vocab(name):
                data[box.sizes[0] :].zero_()
                data = data[: box.sizes[0]]
            out.append(Target(f"{prefix}/{name}", box, data))
    return out


# ------------------------------------------------------------------------------------------------
# Distributed optimizer
@dataclass(frozen=True)
class _Run:
    """A flat run of one parameter inside one bucket's optimizer range: `box` of the full tensor is
    elements [at, at + box.numel) of the range's flat buffers (master, moments)."""

    bucket: int
    name: str
    box: Box
    at: int


def _runs(
    opt: DistributedOptimizer, names: Mapping[int, str], coords: dict[str, int], vocab_size: int, owned: bool
) -> list[_Run]:
    """The runs of every parameter in this rank's optimizer ranges: the range it holds (`owned` False) or
    the part of it this rank writes (`owned` True)."""
    out = []
    for index, b in enumerate(opt.buckets):
        lo, hi = b.lo, b.hi
        if owned and not opt.shard:
            size, rank = dist.get_world_size(b.group), dist.get_rank(b.group)
            per = b.data.numel() // size
            lo, hi = rank * per, (rank + 1) * per
        for i, p in enumerate(b.params):
            spec: ShardSpec | None = get_shard(p)
            if owned and spec is None and coords["tp"] != 0:
                continue  # replicated over tp: tp rank 0 writes it
            start = b.offsets[i]
            first, last = max(start, lo), min(start + p.numel(), hi)
            name = names[id(p)]
            origin = local_box(name, spec, p.shape, coords, vocab_size).offsets
            for flat, box in flat_boxes(p.shape, first - start, last - start):
                offsets = tuple(o + g for o, g in zip(box.offsets, origin))
                sizes = box.sizes
                if is_vocab(name):  # drop padding rows (they end the local tensor)
                    sizes = (max(0, min(sizes[0], vocab_size - offsets[0])), *sizes[1:])
                if all(sizes):
                    out.append(_Run(index, name, Box(offsets, sizes), start + flat - b.lo))
    return out


def param_names(models: Sequence[nn.Module]) -> dict[int, str]:
    return {id(p): name for model in models for name, p in model.named_parameters()}


def optimizer_steps(opt: DistributedOptimizer) -> dict[str, float]:
    """The optimizer's step counts: `step_count` (the lr schedule's) and AdamW's `adam_step` (equal in
    every bucket: all step together)."""
    steps = {float(opt.inner.state[m]["step"]) for m in opt.master if "step" in opt.inner.state[m]}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's buckets disagree on AdamW's step: {sorted(steps)}")
    return {"step_count": opt.step_count, "adam_step": steps.pop() if steps else 0.0}


def optimizer_pieces(
    opt: DistributedOptimizer,
    names: Mapping[int, str],
    coords: dict[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    vocab_size: int,
    max_bytes: int,
    prefix: str = "optim",
) -> list[Piece]:
    """The pieces of the optimizer state this rank writes (views of its buffers; zeros before the first
    step, when AdamW has no moments yet), named `prefix/<state>/<parameter>`."""
    out = []
    for run in _runs(opt, names, coords, vocab_size, owned=True):
        master = opt.master[run.bucket]
        state = opt.inner.state.get(master, {})
        for kind in OPTIM_STATES:
            buffer = master if kind == "master" else state.get(kind)
            if buffer is None:
                view = torch.zeros(run.box.sizes, dtype=torch.float32)
            else:
                view = buffer.detach()[run.at : run.at + run.box.numel].view(run.box.sizes)
            out += _pieces(f"{prefix}/{kind}/{run.name}", shapes[run.name], run.box, view, max_bytes)
    return out


def optimizer_targets(
    opt: DistributedOptimizer,
    names: Mapping[int, str],
    coords: dict[str, int],
    vocab_size: int,
    prefix: str = "optim",
) -> tuple[list[Target], Callable[[Mapping[str, float]], None]]:
    """Load targets for the whole optimizer range of this rank (fresh zeroed buffers) and the function
    that installs them once filled: master weights copied in place, AdamW's moments and step set through
    its `load_state_dict`, `step_count` restored."""
    buffers = [{kind: torch.zeros_like(m, dtype=torch.float32) for kind in OPTIM_STATES} for m in opt.master]
    targets = []
    for run in _runs(opt, names, coords, vocab_size, owned=False):
        for kind in OPTIM_STATES:
            view = buffers[run.bucket][kind][run.at : run.at + run.box.numel].view(run.box.sizes)
            targets.append(Target(f"{prefix}/{kind}/{run.name}", run.box, view))

    @torch.no_grad()
    def install(steps: Mapping[str, float]) -> None:
        for master, loaded in zip(opt.master, buffers):
            master.copy_(loaded["master"])
        state_dict = opt.inner.state_dict()
        state_dict["state"] = {}
        if steps["adam_step"] > 0:
            state_dict["state"] = {
                i: {
                    "step": torch.tensor(float(steps["adam_step"]), dtype=torch.float32),
                    "exp_avg": loaded["exp_avg"],
                    "exp_avg_sq": loaded["exp_avg_sq"],
                }
                for i, loaded in enumerate(buffers)
            }
        opt.inner.load_state_dict(state_dict)
        opt.step_count = int(steps["step_count"])

    return targets, install


@torch.no_grad()
def reset_optimizer(opt: DistributedOptimizer) -> None:
    """Master weights taken from the parameters, no AdamW state, step 0 (a checkpoint without optimizer
    state, such as one converted from HF)."""
    for b, master in zip(opt.buckets, opt.master):
        master.copy_(b.data[b.lo : b.hi])
    opt.inner.state.clear()
    opt.step_count = 0


# ------------------------------------------------------------------------------------------------
# Random streams
def rng_state() -> dict[str, object]:
    """This process's global random streams: torch (CPU and every CUDA device) and Python's `random`."""
    state: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, object]) -> None:
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    python: Any = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]
