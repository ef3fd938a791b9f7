"""Two RL steps of the demo (configs/demo_cpu.yaml) with LoRA over MXFP4 experts, held as the checkpoints
store them and as the pairs' bytes stored tile by tile: the random experts are quantized once, the embedded
engine shares the learner's 4-bit base, every step logs finite metrics (the engine/learner mismatch among
them), the checkpoint stores the adapters alone, the final HF export loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from megatron_gptoss.config import load_config
from megatron_gptoss.hf import load_hf
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("byte_format", ["checkpoint", "tiled_pairs"])
def test_two_demo_steps_with_lora_over_mxfp4_experts(tmp_path, byte_format):
    overrides = ["model.expert_format=mxfp4", "model.lora.rank=4", "model.num_layers=2",
                 f"model.mxfp4_byte_format={byte_format}",
                 "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "run.steps=2",
                 "run.eval_every=0", "run.save_every=2", "run.tensorboard=false",
                 "run.progress=false", f"run.output_dir={tmp_path}"]  # fmt: skip
    cfg = load_config(ROOT / "configs/demo_cpu.yaml", overrides)
    assert cfg.model.expert_format == "mxfp4" and cfg.model.lora.enabled
    loop.run(cfg)
    model = GPTOSSModel(cfg.model, device="meta")  # fp32 run: 4 bytes a value
    adapter_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if is_adapter_param(n))
    lines = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        line = lines[step]
        mismatch = {k: v for k, v in line.items() if k.startswith("mismatch/")}
        assert mismatch and line["mismatch/tokens"] > 0, line
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float)), line
        assert line["mismatch/abs_diff_max"] < 1e-4  # the same kernels on the same 4-bit base, fp32
        assert line["sync/bytes"] == adapter_bytes  # the engine shares the learner's base: adapters sent
    # the checkpoint holds the adapters (and their optimizer state) only: nothing of the frozen 4-bit base
    step = tmp_path / "checkpoints" / "step_000002"
    stored = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model/")]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys
    assert json.loads((step / "manifest.json").read_text())["model"]["expert_format"] == "mxfp4"
    # the final HF export: experts dequantized and merged with their adapters, loadable as a plain model
    exported = load_hf(tmp_path / "hf_final")
    assert exported.config.expert_format == "bf16" and exported.config.num_layers == 2
