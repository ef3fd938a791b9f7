"""Shared helpers of the distributed tests (run inside `harness.pool` workers).

A test builds the single-process reference (a seeded tiny GPT-OSS with non-trivial biases, sinks and
norms), a parallel model of the same architecture sharded from it through the ShardSpec tags
(`local_shard`), runs both on the same data and compares per tensor, ||ours - ref|| / ||ref||, after
gathering every sharded tensor to full shape (`gather_full`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_gptoss.config import ModelConfig, ParallelConfig, gpt_oss_tiny
from megatron_gptoss.model import GPTOSSModel, build_model
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard
from megatron_gptoss.parallel.tensor_parallel import all_reduce_partial_grads_over_tp

# Seconds a pool call may take: a rank that fails while the others wait in a collective fails the
# test after this long instead of hanging it.
POOL_TIMEOUT = 120.0


def rel_err(ours: Tensor, ref: Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def tiny_config(**overrides) -> ModelConfig:
    """gpt_oss_tiny on the eager attention backend: 4 heads / 2 KV groups, 4 experts top-2, window 8,
    vocabulary 96 (padded to 128 under tp 2)."""
    return gpt_oss_tiny(attention_backend="eager", **overrides)


def reference_model(seed: int, config: ModelConfig) -> GPTOSSModel:
    """A seeded model whose biases, sinks and norms are perturbed away from their 0 / 1 init."""
    model = build_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def build_dims(config: ModelConfig, **parallel) -> tuple[ParallelConfig, ParallelDims]:
    """ParallelConfig from Megatron-named overrides and its process groups (collective over the world)."""
    cfg = ParallelConfig(**parallel)
    return cfg, ParallelDims.build(cfg, config)


@torch.no_grad()
def load_from_full(model: nn.Module, full: nn.Module, dims: ParallelDims, config: ModelConfig) -> None:
    """Copy into every parameter of the parallel `model` its shard of the same-named full tensor."""
    full_params = dict(full.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(full_params):
        raise AssertionError(f"parameter names differ: {sorted(set(names) ^ set(full_params))}")
    padded = config.padded_vocab_size(dims.tp)
    for name, p in model.named_parameters():
        p.copy_(local_shard(full_params[name], get_shard(p), dims, padded))


def sharded_copy(ref: GPTOSSModel, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """A parallel model of ref's architecture: a differently seeded model, parallelised, then loaded
    from ref shard by shard (so every parameter must be reachable through its tag)."""
    model = parallelize(build_model(ref.config, seed=12345), dims, cfg)
    load_from_full(model, ref, dims, ref.config)
    return model


def gather_tensors(model: nn.Module, dims: ParallelDims, grads: bool) -> dict[str, Tensor]:
    """Every parameter (or gradient) of `model` at full shape, vocabulary padding dropped (collective)."""
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    out = {}
    for name, p in model.named_parameters():
        local = p.grad if grads else p.detach()
        assert local is not None, f"{name} has no gradient"
        out[name] = gather_full(local, get_shard(p), dims, vocab)
    return out


VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def errors(ours: dict[str, Tensor], ref: GPTOSSModel, grads: bool, prefix: str) -> dict[str, float]:
    """Per-tensor relative error of `ours` (full shapes, real vocabulary rows) against the reference's
    parameters or gradients."""
    out = {}
    for name, p in ref.named_parameters():
        r = p.grad if grads else p.detach()
        assert r is not None, f"reference {name} has no gradient"
        if name in VOCAB_PARAMS:
            r = r[: ref.config.vocab_size]
        assert ours[name].shape == r.shape, (name, ours[name].shape, r.shape)
        out[f"{prefix}:{name}"] = rel_err(ours[name], r)
    return out


def finalize_grads(model: nn.Module, dims: ParallelDims) -> None:
    """The gradient reduction of data parallelism in its plainest form: tp-partial gradients summed over
    tp, then expert gradients (ShardSpec group "ep") summed over edp and all others over dp."""
    all_reduce_partial_grads_over_tp(model, dims)
    for p in model.parameters():
        spec = get_shard(p)
        kind = "edp" if spec is not None and spec.group == "ep" else "dp"
        if getattr(dims, kind) > 1 and p.grad is not None:
            dist.all_reduce(p.grad, group=dims.group(kind))


# -------------------------------------------------------------------------------------------------
# Data
@dataclass
class MicroBatch:
    input_ids: Tensor  # [B, T]
    targets: Tensor  # [B, T]
    loss_mask: Tensor  # [B, T] float
    position_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None


def padded_batch(seed: int, vocab: int, rows: int, tokens: int) -> MicroBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=gen)
    targets = torch.randint(0, vocab, (rows, tokens), generator=gen)
    mask = (torch.rand(rows, tokens, generator=gen) < 0.8).float()
    return MicroBatch(ids, targets, mask)


def packed_batch(seed: int, vocab: int, lengths: list[int]) -> MicroBatch:
    """One row of documents of `lengths` with per-document positions and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    targets = torch.randint(0, vocab, (1, total), generator=gen)
    mask = (torch.rand(1, total, generator=gen) < 0.8).float()
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return MicroBatch(ids, targets, mask, positions, cu, max(lengths))


def lm_loss(model: nn.Module, batch: MicroBatch, loss_tokens: int) -> Tensor:
    """Token-mean cross-entropy: -sum(mask * log p(target)) / loss_tokens (the mini-batch's count),
    through `hidden_states` and the output layer's (vocab-parallel) log-probs."""
    hidden = model.hidden_states(  # type: ignore[operator]
        batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen
    )
    logprobs, _ = model.token_logprobs(hidden, batch.targets, 1.0, 16)  # type: ignore[operator]
    return -(logprobs * batch.loss_mask).sum() / loss_tokens


def training_errors(
    parallel: dict, steps: list[list[MicroBatch]], model_overrides: dict | None = None, seed: int = 0
) -> dict[str, float]:
    """Two (or more) AdamW steps of the reference and the parallel model; steps[s][d] is the micro-batch
    of data-parallel replica d at step s (the reference runs them all). Returns the per-tensor errors
    of the losses, of every gradient of the first step and of every parameter after the last step."""
    config = tiny_config(**(model_overrides or {}))
    cfg, dims = build_dims(config, **parallel)
    ref = reference_model(seed, config)
    model = sharded_copy(ref, dims, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, float] = {}
    for step, replicas in enumerate(steps):
        assert len(replicas) == dims.dp, "one micro-batch per data-parallel replica"
        tokens = int(sum(b.loss_mask.sum() for b in replicas))
        ref_loss = sum(lm_loss(ref, b, tokens) for b in replicas)
        assert isinstance(ref_loss, Tensor)
        ref_loss.backward()
        loss = lm_loss(model, replicas[dims.coord("dp")], tokens)
        loss.backward()
        finalize_grads(model, dims)
        total = loss.detach().clone()
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.group("dp"))
        out[f"loss{step}"] = rel_err(total, ref_loss)
        if step == 0:
            out.update(errors(gather_tensors(model, dims, grads=True), ref, True, "grad"))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    out.update(errors(gather_tensors(model, dims, grads=False), ref, False, "param"))
    return out


def assert_all_close(per_rank: list[dict[str, float]], tol: float = 1e-5) -> float:
    """Every error of every rank <= tol; returns the worst."""
    worst = max((err, rank, name) for rank, errs in enumerate(per_rank) for name, err in errs.items())
    assert worst[0] <= tol, f"rank {worst[1]}: {worst[2]} error {worst[0]:.3g} > {tol}"
    return worst[0]
