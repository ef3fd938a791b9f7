"""Full-parameter RL with the engine's experts in MXFP4 (`rollout.expert_format: mxfp4`): the learner trains
in its dtype, every sync quantizes its experts into the engine's blocks and scales, and the quantization
shows in the logged rollout/learner mismatch (mismatch/*), which the rollout correction weighs.

Two steps of configs/demo_cpu.yaml (2 layers, fp32): finite metrics, mismatch/* far above the fp32 engine's
(< 1e-4, tests/trainer/test_mxfp4_lora_run.py's bound for identical weights), the correction's weights away
from 1, and sync/bytes = the dense tensors in fp32 plus the experts at 4.25 bits a value. Settings the
engine cannot serve are ConfigErrors naming rollout.expert_format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.hf.mxfp4 import packed_shapes
from megatron_gptoss.hf.names import hf_names, hf_shapes, match_hf
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]


def sync_bytes(config) -> int:
    """Bytes of one sync into a world-1 fp32 engine with MXFP4 experts."""
    total = 0
    for name in hf_names(config):
        match = match_hf(name)
        assert match is not None
        shape = tuple(hf_shapes(match, config)[match.hf.index(name)])
        packed = packed_shapes(shape) if match.rule.kind in ("fc1", "fc2") else None
        total += sum(math.prod(s) for s in packed) if packed else 4 * math.prod(shape)
    return total


def test_two_demo_steps_with_mxfp4_engine_experts(tmp_path):
    overrides = [*SMALL, "rollout.expert_format=mxfp4", "run.steps=2", "run.eval_every=0",
                 "run.save_every=-1", "run.export_hf=false", "run.tensorboard=false", "run.progress=false",
                 f"run.output_dir={tmp_path}"]  # fmt: skip
    cfg = load_config(ROOT / "configs/demo_cpu.yaml", overrides)
    assert cfg.rollout.expert_format == "mxfp4" and cfg.model.expert_format == "bf16"
    assert not cfg.model.lora.enabled and cfg.ppo.correction_mode != "none"
    loop.run(cfg)
    lines = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        line = lines[step]
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float)), line
        assert line["mismatch/tokens"] > 0
        assert line["mismatch/abs_diff_mean"] > 1e-3, line  # the engine's experts are quantized
        assert line["mismatch/kl_k3"] > 0
        assert line["correction/weight_max"] != 1.0 or line["correction/weight_min"] != 1.0
        assert line["sync/bytes"] == sync_bytes(cfg.model)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.engine=vllm"], "rollout.expert_format='mxfp4' needs rollout.engine='embedded'"),
        (
            ["rollout.bitwise_on_policy=true", "model.attention_backend=triton"],
            "rollout.expert_format='mxfp4'",
        ),
        (["model.hidden_size=48"], "model.hidden_size=48 is not a multiple"),
        (["rollout.expert_format=fp8"], "rollout.expert_format='fp8' not in"),
    ],
    ids=["vllm", "bitwise", "width", "unknown"],
)
def test_settings_the_mxfp4_engine_cannot_serve_are_named(overrides, message):
    base = (
        []
        if any(o.startswith("rollout.expert_format") for o in overrides)
        else ["rollout.expert_format=mxfp4"]
    )
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs/demo_cpu.yaml", [*base, *overrides])
