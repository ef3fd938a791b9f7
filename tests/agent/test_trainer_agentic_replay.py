"""Router replay (`moe.router_replay: r3`) with agentic rollouts in the one trainer: the scripted calculator
policy of tests/agent/test_trainer_agentic.py, engine sessions, float32. The embedded engine records the
experts of every token of every turn, the learner's passes replay them over the whole trajectory (prompt,
model and tool tokens): the engine's log-probs equal the learner's, the on-policy ratio is 1, and the step
logs the replay metrics over every input token of every layer. World 2 (gloo, learner expert parallel 2,
one engine replica per rank, each with its own sessions) samples and learns as world 1; so does world 2
with the engine at expert parallel 2, every turn re-generated in lockstep (each turn's routing rows cut
from its whole-trajectory record), against world 1 re-generating."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.harness import pool
from test_trainer_agentic import REGEN, STEPS, metrics, train, write_inputs

from megatron_gptoss.config import ConfigError, load_config

R3 = ["moe.router_replay=r3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = write_inputs(tmp_path_factory.mktemp("agentic_r3"))
    train(str(base), str(base / "w1"), R3)
    train(str(base), str(base / "w1_regen"), [*R3, *REGEN])
    workers = pool(2)
    workers.run(train, str(base), str(base / "w2_ep2"), [*R3, "parallel.expert_model_parallel_size=2"])
    engine_ep2 = [*R3, *REGEN, "rollout.expert_parallel_size=2"]
    workers.run(train, str(base), str(base / "w2_engine_ep2"), engine_ep2)
    return {name: metrics(base / name) for name in ("w1", "w1_regen", "w2_ep2", "w2_engine_ep2")}


@pytest.mark.parametrize("name", ["w1", "w1_regen"])
def test_r3_replays_every_turn_in_the_trainer(runs, name):
    run = runs[name]
    for step in range(1, STEPS + 1):
        line = run[step]
        assert line["agent/tool_calls_mean"] > 0 and line["agent/tokens_tool"] > 0, line
        assert line["mismatch/tokens"] == line["agent/tokens_model"]
        assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])
        assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
        # every input token (prompt, model and tool tokens) of every row, at each of the 2 layers
        assert line["replay/tokens"] > 2 * (line["agent/tokens_model"] + line["agent/tokens_tool"]), line
        assert line["replay/tokens"] % 2 == 0 and 0.0 <= line["replay/flip_frac"] <= 1.0
        assert line["replay/mismatch_off_abs_diff_max"] >= 0.0


@pytest.mark.parametrize(("sharded", "single"), [("w2_ep2", "w1"), ("w2_engine_ep2", "w1_regen")])
def test_world_2_expert_parallel_replays_as_world_1(runs, sharded, single):
    for step in range(1, STEPS + 1):
        a, b = runs[sharded][step], runs[single][step]
        for key in ("agent/tokens_model", "agent/tokens_tool", "agent/tool_calls_mean", "replay/tokens"):
            assert a[key] == b[key], (step, key, a[key], b[key])
        assert a["replay/flip_frac"] == b["replay/flip_frac"]
        for key in ("pg/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)


def test_r3_with_agentic_rollouts_is_accepted_where_the_engine_records_routing():
    root = Path(__file__).resolve().parents[2] / "configs/demo_cpu.yaml"
    agentic = ["agent.enabled=true", *R3]
    assert load_config(root, agentic).moe.router_replay == "r3"
    with pytest.raises(ConfigError, match="rollout.engine='vllm' does not return it"):
        load_config(root, [*agentic, "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=1"):
        load_config(root, [*agentic, "rollout.tensor_parallel_size=2"])
