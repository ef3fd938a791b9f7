"""Vocab-parallel output layer: the unembedding split by vocabulary rows over the tp ranks.

Tp rank r holds rows [r * P/tp, (r+1) * P/tp) of the padded vocabulary (P = padded_vocab_size(tp));
rows >= vocab_size are padding and never score (logit -inf, probability 0, gradient 0).

Contract of `VocabParallelOutputLayer` (the `OutputLayer` interface):
    forward(hidden [..., H] replicated) -> this rank's logits shard [..., P/tp], padded columns -inf.
        `gather_logits` concatenates the shards and drops the padding: [..., vocab_size], the
        single-device logits (for tests and evaluation; the training path never needs it).
    logprobs(hidden [..., H] replicated, targets [...] int64 replicated, temperature, chunk_size)
        -> (log-prob [...], entropy [...]) fp32, replicated on every tp rank. Token-chunked; per chunk
        only [chunk, P/tp] logits exist, and the ranks exchange [chunk]-sized statistics: the row max
        (all-reduce MAX), then sum exp, sum exp * z and the target logit (one all-reduce SUM). The
        backward recomputes each chunk and needs no collective besides the all-reduce of the hidden
        gradient. Cross-entropy is -logprob at temperature 1.
        Batch-invariant mode (`ops.batch_invariant`, bitwise on-policy RL): each chunk's logits shards are
        all-gathered instead (every rank's [chunk, P/tp], padding dropped) and reduced as on one device
        (`model.logprobs`: the invariant log-sum-exp of the whole row), so the log-probs are the bits of
        the single-device head and of the embedded engine, which gathers its logits the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megatron_gptoss.model.gpt_oss import OutputLayer
from megatron_gptoss.model.logprobs import (
    accumulate_logit_grads,
    backward_weight,
    check_targets,
    fp32_logits,
    half_gemms,
    normaliser,
    split_logit_grad,
)
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.collectives import (
    all_gather_into,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
)
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import ShardSpec, local_shard, set_shard
from megatron_gptoss.parallel.tensor_parallel import swap_module


def _chunk_logits(h: Tensor, weight: Tensor, inv_temp: float) -> Tensor:
    """Tempered fp32 logits [n, real] of this rank's real vocabulary rows (the fp32 GEMM's values; on CUDA
    half-precision inputs run on the tensor cores with fp32 output, as the single-device head)."""
    return fp32_logits(h, weight).mul_(inv_temp)


def _gathered_chunk_stats(
    h: Tensor, weight: Tensor, targets: Tensor, group: ProcessGroup, inv_temp: float, shard: int, vocab: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The batch-invariant mode's chunk: (logprob, entropy, log-sum-exp) [n] fp32 of h [n, H] from the
    logits of every rank's shard (`shard` rows each, this rank's real ones in `weight`) gathered to
    [n, vocab], reduced as the single-device head reduces them (`model.logprobs`)."""
    world = dist.get_world_size(group)
    local = fp32_logits(h, weight)
    local = nn.functional.pad(local, (0, shard - local.shape[1]), value=float("-inf"))
    parts = local.new_empty(world, *local.shape)
    all_gather_into(parts.view(world, -1), local.reshape(1, -1), group)
    z = parts.permute(1, 0, 2).reshape(h.shape[0], world * shard)[:, :vocab] * inv_temp
    lse = normaliser(z)
    logp = z - lse
    entropy = torch.exp(logp).mul_(logp).sum(-1).neg_()
    return logp.gather(1, targets[:, None]).squeeze(1), entropy, lse.squeeze(1)


