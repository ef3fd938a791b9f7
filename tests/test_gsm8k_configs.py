"""The GSM8K RL configs (and ReTool's: GSM8K with the python tool): the command line in each header
loads (the world it launches is the config's), the learner's and the engine's layouts fit that world at
full size and at the tiny width run here, and each config trains: at tiny width (hidden 64, the real
o200k_harmony tokenizer and its 201,088-way output layer) on one rank, the layout shrunk to 1 x 1, two RL
steps on generated GSM8K-format word problems through the one trainer, scored by the GSM8K reward in a
worker process."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from megatron_gptoss.config import ParallelConfig, TrainConfig, load_config
from megatron_gptoss.envs.word_problems import write_splits
from megatron_gptoss.parallel.dims import validate_layout
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[1]
WORLDS = {
    "configs/gpt_oss_20b_gsm8k.yaml": 8,
    "configs/gpt_oss_120b_gsm8k.yaml": 64,
    "configs/gpt_oss_20b_retool.yaml": 8,
}
PROCS_PER_NODE = 8  # launch/slurm_train.sbatch's default
COMMAND = re.compile(r"^#   ((?:torchrun|CONFIG=).*)$")


def header_command(name: str) -> list[str]:
    """The command line of the config's header comment (continuation lines joined), as words."""
    lines = (ROOT / name).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if COMMAND.match(line))
    text = lines[start][4:]
    for line in lines[start + 1 :]:
        if not text.endswith("\\"):
            break
        text = text[:-1] + line.removeprefix("#").strip()
    return shlex.split(text)


def launched(words: list[str]) -> tuple[str, int, list[str]]:
    """(config, world size, overrides) of a torchrun or Slurm command."""
    overrides = [w for w in words if re.fullmatch(r"[a-z_]+\.[a-z_]+=.+", w)]
    if words[0] == "torchrun":
        return words[words.index("--config") + 1], int(words[words.index("--nproc_per_node") + 1]), overrides
    config = words[0].removeprefix("CONFIG=")
    assert words[1:2] == ["sbatch"] and words[-len(overrides) - 1] == "launch/slurm_train.sbatch", words
    return config, int(words[words.index("--nodes") + 1]) * PROCS_PER_NODE, overrides


def tiny(cfg: TrainConfig) -> list[str]:
    """Overrides shrinking the model to hidden and intermediate 64 (whole tiles for MXFP4 experts held
    "tiled_pairs") and keeping it a fit for both of the config's layouts:
    layers a multiple of the pipeline stages, heads and KV heads divisible by tp, experts by both ep;
    eager attention (the CPU's reference kernel; Triton's runs under its slow interpreter here)."""
    p, r = cfg.parallel, cfg.rollout
    stages = p.pipeline_model_parallel_size * p.virtual_pipeline_model_parallel_size
    experts = math.lcm(p.expert_model_parallel_size, r.expert_parallel_size, cfg.model.moe_router_topk)
    tp = math.lcm(p.tensor_model_parallel_size, r.tensor_parallel_size)
    return [f"model.num_layers={max(2, stages)}", "model.hidden_size=64", "model.intermediate_size=64",
            f"model.num_attention_heads={2 * tp}", f"model.num_query_groups={tp}", "model.head_dim=16",
            f"model.num_experts={experts}", "model.max_position_embeddings=1024",
            "model.attention_backend=eager"]  # fmt: skip


def layouts_fit(cfg: TrainConfig, world: int) -> None:
    validate_layout(cfg.parallel, cfg.model, world)
    engine = ParallelConfig(
        tensor_model_parallel_size=cfg.rollout.tensor_parallel_size,
        expert_model_parallel_size=cfg.rollout.expert_parallel_size,
    )
    validate_layout(engine, cfg.model, world)


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_the_header_command_loads_the_gsm8k_recipe(name):
    config, world, overrides = launched(header_command(name))
    assert config == name and world == WORLDS[name]
    cfg = load_config(ROOT / config, overrides)
    assert cfg.run.init_from_hf.startswith("/path/to/gpt-oss-")
    files = [*cfg.data.train_files, *cfg.data.eval_files]
    assert [Path(f).name for f in files] == ["train.parquet", "test.parquet"]
    assert (cfg.run.mode, cfg.env.name, cfg.reward.name) == ("rl", "dataset", "gsm8k")
    assert cfg.run.dtype == cfg.rollout.dtype == "bfloat16"
    assert cfg.ppo.correction_mode == "token-tis" and cfg.ppo.clip_ratio_high > cfg.ppo.clip_ratio_low
    assert cfg.ppo.kl_coef <= 1e-3 and cfg.optim.lr <= 1e-5
    assert 8 <= cfg.rollout.n_samples_per_prompt <= 16 and 1024 <= cfg.rollout.max_new_tokens <= 2048
    assert cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == 0  # log-probs of the untruncated distribution


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_layouts_fit_the_world_at_full_and_tiny_size(name):
    cfg = load_config(ROOT / name)
    layouts_fit(cfg, WORLDS[name])
    layouts_fit(load_config(ROOT / name, tiny(cfg)), WORLDS[name])


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_two_rl_steps_at_tiny_width(name, tmp_path):
    train, test = write_splits(tmp_path / "data", train=8, test=2, seed=0)
    out = tmp_path / "out"
    one_rank = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                "parallel.expert_model_parallel_size=1", "parallel.sequence_parallel=false",
                "rollout.tensor_parallel_size=1", "rollout.expert_parallel_size=1"]  # fmt: skip
    small = [f"data.train_files=[{train}]", f"data.eval_files=[{test}]", "env.eval_size=2",
             "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
             "reward.workers=1", "run.steps=2", "run.eval_every=0", "run.save_every=-1",
             "run.export_hf=false", "run.tensorboard=false", "run.progress=false",
             f"run.output_dir={out}"]  # fmt: skip
    cfg = load_config(ROOT / name, [*tiny(load_config(ROOT / name)), *one_rank, *small])
    assert cfg.model.vocab_size == 201088 and cfg.model.hidden_size == 64 and cfg.run.dtype == "bfloat16"
    final = loop.run(cfg)
    lines = {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(lines) == [0, 1, 2] and "reward/eval_mean" in final
    for step in (1, 2):
        line = lines[step]
        assert line["reward/errors"] == 0.0 and line["reward/timeouts"] == 0.0
        assert 0.0 <= line["reward/train_mean"] <= 1.0 and line["response/length_mean"] > 0
        assert line["mismatch/tokens"] > 0 and math.isfinite(line["pg/loss"])
        assert line["train/grad_norm"] < 1e3
        assert line["train/skipped"] == 0.0
        if cfg.agent.enabled:  # ReTool: python-tool trajectories (a random model seldom calls it)
            assert 0.0 <= line["agent/call_rate"] <= 1.0 and line["agent/turns_mean"] >= 1.0
