"""The critic: the clipped value loss and explained variance against float64 formulas, the value model's
head, gae in prepare, and the critic's loss and gradients under tp2 (+SP), pp2 and ep2 on gloo equal to the
single-process value model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.harness import pool
from helpers.sharded import build_dims, reference_model, rel_err, tiny_config
from helpers.stages import reduced_full_grads

from megatron_gptoss.config import AlgorithmConfig, PPOConfig
from megatron_gptoss.model.value import VALUE_HEAD, ValueModel
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import apply_data_parallel
from megatron_gptoss.parallel.pipeline import PipelineRunner, stage_plans
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rl.advantages import explained_variance, gae, masked_whiten, token_rewards
from megatron_gptoss.rl.batch import build_batch, packed_logprobs
from megatron_gptoss.rl.critic import critic_gradients, value_loss
from megatron_gptoss.rl.learner import prepare_with
from megatron_gptoss.rl.parallel_learner import ParallelPolicy
from megatron_gptoss.rl.ppo_loss import loss_denominators

SEED, LAYERS, VOCAB, CLIP = 0, 4, 96, 0.2
PPO = PPOConfig(num_micro_batches=2)


def test_value_loss_matches_formula():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.4 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    returns = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).float()
    for mode in ("token-mean", "seq-mean-token-mean"):
        denom = loss_denominators([mask])
        loss, metrics = value_loss(values, old, returns, mask, CLIP, mode, denom)
        ref, clipped, per_seq = 0.0, 0, []
        for b in range(5):
            errs = []
            for t in range(7):
                if not mask[b, t]:
                    continue
                v, o, r = float(values[b, t].detach()), float(old[b, t]), float(returns[b, t])
                vc = o + min(max(v - o, -CLIP), CLIP)
                errs.append(max((v - r) ** 2, (vc - r) ** 2))
                clipped += (vc - r) ** 2 > (v - r) ** 2
            per_seq.append(errs)
        tokens = [e for s in per_seq for e in s]
        if mode == "token-mean":
            ref = 0.5 * math.fsum(tokens) / len(tokens)
        else:
            seqs = [s for s in per_seq if s]
            ref = 0.5 * math.fsum(math.fsum(s) / len(s) for s in seqs) / len(seqs)
        assert abs(float(loss) - ref) <= 1e-6 * ref  # computed in float32
        assert float(metrics["critic/clipfrac"]) == pytest.approx(clipped / len(tokens))
        assert 0 < clipped < len(tokens)
    # no clipping: the plain squared error, gradient (v - R) / N at the loss tokens
    loss, _ = value_loss(values, old, returns, mask, 0.0, "token-mean", loss_denominators([mask]))
    (grad,) = torch.autograd.grad(loss, values)
    expected = (values.detach() - returns) * mask / mask.sum()
    assert rel_err(grad, expected) <= 1e-6


def test_explained_variance_is_finite():
    gen = torch.Generator().manual_seed(2)
    returns = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    r = returns[mask.bool()].tolist()
    d = (returns - values)[mask.bool()].tolist()

    def var(xs):
        mean = math.fsum(xs) / len(xs)
        return math.fsum((x - mean) ** 2 for x in xs) / len(xs)

    assert explained_variance(returns, values, mask) == pytest.approx(1 - var(d) / var(r), rel=1e-12)
    assert explained_variance(torch.ones(4, 6), values, mask) == 0.0  # constant returns
    assert explained_variance(returns, values, torch.zeros(4, 6)) == 0.0  # no loss token
    assert explained_variance(returns, returns, mask) == 1.0


def test_value_model_is_the_body_with_a_scalar_head():
    config = tiny_config(num_layers=2)
    policy = reference_model(SEED, config)
    critic = critic_model(config)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    hidden = policy.hidden_states(ids)
    head = dict(critic.named_parameters())[VALUE_HEAD]
    assert critic.output_layer is None and VALUE_HEAD in dict(critic.named_parameters())
    expected = (hidden.double() @ head.double().t()).squeeze(-1)
    assert rel_err(critic(ids), expected) <= 1e-6


def test_prepare_with_gae():
    gen = torch.Generator().manual_seed(4)
    batch = rollout_batch()
    values = torch.randn(batch.loss_mask.shape, generator=gen) * batch.valid
    old = -torch.rand(batch.loss_mask.shape, generator=gen)
    algo = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8)
    prepared, metrics = prepare_with(
        lambda b: old, None, batch, PPOConfig(), 3, algo, values_of=lambda b: values
    )
    raw, returns = gae(token_rewards(batch.rewards, batch.loss_mask), values, batch.loss_mask, 0.9, 0.8)
    assert torch.equal(prepared.advantages, masked_whiten(raw, batch.loss_mask))
    assert torch.equal(prepared.returns, returns) and torch.equal(prepared.values, values)
    assert metrics["critic/explained_var"] == explained_variance(returns, values, batch.loss_mask)
    with pytest.raises(ValueError, match="needs the critic's values"):
        prepare_with(lambda b: old, None, batch, PPOConfig(), 3, algo)


# ---------------------------------------------------------------------------------------------------
# parallel layouts
def critic_model(config) -> ValueModel:
    """The single-process value model: the reference policy's body and a seeded, non-trivial head."""
    policy = dict(reference_model(SEED, config).named_parameters())
    model = ValueModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == VALUE_HEAD:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
            else:
                p.copy_(policy[name])
    return model


