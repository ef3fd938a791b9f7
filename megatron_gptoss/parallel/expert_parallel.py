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
expert parameters).
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
from megatron_gptoss.ops import fused_moe
from megatron_gptoss.parallel.collectives import (
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

    def __init__(self, full: Experts, config: ModelConfig, dims: ParallelDims):
        super().__init__(config, device="meta", num_experts=full.num_experts // dims.ep)
        self.backend = full.backend
        self.group, self.ep, self.total_experts = dims.group("ep"), dims.ep, full.num_experts
        spec = ShardSpec(0, "ep")
        for name in ("linear_fc1", "linear_fc2"):
            for path in ("weight", "bias", "lora.a", "lora.b"):  # adapters: one per expert, dim 0 too
                owner, _, attr = f"{name}.{path}".rpartition(".")
                src = getattr(full.get_submodule(owner), attr) if _has(full, owner) else None
                if src is not None:
                    param = nn.Parameter(local_shard(src.detach(), spec, dims).clone(), src.requires_grad)
                    set_shard(param, spec)
                    setattr(self.get_submodule(owner), attr, param)

    def forward(self, x: Tensor, probs: Tensor, indices: Tensor) -> Tensor:
        k, local = indices.shape[1], self.num_experts
        slot_rows, bounds, order = fused_moe.sort_by_expert(indices, self.total_experts)
        send = (bounds[1:] - bounds[:-1]).view(self.ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()  # the one host sync of the layer
        send_splits, recv_splits = sizes[: self.ep], sizes[self.ep :]
        fused = self.fused(x)
        if fused:
            rows = fused_moe.permute(x, slot_rows, k)
        else:
            rows = x.index_select(0, order // k)  # deterministic backward (see Experts.compute)
        rows = all_to_all(rows, self.group, recv_splits, send_splits)
        # received rows are grouped by (source rank, local expert); compute wants (local expert, source)
        segment = (
            torch.arange(local, device=x.device)[None, :] * self.ep
            + torch.arange(self.ep, device=x.device)[:, None]
        )
        received = sum(recv_splits)
        perm = torch.argsort(
            torch.repeat_interleave(segment.reshape(-1), recv.reshape(-1), output_size=received), stable=True
        )
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(received, device=x.device)
        local_bounds = torch.zeros(local + 1, dtype=torch.int32, device=x.device)
        local_bounds[1:] = recv.sum(0).cumsum(0)
        y = _GatherRows.apply(
            self.compute(_GatherRows.apply(rows, perm, inverse), local_bounds), inverse, perm
        )
        y = all_to_all(y, self.group, send_splits, recv_splits)
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


def apply_expert_parallel(model: nn.Module, config: ModelConfig, dims: ParallelDims) -> None:
    """Swap, in place, every `MoE` of `model` for a `ParallelMoE`: experts sharded over ep (kept whole
    and only tagged when ep == 1), tokens split over tp when tp > 1 without SP, router gradients tagged
    partial over tp when tp > 1. Weights already in the model are kept as this rank's shards."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, MoE):
            continue
        experts = module.experts if dims.ep == 1 else ExpertParallelExperts(module.experts, config, dims)
        for p in experts.parameters():
            set_shard(p, ShardSpec(0, "ep"))
        if dims.tp > 1:
            for p in module.router.parameters():
                set_partial_over_tp(p)
        swap_module(model, name, ParallelMoE(module.router, experts, dims))
