"""Agentic trajectories under the separate placement (world 2: rank 0 the learner and the agent loop with its
tools, rank 1 the embedded engine), the scripted calculator policy (tests/agent/scripted_policy.py):

- `rollout.max_staleness=1`, every turn re-generated through the engine rank with rounds waiting for every
  tool call, equals the colocated run at world 1 of the same mode: every metric but time/*, perf/*,
  engine/*, idle/* and tool latencies, bit for bit (the same trajectories, losses and gradient norms); the
  trajectories of the batch ahead are generated whole, one version behind the learner from step 2
  (`staleness/max` 1), tools called and their tokens out of the loss;
- partial rollouts stay refused there: a trajectory paused at a tool call keeps an engine session, which the
  engine ranks do not serve."""

from __future__ import annotations

import pytest
from helpers.harness import pool
from test_trainer_agentic import REGEN, metrics, train, write_inputs

from megatron_gptoss.config import ConfigError, load_config

SKIP = ("time/", "perf/", "engine/", "idle/", "tool/latency_", "tool/peak_running")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("separate_agentic"))


def test_separate_agentic_equals_colocated(base):
    """k = 1: the batch ahead generated whole through the engine rank equals the colocated run's."""
    k1 = ["rollout.max_staleness=1", *REGEN]
    pool(2).run(train, str(base), str(base / "separate"), ["rollout.placement=separate", *k1])
    train(str(base), str(base / "colocated"), k1)
    ours, theirs = metrics(base / "separate"), metrics(base / "colocated")
    assert sorted(ours) == sorted(theirs) == [0, 1, 2]
    for step, line in theirs.items():
        kept = {k: v for k, v in line.items() if not k.startswith(SKIP)}
        assert {k: v for k, v in ours[step].items() if not k.startswith(SKIP)} == kept, step
    assert [ours[s]["staleness/max"] for s in (1, 2)] == [0.0, 1.0]
    assert ours[1]["tool/calls"] > 0  # batch 2's calls were made ahead, in step 1
    for step in (1, 2):
        line = ours[step]
        assert line["agent/tokens_tool"] > 0 and line["staleness/dropped_rows"] == 0.0
        assert line["mismatch/tokens"] == line["agent/tokens_model"]  # tool tokens out of the loss


def test_partial_agentic_is_refused_under_separate():
    with pytest.raises(ConfigError, match="rollout.placement='separate' needs") as err:
        load_config(None, ["rollout.placement=separate", "agent.enabled=true", "rollout.partial=true"])
    assert "rollout.partial=false with agent.enabled" in str(err.value)
