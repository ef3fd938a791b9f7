"""The agent loop on a scripted engine: the multi-turn stream equals openai-harmony's rendering, tool tokens
carry source tool and log-prob 0, calls run while other trajectories generate, budgets end trajectories,
and re-generation without sessions gives the trajectories sessions give."""

import time

import pytest
from test_tool_tokens import USER_TOOLS, _call, _model_writes, _reference_conversation

from megatron_gptoss.agent import ToolExecutor, ToolRegistry
from megatron_gptoss.agent.loop import MODEL, TOOL, AgentLoop, agent_metrics
from megatron_gptoss.agent.tools import Tool
from megatron_gptoss.config import AgentConfig, SandboxConfig
from megatron_gptoss.engine_api import Generation, SamplingParams, SessionTurn
from megatron_gptoss.errors import ToolError
from megatron_gptoss.harmony import RETURN, render_conversation, render_prompt

SLEEP_TOOL = {
    "name": "sleep",
    "function": "helpers_tools:sleep",
    "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
}


class ScriptedEngine:
    """Each prompt's turns written in advance; log-probs -(k + 1) / 100 for the k-th token sampled. With
    sessions, one call to step_sessions samples the next turn of one running session (the one opened
    first; `log` records which); without, `generate` looks each row's script up by its prompt."""

    def __init__(self, scripts: dict[tuple[int, ...], list[list[int]]]):
        self.scripts = scripts
        self.sessions: dict[int, dict] = {}
        self.states: dict[tuple[int, ...], dict] = {}
        self.log: list[int] = []
        self.generate_calls = 0
        self.counter = 0

    def _turn(self, state: dict, budget: int) -> tuple[list[int], list[float], str]:
        written = self.scripts[tuple(state["prompt"])][state["turn"]]
        state["turn"] += 1
        tokens = written[:budget]
        logprobs = [-(self.counter + k + 1) / 100 for k in range(len(tokens))]
        self.counter += len(tokens)
        return tokens, logprobs, "stop" if len(written) <= budget else "length"

    def open_session(self, prompt_ids, params, seed):
        sid = len(self.sessions)
        self.sessions[sid] = {"prompt": list(prompt_ids), "seq": list(prompt_ids), "turn": 0}
        self.sessions[sid].update(running=True, budget=params.max_new_tokens, closed=False)
        return sid

    def step_sessions(self):
        running = [sid for sid, s in self.sessions.items() if s["running"]]
        assert running, "step_sessions with no running session"
        sid = running[0]
        self.log.append(sid)
        state = self.sessions[sid]
        tokens, logprobs, finish = self._turn(state, state["budget"])
        state["seq"] += tokens
        state["running"] = False
        return [SessionTurn(sid, tokens, logprobs, finish)]

    def extend_session(self, sid, token_ids, max_new_tokens):
        state = self.sessions[sid]
        assert not state["running"] and not state["closed"]
        state["seq"] += token_ids
        state.update(running=True, budget=max_new_tokens)

    def close_session(self, sid):
        self.sessions[sid]["closed"] = True

    def generate(self, prompts, params):
        self.generate_calls += 1
        out = []
        for seq in prompts:
            prompt = next(p for p in self.scripts if tuple(seq[: len(p)]) == p)
            state = self.states.setdefault(prompt, {"prompt": list(prompt), "turn": 0})
            tokens, logprobs, finish = self._turn(state, params.max_new_tokens)
            out.append(Generation(list(seq), tokens, logprobs, finish))
        return out


class PlainEngine:
    """A ScriptedEngine seen without the session capability."""

    def __init__(self, scripted: ScriptedEngine):
        self.scripted = scripted

    def generate(self, prompts, params):
        return self.scripted.generate(prompts, params)


@pytest.fixture(scope="module")
def registry(sandbox_launcher):
    cfg = AgentConfig(tools=[*USER_TOOLS, SLEEP_TOOL])
    cfg.validate()
    return ToolRegistry.from_config(cfg, SandboxConfig(), sandbox_launcher)


def _executor(registry, timeout_s=10.0):
    return ToolExecutor(registry, timeout_s=timeout_s, max_concurrent=4, max_chars=4096)


def _assistant(oh, enc, fields, more: bool):
    written = _model_writes(oh, enc, fields)
    if more:  # the model goes on with another message in the same turn
        written += [enc.encode("<|start|>assistant", allowed_special="all")[0], *enc.encode("assistant")]
    return written


