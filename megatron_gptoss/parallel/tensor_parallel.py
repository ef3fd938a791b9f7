"""Tensor parallelism (Megatron style) with optional sequence parallelism, applied by module swaps.

One transformer layer on the `tp` ranks of a tensor-parallel group (SP = sequence parallel):

    x [B, T, H] replicated            (SP: [B, T/tp, H], this rank's chunk of the tokens)
    └ linear_qkv   RMSNorm (replicated weight) -> copy_to_tp  (SP: all-gather the tokens)
                   -> the QKV rows of this rank's num_query_groups/tp KV groups (contiguous rows)
    └ attention    this rank's num_attention_heads/tp heads and their sinks, the full sequence
    └ linear_proj  the columns of those heads -> all-reduce (SP: reduce-scatter the tokens) -> + bias
    └ MoE          see `expert_parallel` (tokens split over tp either way)
    embedding      rows [r * V/tp, (r+1) * V/tp) of the padded vocabulary -> all-reduce (SP: reduce-scatter)
    final norm     SP only: RMSNorm then all-gather, so `hidden_states` is full and replicated

LoRA adapters follow their layer: linear_qkv (column parallel) keeps `lora.a` [r, H] replicated and
shards `lora.b` [out, r] by rows like its weight; linear_proj (row parallel) shards `lora.a` [r, in] by
columns and keeps `lora.b` [H, r] replicated, its partial B A x added to the base's partial product
before the one all-reduce (SP: reduce-scatter). The replicated halves get rank-partial gradients (tagged
below).

Every sharded parameter carries a `ShardSpec` (dim 0 of linear_qkv weight/bias, of the sinks and of the
embedding (vocab=True), dim 1 of linear_proj weight). Replicated parameters whose gradient is computed
from this rank's tokens only carry the `partial over tp` tag: the norms and linear_proj's bias under
sequence parallelism, and the router (see `expert_parallel`). `all_reduce_partial_grads_over_tp` sums
those gradients after the backward, before the optimizer (Megatron's finalize step does the same).

Batch-invariant mode (`ops.batch_invariant`): the layers' GEMMs are its kernels (each output element a
function of its own input row and weight row, so a column shard computes the very bits of the unsharded
product), and the row-parallel sum and reduce-scatter add the ranks' partials in rank order
(`collectives`): a decode step's all-reduce and a sequence-parallel training forward's reduce-scatter give
a token the same bits at the same tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.attention import LayerNormLinear, SelfAttention
from megatron_gptoss.model.gpt_oss import Decoder, Embedding, TransformerLayer
from megatron_gptoss.model.lora import active
from megatron_gptoss.model.norm import RMSNorm, rms_norm
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.collectives import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_to_replicated,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import ShardSpec, local_shard, set_shard

_PARTIAL_ATTR = "_megatron_gptoss_partial_over_tp"
SEQUENCE_DIM = 1  # activations are [B, T, H]; sequence parallelism splits T


# -------------------------------------------------------------------------------------------------
# Replicated parameters with rank-partial gradients
def set_partial_over_tp(param: Tensor) -> None:
    """Mark a replicated parameter whose gradient on each tp rank covers only that rank's tokens."""
    setattr(param, _PARTIAL_ATTR, True)


def is_partial_over_tp(param: Tensor) -> bool:
    return getattr(param, _PARTIAL_ATTR, False)


