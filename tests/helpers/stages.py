"""A rank's pipeline stages of the reference model, and what they hold gathered to full shape (run inside
`harness.pool` workers, in an initialised process group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from helpers.sharded import reference_model
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import apply_data_parallel
from megatron_gptoss.parallel.pipeline import build_stage_model, stage_plans
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard
from megatron_gptoss.parallel.tensor_parallel import is_partial_over_tp

VOCAB = 96  # tiny_config's vocabulary: gathered tensors are cut back to it from the tp-padded one


def build_stages(config, dims, cfg, counts=None, seed: int = 0) -> tuple[list[GPTOSSModel], list]:
    """This rank's parallelised stage models (layers per stage `counts`, even by default), loaded with their
    shards of `reference_model(seed, config)` and wrapped for data parallel; returns (models, stage plans)."""
    ref = reference_model(seed, config)
    full = dict(ref.named_parameters())
    plans = stage_plans(dims, config.num_layers, counts)
    models = []
    for plan in plans:
        model = parallelize(build_stage_model(config, plan), dims, cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(local_shard(full[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
        models.append(apply_data_parallel(model, dims))
    return models, plans


@torch.no_grad()
def reduced_full_grads(models, dims, vocab: int = VOCAB) -> dict[str, Tensor]:
    """The data-parallel reduction of every local gradient (a copy of `main_grad`, or of `.grad`
    without a DistributedOptimizer), gathered to full shape; the same on every rank."""
    out = {}
    for model in models:
        for name, p in model.named_parameters():
            g = getattr(p, "main_grad", p.grad).clone()
            if is_partial_over_tp(p) and dims.tp > 1:
                dist.all_reduce(g, group=dims.group("tp"))
            kind = "edp" if ".mlp.experts." in name else "dp_cp"
            dist.all_reduce(g, group=dims.group(kind))
            out[name] = gather_full(g, get_shard(p), dims, vocab)
    return out


def full_params(models, dims, vocab: int = VOCAB) -> dict[str, Tensor]:
    """Every parameter of this rank's stages gathered to full shape, in float32."""
    return {
        n: gather_full(p.detach(), get_shard(p), dims, vocab).float()
        for model in models
        for n, p in model.named_parameters()
    }
