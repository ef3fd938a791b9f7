"""Router replay (r3) and bitwise on-policy mode on multi-turn trajectories of the agent loop (fp32, CPU).

The engine and the learner hold the same tiny model except for the routers: every layer's experts 1 and 2
have equal router rows and biases, broken by DELTA (a few float32 ulps of the router logits) towards expert
2 in the engine and towards expert 1 in the learner. Tokens with the two at the top-k boundary are routed to
different experts, so without replay the learner's log-probs of the model tokens differ from the engine's;
replaying the routing the engine recorded over the trajectory's turns (prompt prefill, decode, tool-result
prefill) makes them agree within 1e-6. The record equals the experts of a fresh forward of the engine's
model over the whole trajectory, tool tokens included, with sessions and re-generating, also for
trajectories cut by agent.max_total_tokens. Bitwise mode: the engine's log-probs of every model token equal
the learner's packed forward bit for bit (Triton attention and the batch-invariant kernels, interpreted),
and not without the mode."""

from __future__ import annotations

import pytest
import torch
from helpers.router_ties import tied
from test_loop_engine import LOOKUP, TEST_FORMAT

from megatron_gptoss.agent import TOOL, AgentLoop, ToolExecutor, ToolRegistry
from megatron_gptoss.agent.loop import Trajectory
from megatron_gptoss.config import AgentConfig, EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.engine_api import SamplingParams
from megatron_gptoss.errors import EngineError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import GPTOSSModel, build_model
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.rl.batch import RolloutBatch, build_batch, packed_logprobs
from megatron_gptoss.rollout import EmbeddedEngine

CONFIG = gpt_oss_tiny()
OPTIONS = dict(max_batch_slots=2, block_size=4, max_step_tokens=6)  # chunked prefill, rows joining


def noisy_model(config, seed: int, scale: float) -> GPTOSSModel:
    model = build_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def rollout(model, config, prompts, *, sessions: bool, max_total_tokens: int = 60) -> list[Trajectory]:
    engine = EmbeddedEngine(config, seed=0, options=EmbeddedEngineConfig(record_routing=True, **OPTIONS))
    engine.update_weights(iter_hf_tensors(model, config))
    executor = ToolExecutor(ToolRegistry([LOOKUP]), timeout_s=10.0, max_concurrent=2, max_chars=100)
    agent = AgentConfig(builtin_tools=[], max_turns=4, max_total_tokens=max_total_tokens)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    return AgentLoop(engine, executor, params, agent, TEST_FORMAT, use_sessions=sessions).rollout(prompts)


def as_batch(prompts, trajs: list[Trajectory]) -> RolloutBatch:
    gens = [t.generation() for t in trajs]
    return build_batch(
        prompts,
        [g.token_ids for g in gens],
        [g.logprobs for g in gens],
        [0.0] * len(gens),
        [g.sources for g in gens],
        [g.routing for g in gens],
    )


