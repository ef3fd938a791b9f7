"""ToolExecutor: calls overlap, a stuck tool is answered at its timeout without holding the others, the
metrics count what happened, and a sandbox failure reaches the caller."""

import time

import pytest

from megatron_gptoss.agent import ToolCall, ToolRegistry
from megatron_gptoss.agent.executor import ToolExecutor
from megatron_gptoss.agent.tools import Tool, ToolTimeout
from megatron_gptoss.config import AgentConfig, SandboxConfig
from megatron_gptoss.errors import ToolError

SLEEP = {
    "name": "sleep",
    "function": "helpers_tools:sleep",
    "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
}


def _call(recipient, arguments, channel="commentary"):
    return ToolCall(recipient, channel, "<|constrain|>json", arguments)


@pytest.fixture(scope="module")
def registry(sandbox_launcher):
    cfg = AgentConfig(tools=[SLEEP])
    return ToolRegistry.from_config(cfg, SandboxConfig(), sandbox_launcher)


def test_calls_run_concurrently(registry):
    executor = ToolExecutor(registry, timeout_s=5.0, max_concurrent=8, max_chars=1000)
    start = time.monotonic()
    futures = [executor.submit(_call("functions.sleep", '{"seconds": 1.5}')) for _ in range(8)]
    outcomes = [f.result(timeout=60) for f in futures]
    wall = time.monotonic() - start
    assert [o.text for o in outcomes] == ["slept 1.5"] * 8
    m = executor.metrics()
    assert (m.calls, m.ok, m.errors, m.timeouts) == (8, 8, 0, 0)
    assert m.peak_running == 8 and min(m.latencies) >= 1.5
    # serially the calls take 12 s after their workers start; the workers start together (each a Python
    # process: seconds on a loaded machine), so the wall time stays far below the sum of the latencies
    assert wall < 0.5 * sum(m.latencies), (wall, m.latencies)


def test_python_calls_run_concurrently(registry):
    executor = ToolExecutor(registry, timeout_s=20.0, max_concurrent=4, max_chars=1000)
    start = time.monotonic()
    code = "import time\ntime.sleep(1.5)\nprint('done')"
    futures = [executor.submit(_call("python", code, "analysis")) for _ in range(4)]
    assert [f.result(timeout=60).text for f in futures] == ["done\n"] * 4
    wall = time.monotonic() - start
    latencies = executor.metrics().latencies
    assert min(latencies) >= 1.5
    assert wall < 0.6 * sum(latencies), (wall, latencies)  # run one after another, wall = sum


def test_a_stuck_tool_never_stalls_the_others(registry):
    executor = ToolExecutor(registry, timeout_s=1.0, max_concurrent=2, max_chars=1000)
    start = time.monotonic()
    stuck = executor.submit(_call("functions.sleep", '{"seconds": 30}'))
    quick = [executor.submit(_call("functions.calculator", f'{{"expression": "{i} * 3"}}')) for i in range(6)]
    assert [f.result(timeout=5).text for f in quick] == [str(i * 3) for i in range(6)]
    assert not stuck.done()  # all answered while the stuck call holds its slot
    outcome = stuck.result(timeout=5)
    assert outcome.status == "timeout" and "timed out after 1 s" in outcome.text
    # 1 s after its worker took the call (a worker's start takes seconds on a loaded machine), long before
    # the 30 s the tool would sleep
    assert 1.0 <= time.monotonic() - start < 10.0
    # its slot is free again although its thread still sleeps
    assert executor.run(_call("functions.calculator", '{"expression": "1 + 1"}')).text == "2"
    m = executor.metrics()
    assert (m.calls, m.ok, m.timeouts, m.abandoned) == (8, 7, 1, 1)


def test_python_timeout_and_malformed_calls_are_counted(registry):
    executor = ToolExecutor(registry, timeout_s=1.0, max_concurrent=4, max_chars=1000)
    calls = [
        _call("python", "while True:\n    pass", "analysis"),
        _call("functions.sleep", "{not json"),
        _call("functions.nope", "{}"),
        _call("functions.calculator", '{"expression": "2 + 2"}'),
    ]
    outcomes = [f.result(timeout=10) for f in [executor.submit(c) for c in calls]]
    assert [o.status for o in outcomes] == ["timeout", "error", "error", "ok"]
    assert (
        executor.run(_call("functions.calculator", '{"expression": "1"}'), budget_left=False).status
        == "error"
    )
    summary = executor.metrics().summary()
    assert (summary["tool/calls"], summary["tool/errors"], summary["tool/timeouts"]) == (5, 3, 1)
    assert summary["tool/latency_max_s"] >= 1.0 and summary["tool/abandoned"] == 0
    assert executor.metrics().calls == 0  # reset


def test_sandbox_failure_reaches_the_caller():
    def refuse(arguments, timeout):
        raise ToolError("sandbox layer 'landlock' is missing")

    executor = ToolExecutor(
        ToolRegistry([Tool("python", "", None, refuse)]), timeout_s=1, max_concurrent=1, max_chars=10
    )
    with pytest.raises(ToolError, match="landlock"):
        executor.run(_call("python", "print(1)", "analysis"))


def test_a_tool_killed_at_its_own_timeout_counts_as_abandoned():
    """The race of the two clocks: a user tool's worker killed by its own timeout (here a tool that reports
    its start and times out at once, before the executor's 5 s) is counted abandoned, as when the executor
    answers first; the count does not depend on which clock fired."""

    def killed(arguments, timeout, started):
        started()
        raise ToolTimeout("error: functions.stuck timed out after 5 s")

    stuck = Tool("functions.stuck", "times out at once", {"type": "object", "properties": {}}, killed, True)
    executor = ToolExecutor(ToolRegistry([stuck]), timeout_s=5.0, max_concurrent=1, max_chars=1000)
    outcome = executor.run(_call("functions.stuck", "{}"))
    assert outcome.status == "timeout" and outcome.latency_s < 5.0
    m = executor.metrics()
    assert (m.calls, m.timeouts, m.abandoned) == (1, 1, 1)
