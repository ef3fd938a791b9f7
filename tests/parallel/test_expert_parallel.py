"""Expert parallel tiny GPT-OSS (ep2 on 2 ranks, tp2 x ep2 on 4) against the single-process model: loss,
every gradient, parameters after two AdamW steps; dispatch with a rank that receives no token; the
load-balancing loss."""

import pytest
import torch
import torch.distributed as dist
from helpers.harness import pool
from helpers.sharded import (
    POOL_TIMEOUT,
    assert_all_close,
    build_dims,
    errors,
    finalize_grads,
    gather_tensors,
    lm_loss,
    packed_batch,
    reference_model,
    rel_err,
    sharded_copy,
    tiny_config,
    training_errors,
)
from test_tensor_parallel import VOCAB, training_steps
from torch import nn

from megatron_gptoss.model.moe import MoE
from megatron_gptoss.parallel.expert_parallel import (
    apply_expert_parallel,
    load_balancing_loss,
    set_load_balancing_loss,
)
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard


@pytest.mark.parametrize("chunks", [1, 3])
def test_ep2_training_equals_single_process(chunks):
    """ep2 on 2 ranks is dp2 for the dense part: each replica trains on its own micro-batch. chunks 3: the
    tokens dispatched in three chunks whose exchanges overlap the other chunks' experts."""
    per_rank = pool(2).run(
        training_errors,
        {"expert_model_parallel_size": 2, "expert_dispatch_chunks": chunks},
        training_steps(2, [5, 11, 7]),
        timeout=POOL_TIMEOUT,
    )
    worst = assert_all_close(per_rank)
    print(f"ep2 chunks {chunks}: {len(per_rank[0])} tensors, worst error {worst:.2e}")


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_ep2_training_equals_single_process(sp):
    lengths = [5, 11, 8] if sp else [5, 11, 7]
    parallel = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": sp}
    per_rank = pool(4).run(training_errors, parallel, training_steps(2, lengths), timeout=POOL_TIMEOUT)
    worst = assert_all_close(per_rank)
    print(f"tp2 x ep2 sp={sp}: {len(per_rank[0])} tensors, worst error {worst:.2e}")


def _dispatch_to_one_rank_errors(backend: str, chunks: int = 1) -> dict[str, float]:
    """One MoE block whose router sends every token to experts 0 and 1 (both on ep rank 0), against the
    single-process eager block; `backend` is the sharded block's expert backend, `chunks` its dispatch
    chunks."""
    config = tiny_config()
    _, dims = build_dims(config, expert_model_parallel_size=2)
    torch.manual_seed(0)
    ref = MoE(config)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
        ref.router.bias.copy_(torch.tensor([50.0, 40.0, -50.0, -50.0]))
    xs = [torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(d)) for d in range(2)]
    sharded = tiny_config(expert_backend=backend)
    wrapper = nn.ModuleDict({"mlp": MoE(sharded)})
    apply_expert_parallel(wrapper, sharded, dims, chunks)
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in wrapper["mlp"].named_parameters():
            p.copy_(local_shard(full[name], get_shard(p), dims))
    ref_out = [ref(x) for x in xs]
    sum(o.square().sum() for o in ref_out).backward()
    x = xs[dims.coord("dp")].clone().requires_grad_()
    out = wrapper["mlp"](x)
    out.square().sum().backward()
    finalize_grads(wrapper, dims)
    result = {"output": rel_err(out, ref_out[dims.coord("dp")])}
    for name, p in wrapper["mlp"].named_parameters():
        result[f"grad:{name}"] = rel_err(gather_full(p.grad, get_shard(p), dims), full[name].grad)
    return result


@pytest.mark.parametrize("backend,chunks", [("loop", 1), ("grouped_mm", 1), ("grouped_mm", 4)])
def test_ep2_dispatch_with_a_rank_that_receives_no_token(backend, chunks):
    """`grouped_mm` on the CPU: device-side dispatch and the fused kernels under the Triton interpreter; 4
    chunks of 7 tokens: chunks that send nothing to a rank, forward and backward."""
    assert_all_close(pool(2).run(_dispatch_to_one_rank_errors, backend, chunks, timeout=POOL_TIMEOUT))


def _load_balancing_errors(coeff: float) -> dict[str, float]:
    config = tiny_config()
    cfg, dims = build_dims(config, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    ref = reference_model(4, config)
    model = sharded_copy(ref, dims, cfg)
    set_load_balancing_loss(model, coeff)
    routed = []  # the reference routers' (logits, probs, indices), layer by layer
    for layer in ref.decoder.layers.values():
        layer.mlp.router.register_forward_hook(lambda module, args, out: routed.append(out))
    batch = packed_batch(30, VOCAB, [5, 11, 7])
    tokens = int(batch.loss_mask.sum())
    loss_ref = lm_loss(ref, batch, tokens)
    aux_ref = [
        load_balancing_loss(logits, idx, torch.bincount(idx.reshape(-1), minlength=4).float(), coeff)
        for logits, _, idx in routed
    ]
    (loss_ref + sum(aux_ref)).backward()
    lm_loss(model, batch, tokens).backward()
    finalize_grads(model, dims)
    out = errors(gather_tensors(model, dims, grads=True), ref, True, "grad")
    for i, moe in enumerate(m for m in model.modules() if hasattr(m, "last_aux_loss")):
        total = moe.last_aux_loss.clone()
        dist.all_reduce(total, group=dims.group("tp"))
        out[f"aux{i}"] = rel_err(total, aux_ref[i])
    return out


def test_tp2_ep2_load_balancing_loss_equals_single_process():
    assert_all_close(pool(2).run(_load_balancing_errors, 0.05, timeout=POOL_TIMEOUT))