def fresh_routing(model: GPTOSSModel, tokens: list[int]) -> torch.Tensor:
    """The experts [len(tokens), layers, k] of one forward of `model` over `tokens` (no cache)."""
    seen: list[torch.Tensor] = []
    routers = [layer.mlp.router for layer in model.decoder.layers.values()]
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in routers]
    try:
        with torch.no_grad():
            model.hidden_states(torch.tensor(tokens)[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


def prompts_of(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 80, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models() -> tuple[GPTOSSModel, GPTOSSModel]:
    """(the engine's model, the learner): equal but for the routers' tie-breaking bias."""
    return tied(noisy_model(CONFIG, 21, 0.05), prefer=2), tied(noisy_model(CONFIG, 21, 0.05), prefer=1)


# (sessions, agent.max_total_tokens): sessions and re-generation; a budget that cuts trajectories
CASES = {"sessions": (True, 60), "regenerate": (False, 60), "cut": (True, 24)}


@pytest.mark.parametrize("case", list(CASES))
def test_r3_replays_the_engines_routing_of_every_turn(models, case):
    engine_model, learner = models
    sessions, budget = CASES[case]
    prompts = prompts_of(3, (5, 9, 3, 7))
    trajs = rollout(engine_model, CONFIG, prompts, sessions=sessions, max_total_tokens=budget)
    multi = [t for t in trajs if TOOL in t.sources]
    assert len(multi) >= 2 and max(t.turns for t in trajs) >= 2, [(t.turns, t.finish_reason) for t in trajs]
    if case == "cut":
        assert any(t.finish_reason == "max_total_tokens" for t in trajs), [t.finish_reason for t in trajs]

    for t in trajs:
        routing = t.generation().routing
        assert routing is not None and routing.dtype == torch.uint8
        assert routing.shape == (len(t) - 1, CONFIG.num_layers, CONFIG.moe_router_topk)
        # what a fresh forward of the engine's model over the whole trajectory routes, tool tokens included
        expected = fresh_routing(engine_model, (t.prompt_ids + t.token_ids)[:-1])
        assert torch.equal(routing.long(), expected)
        tool_rows = [len(t.prompt_ids) + i for i, s in enumerate(t.sources) if s == TOOL]
        assert torch.equal(routing[tool_rows].long(), expected[tool_rows])

    batch = as_batch(prompts, trajs)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        free, _ = packed_logprobs(learner, batch.with_(routing=None), temperature=1.0)
        replayed, _ = packed_logprobs(learner, batch, temperature=1.0)
    # after a tool result: the later turns' model tokens, which read tool tokens from the engine's cache
    later = mask & (batch.loss_mask.cumsum(1) < torch.arange(1, mask.shape[1] + 1))
    assert later.any()
    assert float((free - batch.rollout_logprobs).abs()[mask].max()) > 1e-3  # experts flipped
    assert float((free - batch.rollout_logprobs).abs()[later].max()) > 1e-3
    assert float((replayed - batch.rollout_logprobs).abs()[mask].max()) <= 1e-6


def test_a_routing_record_that_does_not_cover_the_trajectory_is_an_engine_error():
    traj = Trajectory([1, 2, 3])
    traj.append([4, 5], [-1.0, -2.0])
    with pytest.raises(EngineError, match=r"routing record of 3 tokens .*\(expected 4"):
        traj.add_routing(torch.zeros(3, 2, 2, dtype=torch.uint8))
    traj = Trajectory([1, 2, 3])
    traj.append([4, 5], [-1.0, -2.0])
    traj.add_routing(torch.zeros(4, 2, 2, dtype=torch.uint8))
    traj.append([6], None)
    traj.append([7], [-1.0])
    with pytest.raises(EngineError, match=r"routing record of 4 tokens .*\(expected 6"):
        traj.add_routing(None)  # a turn without a record after turns with one
    plain = Trajectory([1, 2])
    plain.append([3], [-1.0])
    plain.add_routing(None)  # an engine that records nothing
    assert plain.generation().routing is None


def bitwise_equal(learner, config, prompts, sessions: bool) -> bool:
    """Whether the engine's log-prob of every model token equals the learner's packed forward bit for bit."""
    trajs = rollout(learner, config, prompts, sessions=sessions)
    assert sum(TOOL in t.sources for t in trajs) >= 1, [(t.turns, t.finish_reason) for t in trajs]
    batch = as_batch(prompts, trajs).with_(routing=None)
    with torch.no_grad():
        lp, _ = packed_logprobs(learner, batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    return torch.equal(lp[mask], batch.rollout_logprobs[mask])


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "regenerate"])
def test_bitwise_mode_agent_logprobs_equal_the_packed_forward(sessions):
    config = gpt_oss_tiny(attention_backend="triton")
    learner = noisy_model(config, 4, 0.1)
    prompts = prompts_of(5, (6, 3, 8))
    with batch_invariant.enabled():
        assert bitwise_equal(learner, config, prompts, sessions)
    if sessions:  # without the mode the same comparison is not bitwise (library GEMMs depend on the batch)
        assert not bitwise_equal(learner, config, prompts, sessions)
