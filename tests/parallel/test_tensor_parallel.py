"""Tensor (+ sequence) parallel tiny GPT-OSS on 2 gloo ranks against the single-process model: loss,
every gradient, parameters after two AdamW steps, the RL log-prob path and the logits shards."""

import pytest
import torch
from helpers.harness import pool
from helpers.sharded import (
    POOL_TIMEOUT,
    assert_all_close,
    build_dims,
    errors,
    finalize_grads,
    gather_tensors,
    packed_batch,
    padded_batch,
    reference_model,
    rel_err,
    sharded_copy,
    tiny_config,
    training_errors,
)

from megatron_gptoss.config import ConfigError, ParallelConfig
from megatron_gptoss.model import build_model
from megatron_gptoss.model.gpt_oss import OutputLayer
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.sharding import gather_full, get_shard
from megatron_gptoss.parallel.vocab_parallel import VocabParallelOutputLayer, gather_logits
from megatron_gptoss.rl.batch import build_batch, packed_logprobs

VOCAB = 96


def training_steps(dp: int, packed_lengths: list[int]):
    """Step 0: two padded rows of 20 tokens; step 1: one packed row of documents (window is 8)."""
    return [
        [padded_batch(10 + d, VOCAB, rows=2, tokens=20) for d in range(dp)],
        [packed_batch(20 + d, VOCAB, packed_lengths) for d in range(dp)],
    ]


@pytest.mark.parametrize("sp,checkpointing", [(False, False), (True, False), (True, True)])
def test_tp2_training_equals_single_process(sp, checkpointing):
    # Without SP, 23 packed tokens exercise the uneven token split in front of the experts.
    lengths = [5, 11, 8] if sp else [5, 11, 7]
    per_rank = pool(2).run(
        training_errors,
        {"tensor_model_parallel_size": 2, "sequence_parallel": sp},
        training_steps(1, lengths),
        {"activation_checkpointing": checkpointing},
        timeout=POOL_TIMEOUT,
    )
    worst = assert_all_close(per_rank)
    print(f"tp2 sp={sp} checkpointing={checkpointing}: {len(per_rank[0])} tensors, worst error {worst:.2e}")


def _rl_logprob_errors(sp: bool, temperature: float) -> dict[str, float]:
    config = tiny_config()
    cfg, dims = build_dims(config, tensor_model_parallel_size=2, sequence_parallel=sp)
    ref = reference_model(3, config)
    model = sharded_copy(ref, dims, cfg)
    gen = torch.Generator().manual_seed(5)
    lengths = [(4, 9), (3, 8), (6, 5)]  # 12 + 10 + 10 valid tokens
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(0, VOCAB, (r,), generator=gen).tolist() for _, r in lengths]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * len(lengths))
    w_lp, w_ent = torch.randn(batch.valid.shape, generator=gen), torch.randn(batch.valid.shape, generator=gen)
    outs = []
    for m in (ref, model):
        lp, ent = packed_logprobs(m, batch, temperature, chunk_size=5)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        outs.append((lp, ent))
    finalize_grads(model, dims)
    out = {"logprob": rel_err(outs[1][0], outs[0][0]), "entropy": rel_err(outs[1][1], outs[0][1])}
    out.update(errors(gather_tensors(model, dims, grads=True), ref, True, "grad"))

    ids = torch.randint(0, VOCAB, (2, 20), generator=gen)
    with torch.no_grad():
        local = model(ids)
        out["logits"] = rel_err(gather_logits(local, dims.group("tp"), VOCAB), ref(ids))
        real = VOCAB - dims.coord("tp") * local.shape[-1]
        out["padded_logits_not_-inf"] = float(not torch.isneginf(local[..., max(real, 0) :]).all())
        if sp:
            try:
                model(ids[:, :19])
                out["odd_token_count_not_refused"] = 1.0
            except ValueError as err:
                out["odd_token_count_not_refused"] = float("multiple of 2" not in str(err))
    return out


@pytest.mark.parametrize("sp,temperature", [(False, 0.7), (True, 1.0)])
def test_tp2_rl_logprobs_entropy_and_grads_equal_single_process(sp, temperature):
    per_rank = pool(2).run(_rl_logprob_errors, sp, temperature, timeout=POOL_TIMEOUT)
    worst = assert_all_close(per_rank)
    print(f"tp2 sp={sp} log-probs T={temperature}: worst error {worst:.2e}")


@pytest.mark.parametrize(
    "overrides,parallel,dims_parallel,message",
    [
        (
            {"num_attention_heads": 6, "num_query_groups": 3},
            {"tensor_model_parallel_size": 2},
            None,
            "groups",
        ),
        ({"num_experts": 3}, {"expert_model_parallel_size": 2}, None, "num_experts=3"),
        ({}, {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 1}, "differs"),
    ],
)
def test_parallelize_refuses_layouts_that_do_not_divide(overrides, parallel, dims_parallel, message):
    config = tiny_config(**overrides)
    cfg = ParallelConfig(**parallel)
    built = ParallelConfig(**(dims_parallel or parallel))
    layout = Layout(
        world=2,
        tp=built.tensor_model_parallel_size,
        pp=built.pipeline_model_parallel_size,
        ep=built.expert_model_parallel_size,
    )
    with pytest.raises(ConfigError, match=message):
        parallelize(build_model(config), ParallelDims(layout, rank=0), cfg)


def _vocab_parallel_head_errors() -> dict[str, float]:
    """tp4 over a 96-token vocabulary padded to 128: rank 3 holds padding rows only."""
    config = tiny_config(num_query_groups=4)
    _, dims = build_dims(config, tensor_model_parallel_size=4)
    gen = torch.Generator().manual_seed(9)
    full = OutputLayer(config.hidden_size, 128, VOCAB)
    with torch.no_grad():
        full.weight.copy_(torch.randn(full.weight.shape, generator=gen))
    head = VocabParallelOutputLayer(full, config.padded_vocab_size(dims.tp), dims)
    hidden = torch.randn(3, 7, config.hidden_size, generator=gen)
    targets = torch.randint(0, VOCAB, (3, 7), generator=gen)
    w_lp, w_ent = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    outs = []
    for layer in (full, head):
        h = hidden.clone().requires_grad_()
        lp, ent = layer.logprobs(h, targets, 0.9, 4)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        outs.append((lp, ent, h.grad))
    grad = gather_full(head.weight.grad, get_shard(head.weight), dims, VOCAB)
    return {
        "logprob": rel_err(outs[1][0], outs[0][0]),
        "entropy": rel_err(outs[1][1], outs[0][1]),
        "grad:hidden": rel_err(outs[1][2], outs[0][2]),
        "grad:weight": rel_err(grad, full.weight.grad[:VOCAB]),
        "padding_has_grad": float(head.weight.grad[head.real_rows :].abs().sum()),
    }


def test_tp4_vocab_parallel_logprobs_with_a_rank_of_padding_only():
    assert_all_close(pool(4).run(_vocab_parallel_head_errors, timeout=POOL_TIMEOUT))
