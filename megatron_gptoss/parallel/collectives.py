"""Collectives of tensor, sequence and expert parallelism as small named autograd functions.

Every function takes its process group explicitly. Conventions for the regions they connect:

    replicated  every rank of the group holds the same full tensor, and its gradient must come out
                identical (the full gradient) on every rank
    partial     every rank holds a summand of the true tensor (row-parallel output, vocab-parallel lookup)
    sharded     every rank holds its own chunk of a dimension (sequence parallel: tokens, dim 1 of
                [B, T, H]; token split before the experts: dim 0 of [N, H])

| function                              | forward                       | backward                      |
|---------------------------------------|-------------------------------|-------------------------------|
| copy_to_tensor_parallel               | identity (replicated in)      | all-reduce                    |
| reduce_from_tensor_parallel           | all-reduce (partial -> repl.) | identity                      |
| scatter_to_sequence_parallel          | keep own chunk (repl. -> sh.) | all-gather                    |
| gather_from_sequence_parallel         | all-gather (sh. -> TP input)  | reduce-scatter                |
| gather_to_replicated                  | all-gather (sh. -> repl.)     | keep own chunk                |
| reduce_scatter_to_sequence_parallel   | reduce-scatter (partial -> sh)| all-gather                    |
| gather_from_tensor_parallel           | all-gather on the last dim    | keep own chunk                |
| all_to_all                            | all-to-all, uneven splits     | all-to-all, splits swapped    |

Chunks follow `torch.tensor_split`: with n rows over w ranks the first n % w ranks hold one row more.
`scatter_to_sequence_parallel` and `gather_to_replicated` accept such uneven chunks; the others need a
dimension divisible by the group size.

While the batch-invariant mode is on (`ops.batch_invariant`, bitwise on-policy RL), the forwards of
`reduce_from_tensor_parallel` and `reduce_scatter_to_sequence_parallel` sum the partials in one fixed order:
every rank's partial is all-gathered and the ranks' terms are added in rank order, ((p0 + p1) + p2) + ...
(a library all-reduce picks its order, ring or tree, by message size). The sum of an element is then the
same bits in an all-reduce of a decode step and in a reduce-scatter of a training forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_gptoss.ops import batch_invariant


def all_gather_into(out: Tensor, local: Tensor, group: ProcessGroup) -> None:
    """out <- the `local` tensors of every rank of `group` concatenated along dim 0, in rank order.
    (`all_gather_single` in newer torch, `all_gather_into_tensor` before it.)"""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def reduce_scatter_into(out: Tensor, full: Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    """out <- chunk `rank` (dim 0) of the sum of `full` over `group`.
    (`reduce_scatter_single` in newer torch, `reduce_scatter_tensor` before it.)"""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, op=op, group=group)


def chunk_sizes(total: int, parts: int) -> list[int]:
    """Sizes of `torch.tensor_split(range(total), parts)`: the first `total % parts` get one more."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _ordered_sum(x: Tensor, group: ProcessGroup) -> Tensor:
    """The sum over `group` of every rank's x, its terms added in rank order (the module doc); replicated."""
    world = dist.get_world_size(group)
    parts = x.new_empty(world, *x.shape)
    all_gather_into(parts.view(world, -1), x.contiguous().view(1, -1), group)
    out = parts[0].clone()
    for r in range(1, world):
        out += parts[r]
    return out


def _sum_forward(x: Tensor, group: ProcessGroup) -> Tensor:
    """The all-reduce of a forward: in rank order while the batch-invariant mode is on."""
    return _ordered_sum(x, group) if batch_invariant.active() else _all_reduce(x, group)


