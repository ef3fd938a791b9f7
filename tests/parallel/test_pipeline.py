"""Pipeline stages and schedules: the layer split, packing of documents into micro-batches, pp2 with the
1F1B and the interleaved schedule (uneven stages) against the single-process model, and the RL path
(log-probs without a loss, then the PPO loss) through pp2 against the learner."""

import pytest
import torch
from helpers.harness import pool
from helpers.reference_learner import accumulate_gradients, prepare
from helpers.sharded import VOCAB_PARAMS, build_dims, reference_model, rel_err, tiny_config
from helpers.stages import build_stages, reduced_full_grads
from test_layouts import BUDGET, SEED, TEMPERATURE, check_layout

from megatron_gptoss.config import ConfigError, PPOConfig
from megatron_gptoss.parallel.pipeline import (
    PipelineRunner,
    cu_seqlens_from_positions,
    pack_micro_batches,
    split_layers,
)
from megatron_gptoss.rl.batch import build_batch
from megatron_gptoss.rl.ppo_loss import compute_total_loss, loss_denominators


def test_split_layers_even_uneven_and_explicit():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # the remainder goes to the middle stages, then the last, then the first
    assert [len(r) for r in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(11, 4)] == [2, 3, 3, 3]
    assert [len(r) for r in split_layers(36, 5)] == [7, 8, 7, 7, 7]
    assert split_layers(5, 3, [0, 4, 1]) == [range(0, 0), range(0, 4), range(4, 5)]
    with pytest.raises(ConfigError, match="sum to 4"):
        split_layers(5, 2, [1, 3])
    with pytest.raises(ConfigError, match="middle stage"):
        split_layers(4, 3, [2, 0, 2])


def test_packing_round_trip_and_document_boundaries():
    lengths = [5, 9, 3, 0, 7]
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.arange(len(lengths) * width).view(len(lengths), width) * valid
    packed = pack_micro_batches(ids, ids + 1000, valid, token_budget=12, multiple_of=2)
    assert packed.num_micro_batches == 4  # [5], [9, 3], [7] and a filler-only one
    assert [r.tolist() for r in packed.rows] == [[0], [1, 2], [4], []]
    assert torch.equal(packed.unpack(packed.input_ids), ids)
    assert torch.equal(packed.unpack(packed.targets), (ids + 1000) * valid)
    cu, longest = cu_seqlens_from_positions(packed.positions[1])
    assert cu.tolist() == [0, 9, 12] and longest == 9
    cu, longest = cu_seqlens_from_positions(packed.positions[0])
    assert cu.tolist() == [0, 5, 12] and longest == 7  # the filler is a document of its own
    rows = packed.micro_rows(1, packed.targets[1].float())
    assert torch.equal(rows, ((ids + 1000) * valid)[[1, 2]].float())
    with pytest.raises(ValueError, match="more than the micro-batch token budget 8"):
        pack_micro_batches(ids, ids, valid, token_budget=8)


def test_pp2_1f1b_uneven_stages_equals_single_process():
    check_layout(2, {"pipeline_model_parallel_size": 2}, layers=4, counts=[1, 3])


def test_pp2_interleaved_virtual_stages_equals_single_process():
    # 5 layers over 4 virtual stages: [1, 2, 1, 1]; rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    check_layout(2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, layers=5)


def _ppo_through_pipeline() -> dict[str, float]:
    """The PPO loss (sequence-mean aggregation, entropy bonus, rollout correction) of a GRPO batch on
    pp2: old log-probs from the pipeline's log-prob pass and the gradients of one update, against the
    learner's single-process path (`prepare` + `accumulate_gradients`)."""
    config = tiny_config(num_layers=4)
    cfg, dims = build_dims(config, pipeline_model_parallel_size=2)
    models, plans = build_stages(config, dims, cfg)
    runner = PipelineRunner(models, plans, dims, chunk_size=16)
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 9), (7, 12), (4, 6), (6, 15)]  # (prompt, response) tokens, two groups of two
    prompts = [torch.randint(0, 96, (p,), generator=gen).tolist() for p, _ in shapes]
    responses = [torch.randint(0, 96, (r,), generator=gen).tolist() for _, r in shapes]
    rollout = [(-3 - torch.rand(r, generator=gen)).tolist() for _, r in shapes]
    batch = build_batch(prompts, responses, rollout, [1.0, 0.0, 0.3, 0.9])
    ppo = PPOConfig(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01, num_mini_batches=2)
    ref = reference_model(SEED, config)
    prepared, _ = prepare(ref, batch, ppo, TEMPERATURE, group_size=2)
    accumulate_gradients(ref, prepared, ppo, TEMPERATURE, on_policy=False)

    packed = runner.pack(batch.input_ids, batch.targets, batch.valid, BUDGET)
    old, _ = runner.logprobs(packed, TEMPERATURE)
    denom = loss_denominators([prepared.loss_mask])

    def loss_fn(rows, lp, ent):
        p = prepared.select(rows)
        adv = p.advantages[:, None].expand_as(lp)
        loss, _ = compute_total_loss(
            lp, p.old_logprobs, adv, p.loss_mask, ppo, denom, entropy=ent, is_weights=p.is_weights
        )
        return loss

    runner.forward_backward(packed, loss_fn, TEMPERATURE)
    grads = reduced_full_grads(models, dims)
    out = {"old_logprobs": rel_err(old * prepared.loss_mask, prepared.old_logprobs)}  # loss tokens only
    ref_grads = dict(ref.named_parameters())
    for name, g in grads.items():
        r = ref_grads[name].grad
        assert r is not None
        out[f"grad:{name}"] = rel_err(g, r[:96] if name in VOCAB_PARAMS else r)
    return out


def test_ppo_loss_and_logprob_pass_through_pp2_equal_the_learner():
    per_rank = pool(2).run(_ppo_through_pipeline)
    worst = max(err for out in per_rank for err in out.values())
    assert worst <= 1e-5, max((err, name) for out in per_rank for name, err in out.items())
    print(f"PPO through pp2: {sum(len(o) for o in per_rank)} tensors, worst error {worst:.2e}")
