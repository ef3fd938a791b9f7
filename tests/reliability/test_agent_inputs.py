"""Model output and user tools cannot end a run (`agent.loop`, `agent.executor`, `agent.tools`):

- tool-call arguments nested past the interpreter's stack (1,000 deep, or 100,000 unclosed brackets) are an
  error observation for the model, and the trajectory goes on to its final answer;
- a user tool holding the GIL is killed at `agent.tool_timeout_s` and answered as a timeout, while the
  trainer's threads keep running;
- a user tool that ends its process (os._exit, SIGKILL) is an error observation naming how it ended, its
  worker is replaced and the next call runs; sys.exit is an error observation too;
- a worker's start (its imports) is not on the call's clock.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_gptoss.agent import TOOL, AgentLoop, ToolCall, ToolExecutor, ToolRegistry
from megatron_gptoss.config import AgentConfig, SandboxConfig
from megatron_gptoss.engine_api import Generation, SamplingParams
from megatron_gptoss.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE, RETURN, get_tokenizer

TIMEOUT_S = 1.0
TOOLS = [
    {"name": name, "function": f"hostile_tools:{name}", "parameters": {"type": "object"}}
    for name in ("hold_gil", "exit_now", "kill_self", "exit_politely", "worker_pid")
]
AGENT = AgentConfig(
    builtin_tools=["calculator"],
    tools=TOOLS,
    tool_timeout_s=TIMEOUT_S,
    max_concurrent_calls=4,
    max_total_tokens=1_000_000,
)
DEEP = {  # arguments of a calculator call
    "arrays": '{"expression": ' + "[" * 1000 + "]" * 1000 + "}",
    "objects": '{"expression": ' + '{"a": ' * 1000 + "1" + "}" * 1001,
    "unclosed": "[" * 100_000,
}


@pytest.fixture(scope="module")
def executor():
    AGENT.validate()
    executor = ToolExecutor.from_config(ToolRegistry.from_config(AGENT, SandboxConfig()), AGENT)
    yield executor
    executor.close()


def _call(recipient: str, arguments: str) -> ToolCall:
    return ToolCall(recipient, "commentary", "<|constrain|>json", arguments)


def _model_calls(recipient: str, arguments: str) -> list[int]:
    """The tokens of a function call the model writes after `<|start|>assistant`."""
    encode = get_tokenizer().encode
    header = [CHANNEL, *encode(f"commentary to={recipient} "), CONSTRAIN, *encode("json"), MESSAGE]
    return [*header, *encode(arguments), CALL]


class ScriptedEngine:
    """Re-generation without sessions: each prompt's turns in order, found by the prompt's first token."""

    def __init__(self, scripts: dict[int, list[list[int]]]):
        self.scripts = {first: list(turns) for first, turns in scripts.items()}

    def generate(self, prompts, params):
        out = []
        for seq in prompts:
            tokens = self.scripts[seq[0]].pop(0)
            out.append(Generation(list(seq), tokens, [-0.5] * len(tokens), "stop"))
        return out


def _wait_gone(pid: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} is still there {within_s} s later")


def test_hostile_calls_are_observations_and_every_trajectory_ends(executor, tmp_path):
    encode = get_tokenizer().encode
    final = [CHANNEL, *encode("final"), MESSAGE, *encode("done"), RETURN]
    calls = {name: ("functions.calculator", arguments) for name, arguments in DEEP.items()}
    calls["gil"] = ("functions.hold_gil", json.dumps({"pid_file": str(tmp_path / "pid")}))
    calls["exit"] = ("functions.exit_now", '{"code": 3}')
    scripts = {i + 1: [_model_calls(*call), final] for i, call in enumerate(calls.values())}
    loop = AgentLoop(
        ScriptedEngine(scripts), executor, SamplingParams(max_new_tokens=100_000), AGENT, use_sessions=False
    )
    trajectories = loop.rollout([[first, 7, 8] for first in scripts])
    observations = {}
    for name, traj in zip(calls, trajectories):
        assert (traj.finish_reason, traj.turns, traj.tool_calls) == ("final", 2, 1), name
        assert traj.token_ids[-len(final) :] == final
        observations[name] = get_tokenizer().decode(
            [t for t, s in zip(traj.token_ids, traj.sources) if s == TOOL]
        )
        assert (traj.tool_errors, traj.tool_timeouts) == ((0, 1) if name == "gil" else (1, 0)), name
    for name, depth in (("arrays", 1001), ("objects", 1001), ("unclosed", 100_000)):
        assert f"nest {depth} arrays or objects deep; at most 64 are accepted" in observations[name]
    assert "error: functions.hold_gil timed out after 1 s" in observations["gil"]
    assert (
        "error: functions.exit_now failed: its worker process ended (exit status 3)" in observations["exit"]
    )
    _wait_gone(int((tmp_path / "pid").read_text()))


def test_a_tool_holding_the_gil_is_killed_at_its_timeout(executor, tmp_path):
    assert executor.run(_call("functions.worker_pid", "{}")).status == "ok"  # a worker started, idle
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    stuck = executor.submit(_call("functions.hold_gil", json.dumps({"pid_file": str(pid_file)})))
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() - start < TIMEOUT_S, "the tool did not start"
        time.sleep(0.005)
    # the tool backtracks, holding its interpreter's GIL: this process's threads run on
    assert executor.run(_call("functions.calculator", '{"expression": "6 * 7"}')).text == "42"
    assert time.monotonic() - start < TIMEOUT_S
    outcome = stuck.result(timeout=10)
    assert (outcome.status, outcome.text) == ("timeout", "error: functions.hold_gil timed out after 1 s")
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 2.0
    _wait_gone(int(pid_file.read_text()))  # killed, not left to backtrack
    assert executor.run(_call("functions.worker_pid", "{}")).status == "ok"


@pytest.mark.parametrize(
    "tool, arguments, how",
    [("exit_now", '{"code": 3}', "exit status 3"), ("kill_self", "{}", "killed by signal 9")],
)
def test_a_tool_ending_its_process_is_an_error_and_its_worker_replaced(executor, tool, arguments, how):
    worker = int(executor.run(_call("functions.worker_pid", "{}")).text)  # the idle worker taken next
    outcome = executor.run(_call(f"functions.{tool}", arguments))
    assert (outcome.status, outcome.text) == (
        "error",
        f"error: functions.{tool} failed: its worker process ended ({how}); a new worker takes the next call",
    )
    _wait_gone(worker)
    after = executor.run(_call("functions.worker_pid", "{}"))
    assert after.status == "ok" and int(after.text) != worker


def test_sys_exit_in_a_tool_is_an_error_and_its_worker_stays(executor):
    worker = executor.run(_call("functions.worker_pid", "{}")).text
    outcome = executor.run(_call("functions.exit_politely", '{"code": 2}'))
    assert (outcome.status, outcome.text) == ("error", "error: functions.exit_politely failed: SystemExit: 2")
    assert executor.run(_call("functions.worker_pid", "{}")).text == worker


def test_a_worker_start_is_not_on_the_call_clock(monkeypatch):
    monkeypatch.setenv("HOSTILE_TOOLS_IMPORT_S", "1.5")  # this process imported them already
    agent = AgentConfig(builtin_tools=[], tools=TOOLS[-1:], tool_timeout_s=0.5)
    executor = ToolExecutor.from_config(ToolRegistry.from_config(agent, SandboxConfig()), agent)
    try:
        outcome = executor.run(_call("functions.worker_pid", "{}"))
        assert outcome.status == "ok" and outcome.latency_s >= 1.5, outcome
        assert executor.metrics().abandoned == 0
    finally:
        executor.close()
