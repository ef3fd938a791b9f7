"""Every config a launcher, a doc or another config names exists; every config in configs/ loads, its
layout fits the world it is written for (at its real size and shrunk to a tiny model), and the CPU
layouts run: the demo (tests/test_train_demo.py), tiny_rl_tp2_pp2 (tests/trainer/test_colocated.py),
tiny_tp2_pp2 (tests/test_launch.py) and tiny_ep2_pp2_interleaved (here, two supervised steps on 4 gloo
ranks)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.parallel.dims import validate_layout
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[1]
# the world size each config is written for
WORLDS = {
    "configs/demo_cpu.yaml": 1,
    "configs/demo_reverse.yaml": 1,
    "configs/demo_reverse_gpu.yaml": 1,
    "configs/demo_word_problems.yaml": 1,
    "configs/demo_lookup.yaml": 1,
    "configs/layouts/tiny_tp2_pp2_cpu.yaml": 4,
    "configs/layouts/tiny_ep2_pp2_interleaved_cpu.yaml": 4,
    "configs/layouts/tiny_rl_tp2_pp2_cpu.yaml": 4,
    "configs/layouts/gpt_oss_120b_width_rl_4gpu.yaml": 4,
    "configs/layouts/gpt_oss_20b_8gpu.yaml": 8,
    "configs/layouts/gpt_oss_120b_32gpu.yaml": 32,
    "configs/layouts/gpt_oss_120b_64gpu.yaml": 64,
    "configs/gpt_oss_20b_gsm8k.yaml": 8,
    "configs/gpt_oss_120b_gsm8k.yaml": 64,
    "configs/gpt_oss_20b_retool.yaml": 8,
    "configs/gpt_oss_20b_lora_1gpu.yaml": 1,
    "configs/gpt_oss_20b_lora_24gb.yaml": 1,
    "configs/gpt_oss_120b_lora_1gpu.yaml": 1,
}
NAMED = re.compile(r"configs/[A-Za-z0-9_./-]+\.yaml")


def test_every_named_config_exists_and_every_config_has_a_world():
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("launch/*"), *ROOT.glob("tools/*"),
             *ROOT.glob("configs/**/*.yaml"), *ROOT.glob("megatron_gptoss/**/*.py")]  # fmt: skip
    named = {m for f in files if f.is_file() for m in NAMED.findall(f.read_text())}
    assert named, "no config named anywhere: the pattern is wrong"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"named but missing: {missing}"
    present = {str(p.relative_to(ROOT)) for p in ROOT.glob("configs/**/*.yaml")}
    assert present == set(WORLDS), "every config needs its world size here"


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_layout_fits_its_world_at_full_and_tiny_size(name):
    cfg = load_config(ROOT / name)
    world = WORLDS[name]
    validate_layout(cfg.parallel, cfg.model, world)
    p = cfg.parallel
    stages = p.pipeline_model_parallel_size * p.virtual_pipeline_model_parallel_size
    width = 64 * p.tensor_model_parallel_size  # whole 64 x 64 tiles for the MXFP4 experts held tiled
    layers = max(stages, len(p.pipeline_layers) and sum(p.pipeline_layers))
    tiny = [f"model.hidden_size={width}", "model.head_dim=16", f"model.num_layers={layers}",
            f"model.intermediate_size={width}", "model.vocab_size=200"]  # fmt: skip
    if p.pipeline_layers:
        tiny.append(f"parallel.pipeline_layers={list(p.pipeline_layers)}")
    small = load_config(ROOT / name, tiny)
    validate_layout(small.parallel, small.model, world)


def _sft_steps(out: str) -> None:
    overrides = ["run.steps=2", f"run.output_dir={out}", "run.tensorboard=false", "run.progress=false",
                 "run.export_hf=false", "sft.token_budget=32", "sft.micro_batches=2"]  # fmt: skip
    loop.run(load_config(ROOT / "configs/layouts/tiny_ep2_pp2_interleaved_cpu.yaml", overrides))


def test_interleaved_expert_parallel_layout_trains(tmp_path):
    pool(4).run(_sft_steps, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["sft/tokens"] > 0 and line["train/skipped"] == 0.0 for line in lines)
