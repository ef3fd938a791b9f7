"""The PPO step on the parallel policy against the single-process reference (`reference_learner`; gloo,
float32): the prepared batch (old and reference log-probs, rollout-correction weights, advantages), the
step's metrics and every parameter after two off-policy mini-batch updates (clipping, KL to a reference
policy, entropy bonus, token-level truncated importance sampling) are equal, error per tensor <= 1e-5, for
pipeline, tensor / sequence, expert and data parallel layouts with uneven rows per replica."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_learner as learner
from helpers.harness import pool
from helpers.reference_learner import MasterWeightAdamW
from helpers.sharded import build_dims, reference_model, rel_err, tiny_config
from helpers.stages import build_stages, full_params

from megatron_gptoss.config import OptimConfig, PPOConfig
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.pipeline import PipelineRunner
from megatron_gptoss.rl import parallel_learner
from megatron_gptoss.rl.batch import RolloutBatch, build_batch

SEED, REF_SEED, LAYERS, VOCAB = 0, 5, 4, 96
TEMPERATURE = 0.8
GROUP = 3
PPO = PPOConfig(
    num_mini_batches=2,
    num_micro_batches=2,
    kl_coef=0.05,
    entropy_coef=0.01,
    correction_mode="token-tis",
    correction_threshold=1.5,
)
# Adam turns a gradient element's fp32 rounding error into a parameter error of order lr (see test_layouts).
OPTIM = OptimConfig(lr=5e-4, weight_decay=0.1, clip_grad=0.5)


def rollout_batch() -> RolloutBatch:
    """9 rows (3 prompts x 3 samples; 9 rows split 5 / 4 over two replicas), prompts of 3-6 tokens,
    responses of 2-9; rollout log-probs are noisy so the correction engages."""
    gen = torch.Generator().manual_seed(42)
    prompts, responses, rollout, rewards = [], [], [], []
    for p in range(3):
        prompt = torch.randint(1, VOCAB, (3 + p,), generator=gen).tolist()
        for _ in range(GROUP):
            n = int(torch.randint(2, 10, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (n,), generator=gen).tolist())
            rollout.append((-3.0 - torch.rand(n, generator=gen)).tolist())
            rewards.append(float(torch.rand((), generator=gen)))
    return build_batch(prompts, responses, rollout, rewards)


def reference_step() -> dict:
    config = tiny_config(num_layers=LAYERS)
    policy = reference_model(SEED, config)
    ref = reference_model(REF_SEED, config).requires_grad_(False)
    opt = MasterWeightAdamW(list(policy.parameters()), OPTIM, total_steps=2)
    batch, prep_metrics = learner.prepare(policy, rollout_batch(), PPO, TEMPERATURE, GROUP, ref)
    metrics = learner.update(policy, opt, batch, PPO, TEMPERATURE, torch.Generator().manual_seed(7))
    params = {n: p.detach().clone() for n, p in policy.named_parameters()}
    return {"batch": batch, "prep": prep_metrics, "metrics": metrics, "params": params}


def run_parallel(parallel: dict) -> dict:
    config = tiny_config(num_layers=LAYERS)
    cfg, dims = build_dims(config, **parallel)
    models, plans = build_stages(config, dims, cfg)
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=2, shard=True)
    policy = parallel_learner.ParallelPolicy(PipelineRunner(models, plans, dims, chunk_size=16), dims, opt)
    ref_models = reference_stages(config, dims, cfg, plans)
    reference = parallel_learner.ParallelPolicy(PipelineRunner(ref_models, plans, dims, chunk_size=16), dims)
    batch, prep_metrics = parallel_learner.prepare(
        policy, rollout_batch(), PPO, TEMPERATURE, GROUP, reference
    )
    metrics = parallel_learner.update(policy, batch, PPO, TEMPERATURE, torch.Generator().manual_seed(7))
    return {"batch": batch, "prep": prep_metrics, "metrics": metrics, "params": full_params(models, dims)}


def reference_stages(config, dims, cfg, plans):
    """The frozen reference policy's stages (weights of reference_model(REF_SEED))."""
    from megatron_gptoss.parallel.apply import parallelize
    from megatron_gptoss.parallel.pipeline import build_stage_model
    from megatron_gptoss.parallel.sharding import get_shard, local_shard

    full = dict(reference_model(REF_SEED, config).named_parameters())
    models = []
    for plan in plans:
        model = parallelize(build_stage_model(config, plan), dims, cfg).requires_grad_(False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(local_shard(full[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
        models.append(model)
    return models


@pytest.fixture(scope="module")
def reference():
    return reference_step()


LAYOUTS = {
    "pp2_dp2": dict(pipeline_model_parallel_size=2),
    "tp2_sp_dp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2_pp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_ppo_step_equals_single_process(name, reference):
    per_rank = pool(4).run(run_parallel, LAYOUTS[name])
    ref = reference
    for rank, out in enumerate(per_rank):
        for field in ("old_logprobs", "ref_logprobs", "is_weights", "advantages", "loss_mask"):
            err = rel_err(getattr(out["batch"], field), getattr(ref["batch"], field))
            assert err <= 1e-5, (name, rank, field, err)
        for key, value in ref["prep"].items():
            assert out["prep"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, rank, key)
        assert set(out["metrics"]) == set(ref["metrics"])
        for key, value in ref["metrics"].items():  # abs: differences of fp32 log-probs (ratio, kl)
            assert out["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, rank, key)
        for pname, p in out["params"].items():
            err = rel_err(p, ref["params"][pname])
            assert err <= 1e-5, (name, rank, pname, err)
    covered = set().union(*(out["params"] for out in per_rank))
    assert covered == set(ref["params"])
    # off-policy: the second mini-batch's ratio moved away from 1 and the update changed the policy
    assert ref["metrics"]["pg/ratio_max"] > 1.0
    start = reference_model(SEED, tiny_config(num_layers=LAYERS)).named_parameters()
    assert max(rel_err(ref["params"][n], p) for n, p in start) > 1e-4