def test_multi_turn_stream_equals_the_reference_rendering(harmony_reference, registry):
    oh, enc = harmony_reference
    user = "Answer using the tools."
    keywords = registry.prompt_keywords()
    prompt = render_prompt([{"role": "user", "content": user}], **keywords)
    thought = {"channel": "analysis", "content": "I look the key up, then compute."}
    calls = [
        _call("functions.lookup", '{"key": "zorblat"}'),
        _call("functions.add", '{"a": 1, "b": '),  # malformed: an error message, the trajectory goes on
        _call("python", "print(7341 * 2)", channel="analysis", content_type="code"),
    ]
    final = {"channel": "final", "content": "14682"}
    turns = [_assistant(oh, enc, thought, True) + _assistant(oh, enc, calls[0], False)]
    turns += [_assistant(oh, enc, c, False) for c in calls[1:]]
    turns.append(_model_writes(oh, enc, final)[:-1] + [RETURN])  # a completion ends a final with <|return|>
    engine = ScriptedEngine({tuple(prompt): turns})
    loop = AgentLoop(engine, _executor(registry), SamplingParams(max_new_tokens=200), AgentConfig())
    (traj,) = loop.rollout([prompt])

    assert traj.finish_reason == "final" and traj.turns == 4
    assert (traj.tool_calls, traj.tool_errors, traj.tool_timeouts) == (3, 1, 0)
    stream = prompt + traj.token_ids
    assert engine.sessions[0]["seq"] == stream and engine.sessions[0]["closed"]

    text = enc.decode_utf8(traj.token_ids)
    assert "7341" in text and "error: the arguments of functions.add are not valid JSON" in text
    # the reference conversation, message by message, with the tool results the loop read back
    runs = []  # (start, end) of each run of tool tokens: a tool message, then <|start|>assistant
    for i, source in enumerate(traj.sources):
        if source == TOOL and (i == 0 or traj.sources[i - 1] == MODEL):
            runs.append([i, i])
        if source == TOOL:
            runs[-1][1] = i + 1
    assert len(runs) == 3
    conversation = [("assistant", thought)]
    messages = [{"role": "user", "content": user}, {"role": "assistant", **thought}]
    for fields, (start, end) in zip(calls, runs):
        output = enc.decode_utf8(traj.token_ids[start : end - 2])
        content = output.split("<|message|>", 1)[1].removesuffix("<|end|>")
        result = {"name": fields["recipient"], "content": content, "channel": fields["channel"]}
        conversation += [("assistant", fields), ("tool", result)]
        messages += [{"role": "assistant", **fields}, {"role": "tool", **result}]
        # after each tool result the stream is the reference's prompt for the model's next turn
        expected = enc.render_conversation_for_completion(
            _reference_conversation(oh, registry, user, conversation), oh.Role.ASSISTANT
        )
        ours = prompt + traj.token_ids[:end]
        assert ours == expected, f"\nours {enc.decode_utf8(ours)!r}\nref  {enc.decode_utf8(expected)!r}"
    messages.append({"role": "assistant", **final})
    trained = render_conversation(messages, **keywords)
    assert trained.token_ids == stream
    assert [bool(s) for s in traj.sources] == trained.assistant_mask[len(prompt) :]
    assert traj.response_mask == traj.sources
    model = [lp for lp, s in zip(traj.logprobs, traj.sources) if s == MODEL]
    tool = [lp for lp, s in zip(traj.logprobs, traj.sources) if s == TOOL]
    assert model == [-(k + 1) / 100 for k in range(len(model))] and set(tool) == {0.0}
    assert len(tool) > 0


def _ids(enc):
    return lambda text: enc.encode(text, allowed_special="all")


