"""`rollout.sleep_level` in the one trainer (world 1, the demo's model and task): after generation the
embedded engine frees its KV cache and moves its weights to the host (1) or discards them (2) while the
learner computes, takes the memory back before the sync, and the next step's engine log-probs still equal
the learner's. The bytes released are logged every step, with the engine's step counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.trainer import engines, loop

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.steps=2", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
        "run.export_hf=false", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4"]  # fmt: skip


@pytest.mark.parametrize("level", [1, 2])
def test_the_engine_sleeps_while_the_learner_computes(tmp_path, monkeypatch, level):
    asleep: list[int] = []  # the engine's parameter elements when the trainer wakes it
    original = engines.EmbeddedHost.wake

    def wake(self):
        asleep.append(sum(p.numel() for p in self.engine.model.parameters()))
        return original(self)

    monkeypatch.setattr(engines.EmbeddedHost, "wake", wake)
    out = tmp_path / "run"
    loop.run(
        load_config(
            ROOT / "configs/demo_cpu.yaml", [*FAST, f"rollout.sleep_level={level}", f"run.output_dir={out}"]
        )
    )
    lines = {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert len(asleep) == 2
    if level == 2:
        assert asleep == [0, 0]  # the weights were discarded
    else:
        assert min(asleep) > 0
    for step in (1, 2):
        line = lines[step]
        assert line["engine/kv_cache_gib"] > 0 and line["engine/weights_gib"] > 0
        assert "engine/device_taken_gib" in line
        # the step's 16 rows generated in one batch: every decode step ran them all (a stopped row leaves)
        assert line["engine/steps"] >= 1 and 0 < line["engine/decode_rows_mean"] <= 16
        assert line["engine/prefill_tokens"] > 0 and line["time/engine_decode_step_ms"] > 0
        assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])


def test_sleep_level_is_checked():
    with pytest.raises(ConfigError, match="rollout.sleep_level must be 0, 1 or 2, got 3"):
        load_config(ROOT / "configs/demo_cpu.yaml", ["rollout.sleep_level=3"])
