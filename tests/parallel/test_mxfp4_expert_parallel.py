"""Expert parallel (ep2 on 2 gloo ranks) with MXFP4 experts under LoRA equals world 1: each rank reads only
its experts' blocks and scales from a released-layout checkpoint, holds exactly the bytes of its slice, and
the loss and every adapter gradient equal the single-process model's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.harness import pool
from helpers.hf_checkpoints import write_mxfp4_checkpoint
from helpers.sharded import (
    POOL_TIMEOUT,
    build_dims,
    finalize_grads,
    lm_loss,
    packed_batch,
    reference_model,
    rel_err,
    tiny_config,
)

from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.loading import load_hf_parallel, materialize
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard

LORA = LoRAConfig(rank=4, alpha=8.0, targets=list(LORA_TARGETS))


def _ep2_errors(path: str, parallel: dict) -> dict[str, float]:
    config = tiny_config(lora=LORA, expert_format="mxfp4")
    cfg, dims = build_dims(config, **parallel)
    ref = GPTOSSModel(config)
    whole = load_hf_parallel([ref], path, ParallelDims(Layout(world=1, tp=1, pp=1, ep=1), rank=0), config)
    model = parallelize(GPTOSSModel(config, device="meta"), dims, cfg)
    materialize(model, "cpu")
    stats = load_hf_parallel([model], path, dims, config)
    experts = sum(b.numel() for n, b in ref.named_buffers() if n.endswith((".blocks", ".scales")))
    experts += 2 * sum(
        p.numel() for n, p in ref.named_parameters() if ".experts.linear_fc" in n and n.endswith("bias")
    )
    # this rank reads the other weights whole, half the experts' bytes (uint8 blocks, scales; bf16 biases)
    out = {"bytes read differ": float(stats["bytes_read"] != whole["bytes_read"] - experts // 2)}
    full = dict(ref.named_parameters())
    with torch.no_grad():  # the same adapters (B random too) on both, the experts' sharded over ep
        for name, p in full.items():
            if is_adapter_param(name):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        for name, p in model.named_parameters():
            p.copy_(local_shard(full[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
    ref_weights, ep = mxfp4_weights(ref), dims.coord("ep")
    for name, weight in mxfp4_weights(model).items():
        for part in ("blocks", "scales"):
            whole = getattr(ref_weights[name], part)
            out[f"bytes differ:{name}.{part}"] = float(
                not torch.equal(getattr(weight, part), whole.chunk(2)[ep])
            )
    batches = [packed_batch(d, config.vocab_size, [5, 11, 7]) for d in range(dims.dp)]
    tokens = int(sum(b.loss_mask.sum() for b in batches))
    ref_loss = sum(lm_loss(ref, b, tokens) for b in batches)
    assert isinstance(ref_loss, torch.Tensor)
    ref_loss.backward()
    loss = lm_loss(model, batches[dims.coord("dp")], tokens)
    loss.backward()
    finalize_grads(model, dims)
    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.group("dp"))
    out["loss"] = rel_err(total, ref_loss)
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            assert p.grad is not None and full[name].grad is not None, name
            grad = full[name].grad
            out[f"grad:{name}"] = rel_err(gather_full(p.grad, get_shard(p), dims, config.vocab_size), grad)
    return out


def test_ep2_mxfp4_lora_equals_world_one(tmp_path):
    ref = reference_model(0, tiny_config())
    path = write_mxfp4_checkpoint(ref, tmp_path / "mxfp4")
    per_rank = pool(2).run(_ep2_errors, str(path), {"expert_model_parallel_size": 2}, timeout=POOL_TIMEOUT)
    for rank, errs in enumerate(per_rank):
        assert len(errs) > 10 and any(".experts.linear_fc2.lora" in n for n in errs)
        worst = max(errs.items(), key=lambda item: item[1])
        assert worst[1] <= 1e-6, f"rank {rank}: {worst}"
