"""Expert parallelism: the MoE block on a layout with ep ranks per expert group (expert tensor parallel 1).

    x [B, T, H]: replicated over tp (tp > 1 without SP: each tp rank takes its chunk of the B x T
                 tokens, uneven chunks allowed) or already this rank's tokens (SP, or tp == 1)
    └ router       replicated weights; top-k of the logits, softmax over the k (as the model)
    └ dispatch     sort the (token, slot) pairs by expert on the device; experts [r * E/ep, (r+1) * E/ep)
                   live on ep rank r, so the sorted rows are already grouped by destination; exchange
                   the counts per (rank, local expert), read the split sizes on the host (the layer's
                   one sync), then the rows (all-to-all, uneven splits)
    └ experts      regroup the received rows by local expert; fc1 -> clamped SwiGLU -> fc2 (+ biases)
    └ combine      all-to-all back, weight by the router probabilities (fp32), sum the k slots per token
    └ out          tp > 1 without SP: all-gather the tokens so the output is replicated again

Who holds what: ep rank r of an ep group holds the experts above (`linear_fc1`/`linear_fc2` weights,
biases and per-expert LoRA adapters, ShardSpec dim 0 over "ep"; the tag is set for ep == 1 too, marking
expert parameters; MXFP4 weights: the blocks and scales buffers of those experts, untagged).
Ranks of an expert-data-parallel (edp) group hold the same experts and process disjoint tokens, so
expert gradients are summed over edp, dense ones over dp (the data-parallel step). Router gradients
cover this rank's tokens only: they are tagged `partial over tp` when tp > 1.

Load-balancing loss (Switch style; off unless `set_load_balancing_loss` sets a coefficient c > 0):
    aux = c * E / (k * N^2) * sum_e (sum_tokens softmax(logits)_e) * tokens_routed_to_e
over the N tokens of the tp group (counts all-reduced over tp; each rank adds the term of its own
tokens, so the sum over tp ranks is the loss of the whole group). It enters the backward with weight 1
per forward, without changing the model's output; `last_aux_loss` holds this rank's term.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.moe import Experts, MoE, Router
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight
from megatron_gptoss.ops import fused_moe
from megatron_gptoss.parallel.collectives import (
    AsyncAllToAll,
    all_to_all,
    chunk_sizes,
    gather_to_replicated,
    scatter_to_sequence_parallel,
)
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import ShardSpec, local_shard, set_shard
from megatron_gptoss.parallel.tensor_parallel import set_partial_over_tp, swap_module


def load_balancing_loss(logits: Tensor, indices: Tensor, tokens_per_expert: Tensor, coeff: float) -> Tensor:
    """Switch-style auxiliary loss of router `logits` [n, E] with top-k `indices` [n, k]; the counts
    [E] and the token total they imply may cover more tokens than these n (other ranks' tokens)."""
    num_experts, k = logits.shape[-1], indices.shape[-1]
    total = tokens_per_expert.sum() / k
    prob_sums = torch.softmax(logits.float(), dim=-1).sum(0)
    return coeff * num_experts / (k * total * total) * (prob_sums * tokens_per_expert).sum()


class _AttachAuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; the backward gives `aux` a gradient of 1."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones((), device=grad.device)


class ExpertParallelExperts(Experts):
    """This ep rank's `num_experts / ep` experts (global ids [r * E/ep, (r+1) * E/ep) on ep rank r) and
    the token dispatch over the ep group. forward: x [N, H], probs/indices [N, k] -> [N, H]."""

    def __init__(self, full: Experts, config: ModelConfig, dims: ParallelDims, dispatch_chunks: int = 1):
        super().__init__(config, device="meta", num_experts=full.num_experts // dims.ep)
        self.dispatch_chunks = dispatch_chunks
        self.backend = full.backend
        self.group, self.ep, self.total_experts = dims.group("ep"), dims.ep, full.num_experts
        spec = ShardSpec(0, "ep")
        for name in ("linear_fc1", "linear_fc2"):
            # adapters: one per expert, dim 0 too; MXFP4 weights: their blocks and scales buffers
            for path in ("weight", "weight.blocks", "weight.scales", "bias", "lora.a", "lora.b"):
                owner, _, attr = f"{name}.{path}".rpartition(".")
                src = getattr(full.get_submodule(owner), attr) if _has(full, owner) else None
                if isinstance(src, MXFP4Weight):  # its dtype; its buffers follow
                    target = self.get_submodule(f"{name}.weight")
                    assert isinstance(target, MXFP4Weight)
                    target.dtype = src.dtype
                    continue
                if src is not None and attr in ("blocks", "scales"):
                    self.get_submodule(owner).register_buffer(attr, local_shard(src, spec, dims).clone())
                    continue
                if src is not None:
                    param = nn.Parameter(local_shard(src.detach(), spec, dims).clone(), src.requires_grad)
                    set_shard(param, spec)
                    setattr(self.get_submodule(owner), attr, param)

    def forward(self, x: Tensor, probs: Tensor, indices: Tensor) -> Tensor:
        if self.dispatch_chunks > 1 and x.shape[0] >= self.dispatch_chunks:
            return self._chunked(x, probs, indices)
        k, local = indices.shape[1], self.num_experts
        slot_rows, bounds, order = fused_moe.sort_by_expert(indices, self.total_experts)
        send = (bounds[1:] - bounds[:-1]).view(self.ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()  # the one host sync of the layer
        send_splits, recv_splits = sizes[: self.ep], sizes[self.ep :]
        fused = self.fused(x)
        rows = all_to_all(_sorted_rows(x, slot_rows, order, k, fused), self.group, recv_splits, send_splits)
        y = all_to_all(self._local(rows, recv), self.group, send_splits, recv_splits)
        return _combined(y, x, probs, slot_rows, order, k, fused)

    def _local(self, rows: Tensor, recv: Tensor) -> Tensor:
        """The received rows, grouped by (source rank, local expert) with counts recv [ep, local], through
        this rank's experts (which want them grouped by (local expert, source)); outputs in received order."""
        local = self.num_experts
        segment = (
            torch.arange(local, device=rows.device)[None, :] * self.ep
            + torch.arange(self.ep, device=rows.device)[:, None]
        )
        received = rows.shape[0]
        perm = torch.argsort(
            torch.repeat_interleave(segment.reshape(-1), recv.reshape(-1), output_size=received), stable=True
        )
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(received, device=rows.device)
        local_bounds = torch.zeros(local + 1, dtype=torch.int32, device=rows.device)
        local_bounds[1:] = recv.sum(0).cumsum(0)
        y = self.compute(_GatherRows.apply(rows, perm, inverse), local_bounds)
        return _GatherRows.apply(y, inverse, perm)

    def _chunked(self, x: Tensor, probs: Tensor, indices: Tensor) -> Tensor:
        """The tokens in `dispatch_chunks` consecutive chunks, software-pipelined: chunk c + 1's rows travel
        while chunk c's experts run, and chunk c's outputs travel back while chunk c + 1's run (forward and
        backward, `AsyncAllToAll`). One host sync reads every chunk's split sizes. Each output row is the one
        unchunked dispatch gives (the experts see fewer rows per GEMM)."""
        k, local, ep = indices.shape[1], self.num_experts, self.ep
        cuts = chunk_sizes(x.shape[0], self.dispatch_chunks)
        starts = [sum(cuts[:c]) for c in range(len(cuts))]
        plans = [
            fused_moe.sort_by_expert(indices[a : a + n], self.total_experts) for a, n in zip(starts, cuts)
        ]
        send = torch.stack([(bounds[1:] - bounds[:-1]).view(ep, local) for _, bounds, _ in plans], 1)
        recv = torch.empty_like(send)  # [ep (destination / source), chunk, local]
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        sizes = torch.cat([send.sum(2), recv.sum(2)]).tolist()  # the one host sync of the layer
        fused = self.fused(x)
        exchanges = []
        for c in range(len(cuts)):
            send_splits = [sizes[r][c] for r in range(ep)]
            recv_splits = [sizes[ep + r][c] for r in range(ep)]
            exchanges.append(
                (
                    AsyncAllToAll(self.group, recv_splits, send_splits),
                    AsyncAllToAll(self.group, send_splits, recv_splits),
                )
            )

        def dispatch(c: int) -> Tensor:
            slot_rows, _, order = plans[c]
            xc = x[starts[c] : starts[c] + cuts[c]]
            return exchanges[c][0].start(_sorted_rows(xc, slot_rows, order, k, fused))

        def combine(c: int, y: Tensor) -> Tensor:
            slot_rows, _, order = plans[c]
            xc, pc = (t[starts[c] : starts[c] + cuts[c]] for t in (x, probs))
            return _combined(exchanges[c][1].finish(y), xc, pc, slot_rows, order, k, fused)

        outs: list[Tensor] = []
        travelling = dispatch(0)
        returning: Tensor | None = None
        for c in range(len(cuts)):
            arrived = exchanges[c][0].finish(travelling)
            if c + 1 < len(cuts):
                travelling = dispatch(c + 1)
            y = exchanges[c][1].start(self._local(arrived, recv[:, c]))
            if returning is not None:
                outs.append(combine(c - 1, returning))
            returning = y
        assert returning is not None
        outs.append(combine(len(cuts) - 1, returning))
        return torch.cat(outs)


def _sorted_rows(x: Tensor, slot_rows: Tensor, order: Tensor, k: int, fused: bool) -> Tensor:
    """Token rows x [N, H] -> their N * k copies sorted by expert (`sort_by_expert`'s slot_rows / order)."""
    if fused:
        return fused_moe.permute(x, slot_rows, k)
    return x.index_select(0, order // k)  # deterministic backward (see Experts.compute)


def _combined(
    y: Tensor, x: Tensor, probs: Tensor, slot_rows: Tensor, order: Tensor, k: int, fused: bool
) -> Tensor:
    """The experts' sorted outputs y [N * k, H] weighted by the router probabilities and summed per token:
    [N, H] in x's dtype (fp32 weighting)."""
    if fused:
        return fused_moe.unpermute(y, probs, slot_rows)
    y = (y.float() * probs.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


class _GatherRows(torch.autograd.Function):
    """x [M, ...] -> x[perm] for a permutation `perm` with inverse `inverse`; the backward is the inverse
    gather (no scatter, no accumulation)."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class ParallelMoE(nn.Module):
    """The MoE block of one rank: `router` (replicated) and `experts` (this rank's, see the module doc).
    x [B, T, H] -> [B, T, H] in the same distribution as x (replicated, or this rank's tokens)."""

    def __init__(self, router: Router, experts: Experts, dims: ParallelDims):
        super().__init__()
        self.router, self.experts = router, experts
        self.tp_group, self.tp = dims.group("tp"), dims.tp
        self.split_tokens = dims.tp > 1 and not dims.sequence_parallel
        self.aux_loss_coeff = 0.0
        self.last_aux_loss: Tensor | None = None

    def forward(self, x: Tensor, replay: Tensor | None = None) -> Tensor:
        """x as the module doc; replay [tokens, k] (router replay) for every token of the micro-batch, also
        where this rank holds a chunk of them (sequence parallel, or tokens split over tp)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        total = flat.shape[0]
        if self.split_tokens:
            flat = scatter_to_sequence_parallel(flat, self.tp_group, 0)
        if replay is not None and replay.shape[0] != flat.shape[0]:  # this rank's chunk of the tokens
            sizes = chunk_sizes(replay.shape[0], self.tp)
            rank = dist.get_rank(self.tp_group)
            replay = replay[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
        logits, probs, indices = self.router(flat, replay)
        y = self.experts(flat, probs, indices)
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            counts = torch.bincount(indices.reshape(-1), minlength=logits.shape[-1]).float()
            if self.tp > 1:
                dist.all_reduce(counts, group=self.tp_group)
            aux = load_balancing_loss(logits, indices, counts, self.aux_loss_coeff)
            self.last_aux_loss = aux.detach()
            y = _AttachAuxLoss.apply(y, aux)
        if self.split_tokens:
            y = gather_to_replicated(y, self.tp_group, 0, total)
        return y.reshape(shape)


def set_load_balancing_loss(model: nn.Module, coeff: float) -> None:
    """Turn the load-balancing loss on (coeff > 0) or off (0) in every `ParallelMoE` of `model`."""
    if coeff < 0:
        raise ValueError(f"load-balancing loss coefficient must be >= 0, got {coeff}")
    for module in model.modules():
        if isinstance(module, ParallelMoE):
            module.aux_loss_coeff = coeff


def apply_expert_parallel(
    model: nn.Module, config: ModelConfig, dims: ParallelDims, dispatch_chunks: int = 1
) -> None:
    """Swap, in place, every `MoE` of `model` for a `ParallelMoE`: experts sharded over ep (kept whole
    and only tagged when ep == 1), tokens split over tp when tp > 1 without SP, router gradients tagged
    partial over tp when tp > 1. Weights already in the model are kept as this rank's shards.
    `dispatch_chunks` > 1: each layer's tokens go in that many chunks whose exchanges overlap the other
    chunks' expert GEMMs (`ExpertParallelExperts._chunked`)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, MoE):
            continue
        experts = (
            module.experts
            if dims.ep == 1
            else ExpertParallelExperts(module.experts, config, dims, dispatch_chunks)
        )
        for p in experts.parameters():
            set_shard(p, ShardSpec(0, "ep"))
        if dims.tp > 1:
            for p in module.router.parameters():
                set_partial_over_tp(p)
        swap_module(model, name, ParallelMoE(module.router, experts, dims))
