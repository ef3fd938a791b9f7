"""`agent.loop.SessionRun` over the embedded engine's sessions: trajectories stepped up to their tool calls
(`advance`), the engine's weights changed while the calls are in flight, then run to their end (`finish`).

    recompute   the turns after the call are sampled over a prefix the new weights computed afresh: their
                log-probs equal the new model's teacher-forced log-probs of the whole trajectory (<= 1e-6)
    keep        the session keeps the cache the old weights computed up to the switch: the later turns'
                log-probs equal a reference that fills a contiguous KV cache with the old model up to the
                switch and runs the new model on the rest over it (<= 1e-6)

Every model token records the version that sampled it, a tool token that of the turn whose call it answers.
A made-up call format keeps the test fast and sure to call: a turn ends at its first even token, which is a
call answered by three fixed tokens."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from helpers.embedded_engine import CONFIG, engine_of, kept_prefix_logprobs, perturbed_learner

from megatron_gptoss.agent.calls import ToolCall, ToolOutcome
from megatron_gptoss.agent.loop import MODEL, TOOL, AgentLoop, CallFormat
from megatron_gptoss.config.agent import AgentConfig
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors

PROMPTS = [[3, 17, 5, 9, 11], [4, 8, 15, 16, 23, 42, 7], [1, 3, 5], [9, 7, 5, 3]]
ANSWER = [3, 5, 7]  # odd: never read as a call
FORMAT = CallFormat(
    call_tokens=frozenset(range(0, CONFIG.vocab_size, 2)),
    final_tokens=frozenset(),
    parse=lambda tokens: ToolCall("functions.echo", "commentary", None, ""),
    result_tokens=lambda full, call, outcome: list(ANSWER),
)


class _Answered:
    """A tool executor whose calls have answered when submitted."""

    def submit(self, call: ToolCall) -> Future:
        future: Future = Future()
        future.set_result(ToolOutcome("ok", "ok"))
        return future

    def done(self, futures, *, wait: bool, wait_all: bool = False) -> list[Future]:
        return list(futures)


@torch.no_grad()
def _teacher_forced(model, tokens: list[int]) -> list[float]:
    ids = torch.tensor([tokens])
    return model.token_logprobs(model.hidden_states(ids[:, :-1]), ids[:, 1:])[0][0].tolist()


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_trajectory_continues_after_its_call_under_new_weights(kv):
    old, new = perturbed_learner(0), perturbed_learner(7)
    engine = engine_of(old)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1234)
    loop = AgentLoop(engine, _Answered(), params, AgentConfig(max_turns=3), FORMAT, use_sessions=True)
    run = loop.begin(PROMPTS, version=3)
    run.advance()
    first = [len(t.token_ids) for t in run.trajs]  # the first turn of each, sampled by the old weights
    assert run.waiting and not run.generating  # calls in flight, no turn half sampled
    engine.update_weights(iter_hf_tensors(new, CONFIG))
    run.weights_changed(4, recompute=kv == "recompute")
    trajs, continued = run.finish(), 0
    for prompt, traj, before in zip(PROMPTS, trajs, first, strict=True):
        assert len(traj.versions) == len(traj.token_ids) == len(traj.sources)
        assert set(traj.versions[:before]) == {3} and traj.sources[:before] == [MODEL] * before
        if traj.tool_calls == 0:
            assert len(traj.token_ids) == before
            continue
        answer = slice(before, before + len(ANSWER))
        assert traj.token_ids[answer] == ANSWER and traj.sources[answer] == [TOOL] * 3
        assert set(traj.versions[answer]) == {3}  # the calling turn's version
        later = range(before + len(ANSWER), len(traj.token_ids))
        if not later:
            continue
        continued += 1
        assert all(traj.versions[i] == 4 for i in later)
        tokens = prompt + traj.token_ids
        lp_old = _teacher_forced(old, tokens)[len(prompt) - 1 :]
        assert max(abs(traj.logprobs[i] - lp_old[i]) for i in range(before)) <= 1e-6
        if kv == "recompute":
            ref = _teacher_forced(new, tokens)[len(prompt) - 1 :]
        else:  # the cache held every token up to the call's last (sampled, not yet computed)
            ref = kept_prefix_logprobs(old, new, tokens, len(prompt) + before - 1)[len(prompt) - 1 :]
            own = _teacher_forced(new, tokens)[len(prompt) - 1 :]
            assert max(abs(ref[i] - own[i]) for i in later if traj.sources[i] == MODEL) > 1e-4
        model_later = [i for i in later if traj.sources[i] == MODEL]
        assert max(abs(traj.logprobs[i] - ref[i]) for i in model_later) <= 1e-6, kv
    assert continued > 0 and len(trajs) == len(PROMPTS)
    assert not engine._sessions  # every session closed
