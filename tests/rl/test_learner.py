"""The layout-independent pieces of the learner step (`rl.learner`: prepare_with, micro_loss, run_epochs),
driven on a plain tiny GPT-OSS by the single-process reference loop: on-policy PPO is the policy gradient,
micro-batching equals one batch, off-policy mini-batches clip, and rollout correction sees only policy
tokens. The parallel policy runs the same pieces (tests/rl/test_parallel_learner.py)."""

import dataclasses

import pytest
import torch
from helpers import reference_learner as learner
from helpers.hf_reference import rel_err

from megatron_gptoss.config import OptimConfig, PPOConfig, gpt_oss_tiny
from megatron_gptoss.model import build_model
from megatron_gptoss.rl.batch import build_batch, packed_logprobs
from megatron_gptoss.rl.ppo_loss import aggregate, loss_denominators


def make_batch(seed=0, rows=8, group=4):
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 96, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(rows)
    ]
    responses = [
        torch.randint(0, 96, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(rows)
    ]
    rollout = [(-torch.rand(len(r), generator=gen) * 3).tolist() for r in responses]
    rewards = torch.rand(rows, generator=gen).tolist()
    # The last two tokens of row 1 were written by a tool: excluded from loss and correction.
    masks = [[1] * len(r) for r in responses]
    masks[1] = [1] * max(0, len(responses[1]) - 2) + [0] * min(2, len(responses[1]))
    return build_batch(prompts, responses, rollout, rewards, masks)


def tiny_policy(seed=0):
    model = build_model(gpt_oss_tiny(attention_backend="eager"), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_on_policy_gradient_is_reinforce_and_ratio_exactly_one(mode):
    cfg = PPOConfig(loss_agg_mode=mode, correction_mode="none", entropy_coef=0.0, kl_coef=0.0)
    policy = tiny_policy()
    batch, _ = learner.prepare(policy, make_batch(), cfg, temperature=0.7, group_size=4)
    metrics = learner.accumulate_gradients(policy, batch, cfg, 0.7, on_policy=True)
    assert (
        metrics["pg/ratio_mean"] == 1.0 and metrics["pg/ratio_max"] == 1.0 and metrics["pg/ratio_min"] == 1.0
    )
    assert metrics["pg/clipfrac"] == 0.0
    ppo = grads(policy)

    policy.zero_grad()
    lp, _ = packed_logprobs(policy, batch, 0.7)
    denom = loss_denominators([batch.loss_mask])
    reinforce = aggregate(-batch.advantages[:, None] * lp, batch.loss_mask, mode, denom)
    reinforce.backward()
    for name, g in grads(policy).items():
        assert torch.equal(ppo[name], g) or rel_err(ppo[name], g) <= 1e-7, name


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_equal_one_batch(mode):
    policy = tiny_policy(1)
    base = PPOConfig(loss_agg_mode=mode, entropy_coef=0.01, correction_mode="token-tis")
    batch, _ = learner.prepare(policy, make_batch(1), base, temperature=1.0, group_size=4)
    learner.accumulate_gradients(policy, batch, base, 1.0, on_policy=True)
    one = grads(policy)
    policy.zero_grad()
    split = dataclasses.replace(base, num_micro_batches=3)
    learner.accumulate_gradients(policy, batch, split, 1.0, on_policy=True)
    for name, g in grads(policy).items():
        assert rel_err(g, one[name]) <= 1e-6, name


def test_off_policy_mini_batches_use_old_logprobs_and_clip():
    policy = tiny_policy(2)
    cfg = PPOConfig(num_mini_batches=2, correction_mode="none", clip_ratio_low=0.01, clip_ratio_high=0.01)
    batch, _ = learner.prepare(policy, make_batch(2, rows=8), cfg, temperature=1.0, group_size=4)
    optimizer = learner.MasterWeightAdamW(list(policy.parameters()), OptimConfig(lr=0.05, clip_grad=0.0), 10)
    history = []
    for idx in torch.arange(8).chunk(2):
        history.append(learner.accumulate_gradients(policy, batch.select(idx), cfg, 1.0, on_policy=False))
        optimizer.step()
    assert history[0]["pg/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # first mini-batch: nothing moved yet
    assert abs(history[1]["pg/ratio_mean"] - 1.0) > 1e-3  # the policy moved under the second one
    assert history[1]["pg/clipfrac"] > 0.0


def test_correction_metrics_ignore_tool_tokens():
    policy = tiny_policy(3)
    cfg = PPOConfig(correction_mode="token-tis")
    batch = make_batch(3)
    _, metrics = learner.prepare(policy, batch, cfg, temperature=1.0, group_size=4)
    tool = (batch.loss_mask == 0) & batch.valid
    changed = batch.with_(
        rollout_logprobs=torch.where(
            tool, torch.full_like(batch.rollout_logprobs, -50.0), batch.rollout_logprobs
        )
    )
    _, metrics2 = learner.prepare(policy, changed, cfg, temperature=1.0, group_size=4)
    assert metrics == metrics2
    assert metrics["mismatch/tokens"] == float(batch.loss_mask.sum())
