"""The one-GPU LoRA recipes (gpt-oss-20b and gpt-oss-120b on an 80 GB card, gpt-oss-20b on a 24 GB one):
the header's command loads each for a world of one GPU, LoRA is on over the released MXFP4 experts (at full
size: the adapters are a small fraction of the model, the count the header states, and the lower bound of
the memory fits the card), the layout fits one rank, and at tiny width (hidden 64, the real o200k_harmony
tokenizer) two RL steps of configs/gpt_oss_20b_lora_1gpu.yaml run through the one trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_gsm8k_configs import header_command, launched, tiny

from megatron_gptoss.config import load_config
from megatron_gptoss.config.memory import run_memory
from megatron_gptoss.envs.word_problems import write_splits
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.parallel.dims import validate_layout
from megatron_gptoss.trainer import loop
from megatron_gptoss.trainer.engines import shares_base

ROOT = Path(__file__).resolve().parents[1]
NAME = "configs/gpt_oss_20b_lora_1gpu.yaml"


# config -> (layers, experts, the card it is written for in GiB, the adapter parameters its header states)
CARDS = {
    NAME: (24, 32, 78.0, "0.37 B"),
    "configs/gpt_oss_120b_lora_1gpu.yaml": (36, 128, 78.0, "268.0 M"),
    "configs/gpt_oss_20b_lora_24gb.yaml": (24, 32, 22.0, "91.9 M"),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_header_command_loads_a_one_gpu_lora_recipe(name):
    config, world, overrides = launched(header_command(name))
    assert config == name and world == 1
    cfg = load_config(ROOT / config, overrides)
    layers, experts, card_gib, stated = CARDS[name]
    assert cfg.run.init_from_hf.startswith("/path/to/gpt-oss-")
    assert cfg.model.lora.enabled and cfg.model.lora.dropout == 0.0
    assert cfg.model.num_layers == layers and cfg.model.num_experts == experts
    assert cfg.model.expert_format == "mxfp4"  # the released experts stay 4-bit
    assert cfg.rollout.max_new_tokens == 1024 and cfg.data.max_prompt_tokens == 512
    assert cfg.ppo.kl_coef > 0  # the reference is free with LoRA
    assert shares_base(cfg)  # the engine uses the learner's base: the weights are held once
    validate_layout(cfg.parallel, cfg.model, 1)
    model = GPTOSSModel(cfg.model, device="meta")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < 0.03 * cfg.model.param_counts()["total"]  # adapters only
    assert stated in (ROOT / name).read_text()  # the header's count is the model's
    assert f"{trainable / 1e6:.1f} M" == stated or f"{trainable / 1e9:.2f} B" == stated
    # the base at 4.25 bits an expert value, the adapters' bf16 weights, fp32 gradients, master weights and
    # Adam moments (18 bytes each), and the KV cache the engine is made for: below the card
    memory = run_memory(cfg, 1)
    assert memory["total"] + 18 * trainable < card_gib * 2**30, memory


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