@torch.no_grad()
def all_reduce_partial_grads_over_tp(model: nn.Module, dims: ParallelDims) -> None:
    """Sum the gradients of every `partial over tp` parameter over the tp group (one collective per
    dtype). Afterwards those gradients are identical on every tp rank. A missing gradient counts as 0."""
    if dims.tp == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad and is_partial_over_tp(p)]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dims.group("tp"))
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def swap_module(root: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the submodule at the dotted `path` below `root` by `new`."""
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent), attr, new)


def _sharded(
    full: Tensor, spec: ShardSpec, dims: ParallelDims, padded_rows: int | None = None
) -> nn.Parameter:
    """A new parameter holding this rank's shard of `full` (meta stays meta), tagged with `spec`."""
    param = nn.Parameter(local_shard(full.detach(), spec, dims, padded_rows).clone(), full.requires_grad)
    set_shard(param, spec)
    return param


# -------------------------------------------------------------------------------------------------
# Parallel modules
class ColumnParallelLayerNormLinear(nn.Module):
    """`linear_qkv` of one tp rank: `layer_norm_weight` [H] replicated, `weight` [out/tp, H] and
    `bias` [out/tp] this rank's contiguous rows. x [B, T, H] (SP: [B, T/tp, H]) -> [B, T, out/tp]."""

    def __init__(self, full: LayerNormLinear, dims: ParallelDims):
        super().__init__()
        self.eps, self.group, self.sequence_parallel = full.eps, dims.group("tp"), dims.sequence_parallel
        self.layer_norm_weight = full.layer_norm_weight
        if self.sequence_parallel:
            set_partial_over_tp(self.layer_norm_weight)
        spec = ShardSpec(0, "tp")
        self.weight = _sharded(full.weight, spec, dims)
        self.bias = None if full.bias is None else _sharded(full.bias, spec, dims)
        self.lora = full.lora
        if self.lora is not None:  # a [r, H] replicated (partial over tp), b [out/tp, r] this rank's rows
            set_partial_over_tp(self.lora.a)
            self.lora.b = _sharded(self.lora.b, spec, dims)

    def forward(self, x: Tensor) -> Tensor:
        h = rms_norm(x, self.layer_norm_weight, self.eps)
        if self.sequence_parallel:
            h = gather_from_sequence_parallel(h, self.group, SEQUENCE_DIM)
        else:
            h = copy_to_tensor_parallel(h, self.group)
        y = batch_invariant.linear(h, self.weight, self.bias)
        lora = active(self.lora)
        return y if lora is None else y + lora(h)


class RowParallelLinear(nn.Module):
    """`linear_proj` of one tp rank: `weight` [H, in/tp] this rank's columns, `bias` [H] replicated.
    x [B, T, in/tp] -> [B, T, H] replicated (SP: [B, T/tp, H], this rank's tokens)."""

    def __init__(self, full: nn.Linear, dims: ParallelDims):
        super().__init__()
        self.group, self.sequence_parallel = dims.group("tp"), dims.sequence_parallel
        self.weight = _sharded(full.weight, ShardSpec(1, "tp"), dims)
        self.bias = full.bias
        if self.bias is not None and self.sequence_parallel:
            set_partial_over_tp(self.bias)
        self.lora = getattr(full, "lora", None)
        if self.lora is not None:  # a [r, in/tp] this rank's columns, b [H, r] replicated (partial over tp)
            self.lora.a = _sharded(self.lora.a, ShardSpec(1, "tp"), dims)
            set_partial_over_tp(self.lora.b)

    def forward(self, x: Tensor) -> Tensor:
        y = batch_invariant.linear(x, self.weight)
        lora = active(self.lora)
        if lora is not None:  # this rank's partial B A x, summed with the base's partial product
            y = y + lora(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.group, SEQUENCE_DIM)
        else:
            y = reduce_from_tensor_parallel(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """`weight` [padded_vocab/tp, H]: rows [r * padded_vocab/tp, (r+1) * padded_vocab/tp) on tp rank r.
    ids [B, T] (identical on every tp rank) -> [B, T, H] replicated (SP: [B, T/tp, H], this rank's
    tokens; T must be divisible by tp)."""

    def __init__(self, full: nn.Embedding, padded_rows: int, dims: ParallelDims):
        super().__init__()
        self.group, self.sequence_parallel, self.tp = dims.group("tp"), dims.sequence_parallel, dims.tp
        self.weight = _sharded(full.weight, ShardSpec(0, "tp", vocab=True), dims, padded_rows)
        self.vocab_start = dims.coord("tp") * self.weight.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        if self.sequence_parallel and ids.shape[SEQUENCE_DIM] % self.tp:
            raise ValueError(
                f"sequence parallelism splits the {ids.shape[SEQUENCE_DIM]} tokens of a row over "
                f"tp={self.tp} ranks: pad or pack rows to a multiple of {self.tp} tokens"
            )
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group, SEQUENCE_DIM)
        return reduce_from_tensor_parallel(out, self.group)


class SequenceGatheringRMSNorm(nn.Module):
    """The final norm under sequence parallelism: `weight` [H] replicated (partial over tp);
    x [B, T/tp, H] this rank's tokens -> normalised [B, T, H], full and replicated."""

    def __init__(self, full: RMSNorm, dims: ParallelDims):
        super().__init__()
        self.eps, self.group, self.tp = full.eps, dims.group("tp"), dims.tp
        self.weight = full.weight
        set_partial_over_tp(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        h = rms_norm(x, self.weight, self.eps)
        return gather_to_replicated(h, self.group, SEQUENCE_DIM, h.shape[SEQUENCE_DIM] * self.tp)


# -------------------------------------------------------------------------------------------------
def _shard_attention(attn: SelfAttention, dims: ParallelDims) -> None:
    tp = dims.tp
    swap_module(attn, "linear_qkv", ColumnParallelLayerNormLinear(attn.linear_qkv, dims))
    attn.core_attention.softmax_offset = _sharded(
        attn.core_attention.softmax_offset, ShardSpec(0, "tp"), dims
    )
    swap_module(attn, "linear_proj", RowParallelLinear(attn.linear_proj, dims))
    attn.num_heads, attn.num_groups = attn.num_heads // tp, attn.num_groups // tp


def apply_tensor_parallel(model: nn.Module, config: ModelConfig, dims: ParallelDims) -> None:
    """Swap, in place, every attention block, embedding and (under SP) the final norm of `model` (a
    GPTOSSModel or a pipeline stage of one) for their tensor-parallel versions; weights already in the
    model are kept as this rank's shards. The output layer is swapped by `vocab_parallel`. The MoE
    blocks are left to `apply_expert_parallel`. No-op when tp == 1."""
    if dims.tp == 1:
        return
    padded_rows = config.padded_vocab_size(dims.tp)
    for module in list(model.modules()):
        if isinstance(module, SelfAttention):
            _shard_attention(module, dims)
        elif isinstance(module, Embedding):
            embedding = VocabParallelEmbedding(module.word_embeddings, padded_rows, dims)
            swap_module(module, "word_embeddings", embedding)
        elif isinstance(module, TransformerLayer) and dims.sequence_parallel:
            set_partial_over_tp(module.pre_mlp_layernorm.weight)
        elif isinstance(module, Decoder) and dims.sequence_parallel:
            final = getattr(module, "final_layernorm", None)
            if isinstance(final, RMSNorm):
                swap_module(module, "final_layernorm", SequenceGatheringRMSNorm(final, dims))