def _function_call(ids, name, arguments):
    return ids(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>")


def test_a_slow_call_does_not_stall_the_others_and_turn_budgets(harmony_reference, registry):
    oh, enc = harmony_reference
    ids = _ids(enc)
    call = _function_call(ids, "lookup", '{"key": "zorblat"}')
    slow = _function_call(ids, "sleep", '{"seconds": 0.5}')
    answer = ids("<|channel|>final<|message|>7341<|return|>")
    scripts = {
        (1, 2, 3): [slow, answer],  # waits on a slow tool
        (4, 5, 6): [call, call, call, answer],  # keeps generating meanwhile; its last turn calls
        (7, 8, 9): [ids("<|channel|>final<|message|>no tool<|call|>")],  # <|call|> naming no recipient
        (10, 11): [ids("word " * 40)],  # longer than a turn
    }
    engine = ScriptedEngine(scripts)
    agent = AgentConfig(tools=[*USER_TOOLS, SLEEP_TOOL], max_turns=3)
    executor = _executor(registry)
    loop = AgentLoop(engine, executor, SamplingParams(max_new_tokens=30), agent)
    start = time.monotonic()
    trajs = loop.rollout([list(p) for p in scripts])
    assert time.monotonic() - start >= 0.5
    assert [t.finish_reason for t in trajs] == ["final", "max_turns", "unanswerable", "length"]
    assert [t.turns for t in trajs] == [2, 3, 1, 1] and [t.tool_calls for t in trajs] == [1, 2, 0, 0]
    assert len(trajs[3].token_ids) == 30 and set(trajs[3].sources) == {MODEL}
    assert trajs[1].token_ids[-len(call) :] == call and trajs[1].sources[-1] == MODEL  # no answer to it
    # row 1 ran all its turns while row 0's call slept: row 0's answer came last
    assert engine.log[-1] == 0 and engine.log.count(1) == 3
    assert all(s["closed"] for s in engine.sessions.values())
    metrics = agent_metrics(trajs, rewards=[1.0, 0.0, 0.0, 0.5])
    assert metrics["agent/turns_mean"] == 7 / 4 and metrics["agent/tool_calls_mean"] == 3 / 4
    assert metrics["agent/tokens_tool"] == sum(len(t.sources) - sum(t.sources) for t in trajs) > 0
    assert metrics["agent/tokens_model"] + metrics["agent/tokens_tool"] == sum(
        len(t.token_ids) for t in trajs
    )
    assert metrics["agent/finish_max_turns"] == 1 and metrics["agent/finish_unanswerable"] == 1
    assert metrics["agent/reward_turns_1"] == 0.25 and metrics["agent/reward_turns_2"] == 1.0
    tool = executor.metrics().summary()
    assert tool["tool/calls"] == 3 and tool["tool/latency_max_s"] >= 0.5


def test_the_total_token_budget(harmony_reference, registry):
    oh, enc = harmony_reference
    ids = _ids(enc)
    call = _function_call(ids, "lookup", '{"key": "zorblat"}')
    answer = ids("<|channel|>final<|message|>7341<|return|>")
    scripts = {(1, 2): [call * 4], (3, 4): [call, answer]}
    agent = AgentConfig(tools=USER_TOOLS, max_total_tokens=2 + len(call) + 3)
    loop = AgentLoop(ScriptedEngine(scripts), _executor(registry), SamplingParams(max_new_tokens=200), agent)
    generated, unanswered = loop.rollout([list(p) for p in scripts])
    assert generated.finish_reason == unanswered.finish_reason == "max_total_tokens"
    assert len(generated.token_ids) == len(call) + 3  # the turn's budget: what the trajectory had left
    assert unanswered.token_ids == call and unanswered.tool_calls == 1  # its result would pass the budget
    with pytest.raises(ValueError, match="max_total_tokens"):
        loop.rollout([list(range(len(call) + 5))])


def test_regeneration_without_sessions_gives_the_session_trajectories(harmony_reference, registry):
    oh, enc = harmony_reference
    ids = _ids(enc)
    call = ids(
        '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"key": "quenvy"}<|call|>'
    )
    bad = ids("<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>")
    answer = ids("<|channel|>final<|message|>bluegreen<|return|>")
    scripts = {(1, 2): [call, bad, answer], (3, 4, 5): [answer], (6,): [bad, call, call, answer]}
    agent = AgentConfig(tools=USER_TOOLS, max_turns=8)
    results = []
    for make in (lambda e: e, PlainEngine):
        engine = ScriptedEngine(scripts)
        loop = AgentLoop(make(engine), _executor(registry), SamplingParams(max_new_tokens=64), agent)
        assert loop.use_sessions == (make is not PlainEngine)
        trajs = loop.rollout([list(p) for p in scripts])
        results.append([(t.token_ids, t.sources, t.finish_reason, t.turns, t.tool_calls) for t in trajs])
        if make is PlainEngine:
            assert engine.generate_calls >= 4 and engine.log == []
    assert results[0] == results[1]
    assert [r[2] for r in results[0]] == ["final"] * 3 and [r[4] for r in results[0]] == [2, 0, 3]


def test_a_sandbox_that_cannot_run_raises_and_closes_every_session(harmony_reference):
    oh, enc = harmony_reference
    ids = _ids(enc)

    def refuse(arguments, timeout):
        raise ToolError("refusing to run tools: sandbox layer 'landlock' is missing")

    tool = Tool("functions.lookup", "", {"type": "object"}, refuse)
    executor = ToolExecutor(ToolRegistry([tool]), timeout_s=5.0, max_concurrent=2, max_chars=100)
    call = _function_call(ids, "lookup", "{}")
    engine = ScriptedEngine({(1, 2): [call], (3,): [ids("word " * 50)]})
    loop = AgentLoop(engine, executor, SamplingParams(max_new_tokens=64), AgentConfig())
    with pytest.raises(ToolError, match="landlock"):
        loop.rollout([[1, 2], [3]])
    assert len(engine.sessions) == 2 and all(s["closed"] for s in engine.sessions.values())
