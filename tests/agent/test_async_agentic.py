"""Agentic trajectories under asynchronous rollouts (world 1, colocated, `rollout.max_staleness=1`,
`rollout.partial=true`), with the real tokenizer and a policy that calls the calculator
(tests/agent/scripted_policy.py):

- ahead of the learner every trajectory of the next batch samples its first turn and submits its tool call;
  the call is in flight while the learner updates; after the weight sync the trajectory goes on from the
  tool's answer under the new weights. Step s >= 2 trains rows whose tokens up to the call record version
  s - 2 and whose later turns record s - 1 (`staleness/max` 1), tool tokens out of the loss;
- world 2 (two engine replicas, each running its block of trajectories) trains the rows of world 1;
- `partial_kv=recompute`: the turns after the call are computed afresh by the new weights, so their engine
  log-probs equal the learner's (`mismatch/staleness0/abs_diff_max` <= 1e-5, as a synchronous run's; with
  `keep` the old weights' cache makes it 2.8e-3). tests/agent/test_session_run.py checks both modes against
  exact references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.batches import observed_batches
from helpers.harness import pool
from test_trainer_agentic import SAME, overrides, write_inputs

from megatron_gptoss.agent.loop import TOOL
from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _run(base: Path, out: Path, kv: str) -> tuple[list, dict[int, dict]]:
    """The (sources, versions) of every trained row, step by step, and the metrics."""
    rows: list[list[tuple[list[int], list[int]]]] = []

    def recording(args, _):
        _, _, _, _, sources, _, versions = args  # build_batch's (prompt_ids, ..., sources, routing, versions)
        rows.append([(list(s), list(v)) for s, v in zip(sources, versions, strict=True)])

    extra = [
        "rollout.max_staleness=1",
        "rollout.partial=true",
        f"rollout.partial_kv={kv}",
        f"run.steps={STEPS}",
        "optim.lr=3e-2",  # an update that moves attention enough for a kept cache to show
    ]
    with observed_batches(recording):
        loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*overrides(base, str(out)), *extra]))
    lines = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return rows, {line["step"]: line for line in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = write_inputs(tmp_path_factory.mktemp("async_agentic"))
    return base, _run(base, base / "recompute", "recompute")


def test_a_tool_call_in_flight_continues_under_new_weights(runs):
    rows, lines = runs[1]
    assert len(rows) == STEPS
    assert all(set(v) == {0} for _, v in rows[0])  # batch 1: generated whole at version 0
    for step in range(2, STEPS + 1):
        across = 0
        for sources, versions in rows[step - 1]:
            assert len(sources) == len(versions)
            first_tool = sources.index(TOOL) if TOOL in sources else len(sources)
            # the first turn and its call's answer: sampled ahead, one version behind the learner
            assert set(versions[:first_tool]) == {step - 2}, (step, versions)
            if first_tool < len(sources):
                end = next((i for i in range(first_tool, len(sources)) if sources[i] != TOOL), len(sources))
                assert set(versions[first_tool:end]) == {step - 2}  # tool tokens: the calling turn's
                after = versions[end:]
                assert set(after) <= {step - 1}, (step, versions)  # later turns: the new weights
                across += bool(after)
        assert across > 0, f"step {step}: no trajectory went on after a tool call across the update"
        line = lines[step]
        assert line["staleness/max"] == 1.0 and line["staleness/dropped_rows"] == 0.0
        assert line["agent/tokens_tool"] > 0 and line["mismatch/staleness0/tokens"] > 0
    # recomputed: the later turns' engine log-probs are the learner's (a kept cache gives 2.8e-3 here)
    assert max(lines[s]["mismatch/staleness0/abs_diff_max"] for s in range(2, STEPS + 1)) <= 1e-5


def test_two_replicas_sample_as_one(runs):
    """World 2 (learner dp2, an engine replica per rank, each its block of trajectories with its own tools):
    every rank trains the rows of world 1, token versions and all, with the same metrics."""
    base, (rows, lines) = runs
    ranks = pool(2).run(_run, base, base / "w2", "recompute")
    assert ranks[0][0] == ranks[1][0] == rows
    theirs = ranks[0][1]
    for step in range(1, STEPS + 1):
        for key in (*SAME, "staleness/max", "mismatch/staleness0/abs_diff_max"):
            assert theirs[step][key] == lines[step][key], (step, key)
        assert theirs[step]["pg/loss"] == pytest.approx(lines[step]["pg/loss"], rel=1e-4, abs=1e-7)


def test_partial_agentic_needs_sessions_per_replica():
    for extra, message in [
        (["agent.sessions=false"], "agent.sessions=true with agent.enabled"),
        (
            ["rollout.tensor_parallel_size=2"],
            "rollout.tensor_parallel_size=1 and rollout.expert_parallel_size=1",
        ),
    ]:
        with pytest.raises(ConfigError, match="rollout.partial=true needs") as err:
            load_config(None, ["agent.enabled=true", "rollout.partial=true", *extra])
        assert message in str(err.value)
