"""The agent loop through the embedded engine's sessions on a tiny random model (fp32): the engine's
log-probs of every model token of a multi-turn trajectory equal the learner's packed forward over the whole
trajectory, tool tokens get exactly zero loss gradient, and single-turn rows give the loss they gave before.

The tiny model's vocabulary has no harmony tokens, so a test CallFormat stands in: a set of ordinary tokens
ends a turn with a call to `functions.lookup`, another ends it with a final answer, and the tool's answer is
rendered as tokens of the tiny vocabulary."""

import pytest
import torch

from megatron_gptoss.agent import MODEL, TOOL, AgentLoop, CallFormat, ToolCall, ToolExecutor, ToolRegistry
from megatron_gptoss.agent.tools import Tool
from megatron_gptoss.config import AgentConfig, EmbeddedEngineConfig, PPOConfig, gpt_oss_tiny
from megatron_gptoss.engine_api import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model
from megatron_gptoss.rl.batch import build_batch, packed_logprobs
from megatron_gptoss.rl.ppo_loss import loss_denominators, ppo_policy_loss
from megatron_gptoss.rollout import EmbeddedEngine

CONFIG = gpt_oss_tiny()
CALL_TOKENS = frozenset(range(80, 92))  # 12 of 96: most turns of 8 tokens end with a call
FINAL_TOKENS = frozenset({92})
FACTS = {"zorblat": "7341"}


def parse(turn):
    return ToolCall("functions.lookup", "commentary", "json", '{"key": "zorblat"}')


def result_tokens(trajectory, call, outcome):
    return [3, *(10 + int(c) for c in outcome.text), 4]  # "7341" -> [3, 17, 13, 14, 11, 4]


TEST_FORMAT = CallFormat(CALL_TOKENS, FINAL_TOKENS, parse, result_tokens)
LOOKUP = Tool(
    "functions.lookup",
    "Looks a key up.",
    {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    lambda arguments, timeout: FACTS[arguments["key"]],
)


@pytest.fixture(scope="module")
def learner():
    model = build_model(CONFIG, seed=21)
    gen = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _rollout(learner, prompts, max_turns, use_sessions=True):
    engine = EmbeddedEngine(
        CONFIG, seed=0, options=EmbeddedEngineConfig(max_batch_slots=2, block_size=4, max_step_tokens=6)
    )
    engine.update_weights(iter_hf_tensors(learner, CONFIG))
    executor = ToolExecutor(ToolRegistry([LOOKUP]), timeout_s=10.0, max_concurrent=2, max_chars=100)
    agent = AgentConfig(builtin_tools=[], max_turns=max_turns, max_total_tokens=60)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    loop = AgentLoop(engine, executor, params, agent, TEST_FORMAT, use_sessions=use_sessions)
    return loop.rollout(prompts)


def _loss(learner, batch, advantages):
    lp, _ = packed_logprobs(learner, batch, temperature=1.0)
    denom = loss_denominators([batch.loss_mask])
    loss, _ = ppo_policy_loss(lp, lp.detach(), advantages, batch.loss_mask, PPOConfig(), denom)
    return lp, loss


def test_loop_through_engine_sessions_matches_the_learner(learner):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 80, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    trajs = _rollout(learner, prompts, max_turns=4)
    multi = [t for t in trajs if TOOL in t.sources]
    assert len(multi) >= 2 and max(t.turns for t in trajs) >= 3, [(t.turns, t.finish_reason) for t in trajs]
    for t in trajs:
        assert t.tool_calls == t.sources.count(TOOL) // 6 and t.tool_errors == 0
        assert all(lp == 0.0 for lp, s in zip(t.logprobs, t.sources) if s == TOOL)

    rewards = torch.randn(len(trajs), generator=gen).tolist()
    batch = build_batch(
        prompts,
        [t.token_ids for t in trajs],
        [t.logprobs for t in trajs],
        rewards,
        response_masks=[t.response_mask for t in trajs],
    )
    advantages = torch.tensor(rewards)[:, None].expand_as(batch.loss_mask).contiguous()
    lp, loss = _loss(learner, batch, advantages)
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(t.sources.count(MODEL) for t in trajs)
    # the engine's log-prob of every model token (later turns read earlier tool tokens from its cache)
    assert (lp.detach()[mask] - batch.rollout_logprobs[mask]).abs().max() <= 1e-6

    # tool positions: zero gradient, and a changed tool target leaves the loss as it was
    (grad,) = torch.autograd.grad(loss, lp)
    assert (grad[batch.valid & ~mask] == 0).all() and (grad[mask] != 0).all()
    row = next(i for i, t in enumerate(trajs) if TOOL in t.sources)
    pos = len(prompts[row]) - 1 + trajs[row].sources.index(TOOL)
    assert batch.loss_mask[row, pos] == 0 and batch.valid[row, pos]
    changed = batch.targets.clone()
    changed[row, pos] = (changed[row, pos] + 1) % 80
    _, loss_changed = _loss(learner, batch.with_(targets=changed), advantages)
    assert torch.equal(loss_changed.detach(), loss.detach())

    # one turn only: each row is its trajectory's first turn, sampled from the same seeded stream, and
    # gives the same loss as a batch built without response masks
    single = _rollout(learner, prompts, max_turns=1)
    for s, t in zip(single, trajs):
        assert s.turns == 1 and set(s.sources) == {MODEL}
        assert s.token_ids == t.token_ids[: len(s.token_ids)]
        # fp32 sums in other step packings: equal to rounding
        assert (torch.tensor(s.logprobs) - torch.tensor(t.logprobs[: len(s.logprobs)])).abs().max() <= 1e-6
    responses, logprobs = [s.token_ids for s in single], [s.logprobs for s in single]
    before = build_batch(prompts, responses, logprobs, rewards)
    after = build_batch(prompts, responses, logprobs, rewards, [s.response_mask for s in single])
    adv = torch.tensor(rewards)[:, None].expand_as(before.loss_mask).contiguous()
    assert torch.equal(_loss(learner, before, adv)[1], _loss(learner, after, adv)[1])


def test_loop_regenerating_through_the_engine_matches_the_learner(learner):
    """The path of engines without sessions (vLLM): every turn generated from the whole trajectory."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 80, (n,), generator=gen).tolist() for n in (6, 4, 8)]
    trajs = _rollout(learner, prompts, max_turns=4, use_sessions=False)
    assert sum(TOOL in t.sources for t in trajs) >= 1, [(t.turns, t.finish_reason) for t in trajs]
    batch = build_batch(
        prompts,
        [t.token_ids for t in trajs],
        [t.logprobs for t in trajs],
        [0.0] * len(trajs),
        response_masks=[t.response_mask for t in trajs],
    )
    with torch.no_grad():
        lp, _ = packed_logprobs(learner, batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    assert (lp[mask] - batch.rollout_logprobs[mask]).abs().max() <= 1e-6
    assert (batch.rollout_logprobs[batch.valid & ~mask] == 0).all()