class _VocabParallelLogprobs(torch.autograd.Function):
    """hidden [N, H] (replicated), weight [R, H] (this rank's real rows, global ids start + [0, R)),
    targets [N] -> (logprob [N], entropy [N]) fp32. The hidden gradient returned is this rank's partial
    sum; the caller all-reduces it (copy_to_tensor_parallel). `shard`: rows per rank (padding included),
    `vocab`: the real vocabulary (the batch-invariant mode's gather)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        start: int,
        group: ProcessGroup,
        inv_temp: float,
        chunk: int,
        shard: int,
        vocab: int,
    ):
        n, rows = hidden.shape[0], weight.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse_all = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            if batch_invariant.active():
                gathered = _gathered_chunk_stats(
                    hidden[s : s + chunk], weight, targets[s : s + chunk], group, inv_temp, shard, vocab
                )
                for out, value in zip((logprobs, entropy, lse_all), gathered):
                    out[s : s + chunk] = value
                continue
            z = _chunk_logits(hidden[s : s + chunk], weight, inv_temp)
            local_t = targets[s : s + chunk] - start
            mine = (local_t >= 0) & (local_t < rows)
            m = z.amax(-1) if rows else z.new_full((z.shape[0],), float("-inf"))
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            shifted = z - m[:, None]
            e = shifted.exp()
            if rows:
                target = z.gather(1, local_t.clamp(0, rows - 1)[:, None]).squeeze(1)
            else:
                target = z.new_zeros(z.shape[0])
            stats = torch.stack([e.sum(-1), (e * shifted).sum(-1), torch.where(mine, target, 0.0)])
            dist.all_reduce(stats, group=group)
            log_s0 = stats[0].log()
            lse_all[s : s + chunk] = m + log_s0
            logprobs[s : s + chunk] = stats[2] - lse_all[s : s + chunk]
            entropy[s : s + chunk] = log_s0 - stats[1] / stats[0]
        ctx.save_for_backward(hidden, weight, targets, lse_all, entropy)
        ctx.start, ctx.inv_temp, ctx.chunk = start, inv_temp, chunk
        ctx.mark_non_differentiable(targets)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse_all, entropy = ctx.saved_tensors
        inv_temp, chunk, rows = ctx.inv_temp, ctx.chunk, weight.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # a frozen head (LoRA) skips the weight's GEMM and its fp32 buffer
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        half = half_gemms(hidden, weight)
        wf = backward_weight(weight, half)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            logp = _chunk_logits(h, weight, inv_temp) - lse_all[s : s + chunk, None]
            p = logp.exp()
            g_lp = grad_logprobs[s : s + chunk].float()
            g_ent = grad_entropy[s : s + chunk].float()
            # d/dz of g_lp * logp[t] + g_ent * entropy = g_lp (onehot_t - p) - g_ent p (log p + entropy)
            dz = -p * g_lp[:, None] - g_ent[:, None] * p * (logp + entropy[s : s + chunk, None])
            local_t = targets[s : s + chunk] - ctx.start
            mine = (local_t >= 0) & (local_t < rows)
            if rows:
                dz.scatter_add_(1, local_t.clamp(0, rows - 1)[:, None], torch.where(mine, g_lp, 0.0)[:, None])
            dz.mul_(inv_temp)
            rows_out = None if grad_hidden is None else grad_hidden[s : s + chunk]
            accumulate_logit_grads(
                split_logit_grad(dz, h.dtype) if half else dz, h, wf, rows_out, grad_weight
            )
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


class VocabParallelOutputLayer(nn.Module):
    """`weight` [P/tp, H]: this tp rank's rows of the padded unembedding (ShardSpec dim 0, vocab)."""

    def __init__(self, full: OutputLayer, padded_rows: int, dims: ParallelDims):
        super().__init__()
        spec = ShardSpec(0, "tp", vocab=True)
        shard = local_shard(full.weight.detach(), spec, dims, padded_rows).clone()
        self.weight = nn.Parameter(shard, full.weight.requires_grad)
        set_shard(self.weight, spec)
        self.group, self.vocab_size = dims.group("tp"), full.vocab_size
        self.vocab_start = dims.coord("tp") * self.weight.shape[0]
        self.real_rows = max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] replicated -> this rank's logits [..., P/tp]; padded columns are -inf."""
        logits = batch_invariant.linear(copy_to_tensor_parallel(hidden, self.group), self.weight)
        if self.real_rows < self.weight.shape[0]:
            padded = torch.arange(self.weight.shape[0], device=logits.device) >= self.real_rows
            logits = logits.masked_fill(padded, float("-inf"))
        return logits

    def logprobs(self, hidden: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024):
        """(log-prob [...], entropy [...]) fp32 of `targets` under softmax(logits / temperature), computed
        without gathering the vocabulary; identical on every tp rank. Differentiable in hidden and weight."""
        lead = targets.shape
        h = copy_to_tensor_parallel(hidden.reshape(-1, hidden.shape[-1]), self.group)
        t = targets.reshape(-1)
        if h.shape[0] != t.shape[0]:
            raise ValueError(f"hidden has {h.shape[0]} tokens but targets has {t.shape[0]}")
        check_targets(t, self.vocab_size)
        lp, ent = _VocabParallelLogprobs.apply(
            h,
            self.weight[: self.real_rows],
            t,
            self.vocab_start,
            self.group,
            1.0 / temperature,
            chunk_size,
            self.weight.shape[0],
            self.vocab_size,
        )
        return lp.view(lead), ent.view(lead)


def gather_logits(local: Tensor, group: ProcessGroup, vocab_size: int) -> Tensor:
    """Logits shards [..., P/tp] of every tp rank -> [..., vocab_size] on each (padding dropped).
    Differentiable; meant for tests and evaluation."""
    return gather_from_tensor_parallel(local, group)[..., :vocab_size]


def apply_vocab_parallel(model: nn.Module, padded_rows: int, dims: ParallelDims) -> None:
    """Swap every `OutputLayer` of `model` (in place) for a `VocabParallelOutputLayer` keeping this
    rank's rows of its weight. No-op when tp == 1."""
    if dims.tp == 1:
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, OutputLayer):
            swap_module(model, name, VocabParallelOutputLayer(module, padded_rows, dims))
