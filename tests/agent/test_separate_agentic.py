"""Agentic trajectories under the separate placement (world 2: rank 0 the learner and the agent loop with its
tools, rank 1 the embedded engine), the scripted calculator policy (tests/agent/scripted_policy.py):

- `rollout.max_staleness=1`, every turn re-generated through the engine rank with rounds waiting for every
  tool call, equals the colocated run at world 1 of the same mode: every metric but time/*, perf/*,
  engine/*, idle/* and tool latencies, bit for bit (the same trajectories, losses and gradient norms); the
  trajectories of the batch ahead are generated whole, one version behind the learner from step 2
  (`staleness/max` 1), tools called and their tokens out of the loss;
- partial rollouts (`rollout.partial=true`): each batch's trajectories run in a thread of their own across
  the learner's weight sync; a tool call held until that sync (a patched executor) makes the batch's turns
  straddle it deterministically: the turns before the call record version s - 2, those after it s - 1
  (the engine's record, per token), `staleness/max` stays 1 and every row of every step is trained once
  (two learner ranks are refused: `tests/trainer/test_async.py`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers.batches import observed_batches
from helpers.harness import pool
from test_trainer_agentic import REGEN, metrics, train, write_inputs

from megatron_gptoss.agent.executor import ToolExecutor
from megatron_gptoss.trainer.separate import EngineClient

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


def _train_straddling(base: str, out: str, extra: list[str]) -> None:
    """`train` with every tool call of batch b >= 3 held until the learner's weight sync of step b - 1 (the
    batch was queued at step b - 1, under version b - 2; the run's first sync loads its initial weights),
    and rank 0's trained versions written to OUT/versions.json."""
    syncs = {"count": 0}
    sync, submit = EngineClient.sync, ToolExecutor.submit

    def counted_sync(self):
        metrics = sync(self)
        syncs["count"] += 1
        return metrics

    def held_submit(self, call, **kwargs):
        name = threading.current_thread().name
        batch = int(name.split("-")[1]) if name.startswith("trajectories-") else 0
        deadline = time.monotonic() + 120
        while batch >= 3 and syncs["count"] < batch and time.monotonic() < deadline:  # sync 1: the start's
            time.sleep(0.01)
        return submit(self, call, **kwargs)

    seen: list[dict] = []

    def observe(args, batch):
        masked = batch.loss_mask > 0
        seen.append(
            {"versions": sorted({int(v) for v in batch.versions[masked].tolist()}), "rows": len(args[0])}
        )

    EngineClient.sync, ToolExecutor.submit = counted_sync, held_submit  # type: ignore[method-assign]
    try:
        with observed_batches(observe):
            train(base, out, extra)
    finally:
        EngineClient.sync, ToolExecutor.submit = sync, submit  # type: ignore[method-assign]
    if seen:  # the learner rank
        (Path(out) / "versions.json").write_text(json.dumps(seen))


def test_partial_agentic_trajectories_go_on_across_the_weight_sync(base):
    partial = ["rollout.max_staleness=1", "rollout.partial=true", "run.steps=3"]
    out = base / "partial"
    pool(2).run(_train_straddling, str(base), str(out), ["rollout.placement=separate", *partial])
    lines = metrics(out)
    seen = json.loads((out / "versions.json").read_text())
    assert len(seen) == 3 and all(b["rows"] == 8 for b in seen)  # every row of every step, once
    assert seen[0]["versions"] == [0]
    assert set(seen[1]["versions"]) <= {0, 1}
    assert seen[2]["versions"] == [1, 2]  # turns before the held call at version 1, after it at 2
    for step in (1, 2, 3):
        line = lines[step]
        assert line["staleness/max"] <= 1.0 and line["staleness/dropped_rows"] == 0.0
        assert line["agent/tokens_tool"] > 0 and line["mismatch/tokens"] == line["agent/tokens_model"]
    assert lines[3]["staleness/max"] == 1.0 and 0.0 < lines[3]["staleness/mean"] < 1.0