def rollout_batch():
    """9 rows (3 prompts x 3 samples), prompts of 3-5 tokens, responses of 2-8."""
    gen = torch.Generator().manual_seed(42)
    prompts, responses, rollout, rewards = [], [], [], []
    for p in range(3):
        prompt = torch.randint(1, VOCAB, (3 + p,), generator=gen).tolist()
        for _ in range(3):
            n = int(torch.randint(2, 9, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (n,), generator=gen).tolist())
            rollout.append([-1.0] * n)
            rewards.append(float(torch.rand((), generator=gen)))
    return build_batch(prompts, responses, rollout, rewards)


def critic_batch():
    """The batch with values before the update (the reference's, shifted so clipping engages) and
    returns."""
    batch = rollout_batch()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        values, _ = packed_logprobs(critic_model(tiny_config(num_layers=LAYERS)), batch, 1.0)
    old = values + 0.3 * torch.randn(values.shape, generator=gen)
    returns = torch.randn(values.shape, generator=gen)
    return batch.with_(values=old * batch.valid, returns=returns * batch.valid)


def reference_run(batch) -> dict:
    model = critic_model(tiny_config(num_layers=LAYERS))
    values, _ = packed_logprobs(model, batch, 1.0)
    denom = loss_denominators([batch.loss_mask])
    loss, _ = value_loss(values, batch.values, batch.returns, batch.loss_mask, CLIP, PPO.loss_agg_mode, denom)
    loss.backward()
    return {
        "loss": float(loss),
        "values": values.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def run_parallel(parallel: dict, batch) -> dict:
    config = tiny_config(num_layers=LAYERS)
    cfg, dims = build_dims(config, **parallel)
    full = dict(critic_model(config).named_parameters())
    plans = stage_plans(dims, config.num_layers)
    models = []
    for plan in plans:
        model = parallelize(
            ValueModel(config, layers=plan.layers, pre_process=plan.is_first, post_process=plan.is_last),
            dims,
            cfg,
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(local_shard(full[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
        models.append(apply_data_parallel(model, dims))
    critic = ParallelPolicy(PipelineRunner(models, plans, dims, chunk_size=16), dims)
    values = critic.logprobs(batch, 1.0)
    metrics = critic_gradients(critic, batch, PPO, CLIP)
    return {"loss": metrics["loss/value"], "values": values, "grads": reduced_full_grads(models, dims)}


LAYOUTS = {
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
}


@pytest.fixture(scope="module")
def reference():
    batch = critic_batch()
    return batch, reference_run(batch)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_critic_layouts_equal_single_process(name, reference):
    batch, ref = reference
    per_rank = pool(2).run(run_parallel, LAYOUTS[name], batch)
    for rank, out in enumerate(per_rank):
        assert rel_err(out["values"], ref["values"]) <= 1e-5, (name, rank)
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), (name, rank)
        for pname, g in out["grads"].items():
            assert rel_err(g, ref["grads"][pname]) <= 1e-5, (name, rank, pname)
    covered = set().union(*(out["grads"] for out in per_rank))
    assert covered == set(ref["grads"])
    assert float(ref["grads"][VALUE_HEAD].norm()) > 0 and ref["loss"] > 0
