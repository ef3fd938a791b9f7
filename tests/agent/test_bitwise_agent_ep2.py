"""Bitwise on-policy mode on multi-turn agent trajectories at expert parallel 2 (2 gloo ranks, fp32, Triton
attention under the interpreter): the embedded engine at ep 2 generates the turns (tool results prefilled
between them, each turn re-generated from the whole trajectory, rounds waiting for every tool call so both
ranks step alike); the learner at ep 2 scores the trajectories in one packed forward. With the mode the
engine's log-prob of every model token equals the learner's bit for bit; without it, not."""

from __future__ import annotations

import torch
from helpers.harness import pool
from test_loop_engine import LOOKUP, TEST_FORMAT
from test_router_replay_agent import as_batch, noisy_model, prompts_of

from megatron_gptoss.agent import TOOL, AgentLoop, ToolExecutor, ToolRegistry
from megatron_gptoss.config import AgentConfig, EmbeddedEngineConfig, ParallelConfig, gpt_oss_tiny
from megatron_gptoss.engine_api import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.rl.batch import packed_logprobs
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

CONFIG = gpt_oss_tiny(attention_backend="triton")
EP2 = ParallelConfig(expert_model_parallel_size=2)


def on_ranks(bitwise: bool) -> tuple[bool, int]:
    """(whether every model token's log-prob is the learner's bit for bit, trajectories with tool tokens);
    both ranks roll out the same prompts (the experts' rows cross the ranks in either forward)."""
    dims = ParallelDims.build(EP2, CONFIG)
    learner = parallelize(noisy_model(CONFIG, 4, 0.1), dims, EP2).eval()
    engine_dims = ParallelDims.build(EP2, CONFIG)
    options = EmbeddedEngineConfig(max_batch_slots=2, block_size=4, max_step_tokens=6)
    engine = ParallelEmbeddedEngine(CONFIG, engine_dims, seed=0, options=options)
    engine.update_weights(iter_hf_tensors(noisy_model(CONFIG, 4, 0.1), CONFIG))
    executor = ToolExecutor(ToolRegistry([LOOKUP]), timeout_s=10.0, max_concurrent=2, max_chars=100)
    agent = AgentConfig(builtin_tools=[], max_turns=4, max_total_tokens=60, wait_for_tools=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    prompts = prompts_of(5, (6, 3))
    with batch_invariant.enabled(bitwise):
        trajs = AgentLoop(engine, executor, params, agent, TEST_FORMAT, use_sessions=False).rollout(prompts)
        batch = as_batch(prompts, trajs).with_(routing=None)
        with torch.no_grad():
            lp, _ = packed_logprobs(learner, batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    return torch.equal(lp[mask], batch.rollout_logprobs[mask]), sum(TOOL in t.sources for t in trajs)


def test_bitwise_mode_agent_logprobs_at_ep2():
    workers = pool(2)
    bitwise = workers.run(on_ranks, True, timeout=240.0)
    assert all(same and tools >= 1 for same, tools in bitwise), bitwise
    default = workers.run(on_ranks, False, timeout=240.0)
    assert not any(same for same, _ in default), default
