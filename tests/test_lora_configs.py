"""configs/gpt_oss_20b_lora_1gpu.yaml: the header's command loads it for a world of one GPU, LoRA is on with
a frozen base (at full size: the adapters are a small fraction of the model), the layout fits one rank, and
at tiny width (hidden 64, the real o200k_harmony tokenizer) two RL steps run through the one trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

from test_gsm8k_configs import header_command, launched, tiny

from megatron_gptoss.config import load_config
from megatron_gptoss.envs.word_problems import write_splits
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.parallel.dims import validate_layout
from megatron_gptoss.trainer import loop
from megatron_gptoss.trainer.engines import shares_base

ROOT = Path(__file__).resolve().parents[1]
NAME = "configs/gpt_oss_20b_lora_1gpu.yaml"


def test_the_header_command_loads_a_one_gpu_lora_recipe():
    config, world, overrides = launched(header_command(NAME))
    assert config == NAME and world == 1
    cfg = load_config(ROOT / config, overrides)
    assert cfg.run.init_from_hf.startswith("/path/to/gpt-oss-20b")
    assert cfg.model.lora.enabled and cfg.model.lora.dropout == 0.0
    assert cfg.model.num_layers == 24 and cfg.model.num_experts == 32
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (64, 8)
    assert cfg.rollout.max_new_tokens == 1024 and cfg.data.max_prompt_tokens == 512
    assert cfg.ppo.kl_coef > 0  # the reference is free with LoRA
    assert shares_base(cfg)  # the engine uses the learner's base: the weights are held once
    validate_layout(cfg.parallel, cfg.model, 1)
    model = GPTOSSModel(cfg.model, device="meta")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < 0.03 * total  # adapters only


def test_two_lora_rl_steps_at_tiny_width(tmp_path):
    train, test = write_splits(tmp_path / "data", train=8, test=2, seed=0)
    out = tmp_path / "out"
    small = [f"data.train_files=[{train}]", f"data.eval_files=[{test}]", "env.eval_size=2",
             "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
             "reward.workers=1", "run.steps=2", "run.eval_every=0", "run.save_every=-1",
             "run.export_hf=false", "run.tensorboard=false", "run.progress=false",
             f"run.output_dir={out}"]  # fmt: skip
    cfg = load_config(ROOT / NAME, [*tiny(load_config(ROOT / NAME)), *small])
    assert cfg.model.vocab_size == 201088 and cfg.model.hidden_size == 64 and cfg.model.lora.rank == 32
    loop.run(cfg)
    lines = {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(lines) == [0, 1, 2]
    for step in (1, 2):
        line = lines[step]
        assert line["reward/errors"] == 0.0 and line["train/skipped"] == 0.0
        assert line["mismatch/tokens"] > 0 and math.isfinite(line["pg/loss"])
        assert line["mismatch/abs_diff_max"] < 0.1 and math.isfinite(line["train/grad_norm"])