def _own_chunk(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    sizes = chunk_sizes(x.shape[dim], dist.get_world_size(group))
    return x.tensor_split(len(sizes), dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: Tensor, group: ProcessGroup, dim: int, total: int | None = None) -> Tensor:
    """Concatenate every rank's chunk along `dim`; `total` (the gathered size) allows uneven chunks."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    local = x.movedim(dim, 0).contiguous()
    sizes = chunk_sizes(total, world) if total is not None else [local.shape[0]] * world
    if sizes[dist.get_rank(group)] != local.shape[0]:
        raise ValueError(f"rank holds {local.shape[0]} rows along dim {dim}, expected {sizes}")
    top = max(sizes)
    if local.shape[0] < top:
        local = torch.cat([local, local.new_zeros(top - local.shape[0], *local.shape[1:])])
    out = local.new_empty(world * top, *local.shape[1:])
    all_gather_into(out, local, group)
    if min(sizes) < top:
        out = torch.cat([out[r * top : r * top + n] for r, n in enumerate(sizes)])
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: Tensor, group: ProcessGroup, dim: int, ordered: bool = False) -> Tensor:
    """This rank's chunk along `dim` of the sum over `group`; `ordered`: the terms added in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {world} ranks")
    if ordered:
        total = _ordered_sum(x, group)
        return total.chunk(world, dim)[dist.get_rank(group)].contiguous()
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty(full.shape[0] // world, *full.shape[1:])
    reduce_scatter_into(out, full, group)
    return out.movedim(0, dim).contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        return _sum_forward(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim, ctx.total = group, dim, x.shape[dim]
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim, ctx.total), None, None


class GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class GatherToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, dim: int, total: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim, total)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_chunk(grad, ctx.group, ctx.dim), None, None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim, ordered=batch_invariant.active())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, group: ProcessGroup, output_splits: list[int], input_splits: list[int]
    ) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty(sum(ctx.input_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return back, None, None, None


class Pending:
    """The work handle of an asynchronous collective, from the autograd node that starts it to the one that
    waits for it."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None

    def wait(self) -> None:
        if self.work is None:
            raise RuntimeError("no collective pending: its start did not run before its wait")
        self.work.wait()  # on NCCL the current stream waits; the host does not
        self.work = None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, forward: Pending, backward: Pending):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.pending = backward
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        forward.work = dist.all_to_all_single(
            out, x.contiguous(), output_splits, input_splits, group=group, async_op=True
        )
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty(sum(ctx.input_splits), *grad.shape[1:])
        ctx.pending.work = dist.all_to_all_single(
            back, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group, async_op=True
        )
        return back, None, None, None, None, None


class _Wait(torch.autograd.Function):
    """Identity; the forward waits for `forward`'s collective, the backward for `backward`'s (either may be
    None)."""

    @staticmethod
    def forward(ctx, x: Tensor, forward: Pending | None, backward: Pending | None) -> Tensor:
        if forward is not None:
            forward.wait()
        ctx.pending = backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.pending is not None:
            ctx.pending.wait()
        return grad, None, None


class AsyncAllToAll:
    """`all_to_all` split in two so that other work runs while the rows travel, forward and backward:

        handle = AsyncAllToAll(group, output_splits, input_splits)
        out = handle.start(x)     # the exchange is under way; do not read `out` yet
        ...                       # other work (on NCCL it overlaps the exchange on the GPU)
        out = handle.finish(out)  # now `out` holds the rows received

    In the backward the gradient's exchange starts where `finish` was and is waited for where `start` was,
    so the autograd nodes recorded between the two (other chunks' work) run while it travels."""

    def __init__(self, group: ProcessGroup, output_splits: list[int], input_splits: list[int]):
        self.group, self.output_splits, self.input_splits = group, output_splits, input_splits
        self.forward, self.backward = Pending(), Pending()

    def start(self, x: Tensor) -> Tensor:
        x = _Wait.apply(x, None, self.backward)
        return _StartAllToAll.apply(
            x, self.group, self.output_splits, self.input_splits, self.forward, self.backward
        )

    def finish(self, out: Tensor) -> Tensor:
        return _Wait.apply(out, self.forward, None)


def copy_to_tensor_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """Replicated input of a tensor-parallel computation: identity; the backward sums the ranks'
    partial input gradients (all-reduce)."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """Partial sums on every rank -> their sum, replicated (all-reduce); the backward is the identity."""
    return ReduceFromTensorParallel.apply(x, group)


def scatter_to_sequence_parallel(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """Replicated x -> this rank's chunk along `dim` (uneven chunks allowed); backward all-gathers."""
    return ScatterToSequenceParallel.apply(x, group, dim)


def gather_from_sequence_parallel(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """Sequence-sharded x -> the full sequence as the input of a tensor-parallel computation (all-gather);
    the backward reduce-scatters the ranks' partial gradients."""
    return GatherFromSequenceParallel.apply(x, group, dim)


def gather_to_replicated(x: Tensor, group: ProcessGroup, dim: int, total: int) -> Tensor:
    """Sharded x (chunks of `chunk_sizes(total, world)` along `dim`) -> the full tensor, replicated; the
    backward keeps this rank's chunk of the (replicated) gradient."""
    return GatherToReplicated.apply(x, group, dim, total)


def reduce_scatter_to_sequence_parallel(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """Partial sums of the full sequence -> this rank's chunk of their sum (reduce-scatter along `dim`);
    the backward all-gathers."""
    return ReduceScatterToSequenceParallel.apply(x, group, dim)


def gather_from_tensor_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """Chunks of the last dim (e.g. vocab-parallel logits) -> concatenated on every rank; the backward
    keeps this rank's chunk of the (replicated) gradient."""
    return GatherToReplicated.apply(x, group, x.dim() - 1, x.shape[-1] * dist.get_world_size(group))


def all_to_all(x: Tensor, group: ProcessGroup, output_splits: list[int], input_splits: list[int]) -> Tensor:
    """Rows x[sum(input_splits[:r]) : ...] go to rank r; returns the rows received, grouped by source rank
    (output_splits[r] from rank r). Differentiable: the backward sends the gradients back."""
    return AllToAll.apply(x, group, output_splits, input_splits)
