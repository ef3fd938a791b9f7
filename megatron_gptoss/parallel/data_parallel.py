"""Data parallelism: gradients summed over the data-parallel ranks (dense parameters: the dp_cp group,
data x context parallel; expert parameters: the expert-data-parallel group edp) and Megatron's
distributed optimizer (ZeRO-1):
AdamW state and fp32 master weights sharded over those groups.

    apply_data_parallel(model, dims)  tags every trainable parameter with the group its gradient is
                                      summed over (the `parallelize` hook; names are the rule)
    DistributedOptimizer(models, ...) lays the parameters of each (model chunk, group, dtype) out in one
                                      flat buffer (parameters become views of it) and accumulates their
                                      gradients in fp32 in a twin buffer (`param.main_grad`)
    step()   1. sum the gradients tagged `partial over tp` over tp (sequence parallel norms, router)
             2. reduce-scatter each gradient buffer over its group (all-reduce when not sharded)
             3. global gradient norm: every element counted once across tp, ep, pp and dp
             4. non-finite norm: the step is skipped with a log line
             5. clip, AdamW on this rank's fp32 master shard
             6. all-gather the updated shards into the parameter buffers

Who holds what, for a buffer of n elements over a group of g ranks, padded to g x s: group rank i
owns elements [i s, (i + 1) s): their fp32 master weights, both Adam moments and, after step 2, their
summed gradient. Every rank holds all parameters of its model chunks (in their dtype). Without
sharding every rank holds the whole buffer's optimizer state.

Gradients are summed, not averaged: each rank's loss is its share of the mini-batch loss (token-mean
over the tokens of all micro-batches and all data-parallel ranks, `rl.ppo_loss.loss_denominators`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_gptoss.config import OptimConfig
from megatron_gptoss.parallel.collectives import all_gather_into, reduce_scatter_into
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.lr_schedule import lr_at
from megatron_gptoss.parallel.sharding import get_shard
from megatron_gptoss.parallel.tensor_parallel import is_partial_over_tp

log = logging.getLogger(__name__)

_GROUP_ATTR = "_megatron_gptoss_grad_group"
_HOOKED_ATTR = "_megatron_gptoss_main_grad_hook"
# Set by zero_grad on non-fp32 parameters: the next gradient is copied into `main_grad`, not added.
_FRESH_ATTR = "_megatron_gptoss_main_grad_fresh"
# Parameter offsets inside a buffer are multiples of this many elements (aligned kernels' operands).
_ALIGN = 64


def grad_group(name: str) -> str:
    """The group a parameter's gradient is summed over: "edp" for experts, "dp_cp" for the rest (the
    context-parallel ranks of a replica hold the same weights and compute gradients of their own tokens)."""
    return "edp" if ".mlp.experts." in name else "dp_cp"


def apply_data_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Tag every trainable parameter of `model` with its gradient group (`grad_group`); returns `model`.
    The reduction and the sharded optimizer state live in `DistributedOptimizer`."""
    for kind in ("dp_cp", "edp"):
        dims.group(kind)  # the groups must exist
    for name, param in model.named_parameters():
        if param.requires_grad:
            setattr(param, _GROUP_ATTR, grad_group(name))
    return model


# ------------------------------------------------------------------------------------------------
# Collectives
def all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> None:
    """In place: x <- sum of x over `group`."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_sum(full: Tensor, shard: Tensor, group: dist.ProcessGroup) -> None:
    """shard <- chunk `group rank` of the sum of `full` over `group` (full = g x shard elements)."""
    if dist.get_world_size(group) > 1:
        reduce_scatter_into(shard, full, group)
    else:
        shard.copy_(full)


def all_gather_shards(shard: Tensor, full: Tensor, group: dist.ProcessGroup) -> None:
    """full <- the shards of every rank of `group`, in group-rank order."""
    if dist.get_world_size(group) > 1:
        all_gather_into(full, shard, group)
    else:
        full.copy_(shard)


# ------------------------------------------------------------------------------------------------
# Elements per piece of the update-ratio norms (16 MB in fp32: the difference's temporary stays cached)
_NORM_PIECE = 1 << 22


@dataclass
class _Bucket:
    """The parameters of one (model chunk, group, dtype) laid out in one flat buffer."""

    params: list[nn.Parameter]
    offsets: list[int]
    group: dist.ProcessGroup
    data: Tensor  # [g * s] parameter dtype; parameters are views
    grad: Tensor  # [g * s] fp32; `main_grad` of the parameters are views
    lo: int  # this rank's shard [lo, hi)
    hi: int
    partial_end: int  # elements [0, partial_end) are partial over tp
    counted_from: int  # elements [counted_from, n) count in the norm on this rank

    def view(self, buffer: Tensor, i: int) -> Tensor:
        p = self.params[i]
        return buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def _is_tp_sharded(param: Tensor) -> bool:
    spec = get_shard(param)
    return spec is not None and spec.group == "tp"


class DistributedOptimizer:
    """AdamW with fp32 master weights for the parameters of `models` (this rank's model chunks, after
    `parallelize` and after their weights are in place), sharded over the gradient groups when `shard`
    (Megatron's distributed optimizer), replicated otherwise. Same update as `rl.optim.MasterWeightAdamW`.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        cfg: OptimConfig,
        dims: ParallelDims,
        total_steps: int,
        shard: bool = True,
    ):
        self.cfg, self.dims, self.total_steps, self.shard = cfg, dims, total_steps, shard
        self.step_count = 0
        self.buckets: list[_Bucket] = []
        for model in models:
            grouped: dict[tuple[str, torch.dtype], list[nn.Parameter]] = {}
            for name, param in model.named_parameters():
                if param.requires_grad:
                    kind = getattr(param, _GROUP_ATTR, grad_group(name))
                    grouped.setdefault((kind, param.dtype), []).append(param)
            for (kind, _), params in sorted(grouped.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                self.buckets.append(self._bucket(params, kind))
        self.master = [b.data[b.lo : b.hi].detach().to(torch.float32, copy=True) for b in self.buckets]
        self.inner = torch.optim.AdamW(
            [m.requires_grad_(True) for m in self.master],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=True,  # one pass per step, no full-size temporaries (CUDA and CPU alike)
        )
        self.zero_grad()

    def _bucket(self, params: list[nn.Parameter], kind: str) -> _Bucket:
        """Order: partial-over-tp replicated, other replicated, tp-sharded; offsets aligned."""
        replicated = [p for p in params if not _is_tp_sharded(p)]
        if any(is_partial_over_tp(p) for p in params if _is_tp_sharded(p)):
            raise ValueError("a tp-sharded parameter cannot be partial over tp")
        partial = [p for p in replicated if is_partial_over_tp(p)]
        ordered = partial + [p for p in replicated if not is_partial_over_tp(p)]
        ordered += [p for p in params if _is_tp_sharded(p)]
        offsets, at = [], 0
        for p in ordered:
            offsets.append(at)
            at += -(-p.numel() // _ALIGN) * _ALIGN

        def end_of(count: int) -> int:
            return offsets[count - 1] + ordered[count - 1].numel() if count else 0

        group = self.dims.group(kind)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        per = -(-at // size)
        device = ordered[0].device
        data = torch.zeros(per * size, dtype=ordered[0].dtype, device=device)
        grad = torch.zeros(per * size, dtype=torch.float32, device=device)
        lo, hi = (rank * per, (rank + 1) * per) if self.shard else (0, per * size)
        # dense parameters not sharded over tp are replicated on the tp ranks: tp rank 0 counts them;
        # expert parameters are unique to each rank of a stage (ep x edp)
        replicated_over_tp = kind == "dp_cp" and self.dims.coord("tp") != 0
        counted_from = end_of(len(replicated)) if replicated_over_tp else 0
        bucket = _Bucket(ordered, offsets, group, data, grad, lo, hi, end_of(len(partial)), counted_from)
        with torch.no_grad():
            for i, p in enumerate(ordered):
                bucket.view(data, i).copy_(p.detach())
                p.data = bucket.view(data, i)
                p.main_grad = bucket.view(grad, i)  # type: ignore[attr-defined]
                if p.dtype != torch.float32 and not getattr(p, _HOOKED_ATTR, False):
                    p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                    setattr(p, _HOOKED_ATTR, True)
        return bucket

    # ----------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the fp32 gradient buffers; fp32 parameters' `.grad` are views of them (autograd adds in
        place), other parameters add theirs through a hook."""
        for b in self.buckets:
            b.grad.zero_()
            for p in b.params:
                p.grad = p.main_grad if p.dtype == torch.float32 else None  # type: ignore[attr-defined]
                setattr(p, _FRESH_ATTR, p.dtype != torch.float32)

    def _check_grads(self) -> None:
        for b in self.buckets:
            for p in b.params:
                main = p.main_grad  # type: ignore[attr-defined]
                linked = p.grad is None if p.dtype != torch.float32 else p.grad is not None
                if not linked or (p.grad is not None and p.grad.data_ptr() != main.data_ptr()):
                    raise RuntimeError(
                        "a parameter's .grad was replaced outside the optimizer; call "
                        "DistributedOptimizer.zero_grad() instead of setting gradients"
                    )

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Steps 1-2: afterwards `b.grad[lo:hi]` of every bucket holds the summed gradient of this rank's
        shard (the whole buffer when not sharded)."""
        self._check_grads()
        for b in self.buckets:
            if self.dims.tp > 1 and b.partial_end:
                all_reduce_sum(b.grad[: b.partial_end], self.dims.group("tp"))
            if self.shard:
                reduce_scatter_sum(b.grad, b.grad[b.lo : b.hi], b.group)
            else:
                all_reduce_sum(b.grad, b.group)

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global L2 norm (fp32) of the reduced gradients, every element of the model counted once.
        Collective over dp_cp then mp (together: the whole world)."""
        device = self.buckets[0].grad.device if self.buckets else torch.device("cpu")
        square = torch.zeros((), dtype=torch.float32, device=device)
        for b in self.buckets:
            size = dist.get_world_size(b.group)
            lo, hi = (b.lo, b.hi) if self.shard else _own_range(b, size)
            lo = max(lo, b.counted_from)
            if hi > lo:
                square += torch.linalg.vector_norm(b.grad[lo:hi]).square()
        all_reduce_sum(square, self.dims.group("dp_cp"))
        all_reduce_sum(square, self.dims.group("mp"))
        return square.sqrt()

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Reduce, clip, update and write back (steps 1-6). A non-finite gradient norm skips the update
        on every rank (the norm is global) and logs it."""
        self.reduce_gradients()
        norm = self.grad_norm()
        lr = lr_at(self.cfg, self.step_count, self.total_steps)
        if not torch.isfinite(norm):
            log.warning(
                "step %d skipped: non-finite gradient norm %s (no parameter or optimizer state changed)",
                self.step_count,
                norm.item(),
            )
            self.zero_grad()
            return {"train/grad_norm": float(norm), "train/lr": lr, "train/skipped": 1.0}
        scale = 1.0
        if self.cfg.clip_grad > 0 and float(norm) > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (float(norm) + 1e-6)
        for b, master in zip(self.buckets, self.master):
            if scale != 1.0:
                b.grad[b.lo : b.hi].mul_(scale)
            master.grad = b.grad[b.lo : b.hi]
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        ratio = self._update_ratio()
        for b, master in zip(self.buckets, self.master):
            master.grad = None
            if self.shard:
                all_gather_shards(master.to(b.data.dtype), b.data, b.group)
            else:
                b.data.copy_(master)
        self.step_count += 1
        self.zero_grad()
        return {
            "train/grad_norm": float(norm),
            "train/lr": lr,
            "train/skipped": 0.0,
            "train/update_ratio": ratio,
        }

    @torch.no_grad()
    def _update_ratio(self) -> float:
        """||new - old|| / ||old|| over the whole model (every element counted once, as in `grad_norm`):
        the updated fp32 master weights against the parameters not yet written back. Collective."""
        device = self.buckets[0].grad.device if self.buckets else torch.device("cpu")
        squares = torch.zeros(2, dtype=torch.float32, device=device)
        for b, master in zip(self.buckets, self.master):
            size = dist.get_world_size(b.group)
            lo, hi = (b.lo, b.hi) if self.shard else _own_range(b, size)
            lo = max(lo, b.counted_from)
            for start in range(lo, hi, _NORM_PIECE):  # pieces: no full-size temporary of the difference
                end = min(start + _NORM_PIECE, hi)
                old = b.data[start:end].float()
                new = master[start - b.lo : end - b.lo]
                squares[0] += torch.linalg.vector_norm(new - old).square()
                squares[1] += torch.linalg.vector_norm(old).square()
        all_reduce_sum(squares, self.dims.group("dp_cp"))
        all_reduce_sum(squares, self.dims.group("mp"))
        delta, old_norm = squares.sqrt().tolist()
        return delta / old_norm if old_norm > 0 else float(delta > 0) * float("inf")

    def state_dict(self) -> dict:
        """This rank's optimizer state: its fp32 master shards, Adam moments and the step count, as
        references (copy to keep them across steps). Valid for the same layout and model; resharding
        across layouts belongs to the checkpoint module."""
        return {
            "inner": self.inner.state_dict(),
            "master": [m.detach() for m in self.master],
            "step": self.step_count,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` and write the master shards back into the parameters (all-gather)."""
        if [tuple(m.shape) for m in state["master"]] != [tuple(m.shape) for m in self.master]:
            raise ValueError("optimizer state of another layout or model: master shard shapes differ")
        self.inner.load_state_dict(state["inner"])
        for b, master, saved in zip(self.buckets, self.master, state["master"]):
            master.copy_(saved)
            if self.shard:
                all_gather_shards(master.to(b.data.dtype), b.data, b.group)
            else:
                b.data.copy_(master)
        self.step_count = state["step"]
        self.zero_grad()


def _own_range(b: _Bucket, size: int) -> tuple[int, int]:
    """The range this rank counts in the norm when every rank holds the whole reduced buffer."""
    per = b.grad.numel() // size
    rank = dist.get_rank(b.group)
    return rank * per, (rank + 1) * per


def _accumulate_main_grad(param: Tensor) -> None:
    """Post-accumulate hook of a non-fp32 parameter: add its gradient to the fp32 `main_grad` (the first
    gradient after `zero_grad` is copied: the same values, one read of `main_grad` fewer)."""
    if getattr(param, _FRESH_ATTR, False):
        param.main_grad.copy_(param.grad)  # type: ignore[attr-defined]
        setattr(param, _FRESH_ATTR, False)
    else:
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
    param.grad = None
