"""The README's one-GPU quick start, its three commands run at tiny width on the CPU: a synthetic checkpoint
in the released layout (MXFP4 expert blocks and scales, bf16 elsewhere, `quantization_config` in its
config.json) and GSM8K word problems as parquet in verl's schema; the training command's config and
overrides as the README writes them (paths replaced, the model shrunk to hidden 64 with the real tokenizer
and 201,088-way output layer, two RL steps), then `tools/evaluate.py` on its `hf_final` and
`tools/convert_dist_to_hf.py` of its checkpoints, whose export loads as a plain GPT-OSS."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shlex
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from helpers.hf_checkpoints import write_mxfp4_checkpoint

from megatron_gptoss.config import load_config
from megatron_gptoss.envs.word_problems import problems
from megatron_gptoss.hf import load_hf
from megatron_gptoss.model.gpt_oss import build_model
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## One GPU: GRPO of gpt-oss-20b on GSM8K"
INSTRUCTION = ' Output the final answer after "####".'  # verl's gsm8k preprocessing adds one such sentence


def readme_commands() -> list[list[str]]:
    """The commands of the section's first code block (continuation lines joined), as words."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION) :], re.S)
    assert block is not None
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0]) for line in joined.splitlines() if line.strip()]


def verl_gsm8k(path: Path, count: int, held_out: bool) -> Path:
    """GSM8K-format word problems as verl's gsm8k preprocessing writes them."""
    rows = []
    for i, problem in enumerate(problems(count, 0, held_out)):
        row = problem.row()
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "user", "content": row["question"] + ' Output the final answer after "####".'}
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": row["answer"].split("####")[-1].strip()},
                "extra_info": {"split": "test" if held_out else "train", "index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_readme_quickstart_commands_at_tiny_width(tmp_path):
    install, train, evaluate, export = readme_commands()
    assert (
        install[:2] == ["pip", "install"]
        and train[0] == "torchrun"
        and train[train.index("-m") + 1] == ("megatron_gptoss.train")
    )
    config = ROOT / train[train.index("--config") + 1]
    overrides = [w for w in train if re.fullmatch(r"[a-z_]+\.[a-z_]+=.+", w)]
    assert {o.split("=")[0] for o in overrides} == {"run.init_from_hf", "data.train_files", "data.eval_files"}

    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=64",
            "model.num_attention_heads=2", "model.num_query_groups=1", "model.head_dim=16",
            "model.num_experts=4", "model.max_position_embeddings=1024",
            "model.attention_backend=eager"]  # fmt: skip
    base = dataclasses.replace(load_config(config, tiny).model, expert_format="bf16")  # float, to write
    released = write_mxfp4_checkpoint(build_model(base, seed=3), tmp_path / "gpt-oss-20b")
    hf_config = json.loads((released / "config.json").read_text())
    assert hf_config["quantization_config"]["quant_method"] == "mxfp4"
    train_file = verl_gsm8k(tmp_path / "train.parquet", 8, held_out=False)
    test_file = verl_gsm8k(tmp_path / "test.parquet", 2, held_out=True)
    paths = {"run.init_from_hf": str(released), "data.train_files": f"[{train_file}]",
             "data.eval_files": f"[{test_file}]"}  # fmt: skip
    out = tmp_path / "run"
    small = ["env.eval_size=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
             "rollout.max_new_tokens=8", "reward.workers=1", "run.steps=2", "run.eval_every=2",
             "run.save_every=2", "run.tensorboard=false", "run.progress=false",
             f"run.output_dir={out}"]  # fmt: skip
    replaced = [f"{key}={paths[key]}" for key in (o.split("=")[0] for o in overrides)]
    cfg = load_config(config, [*replaced, *tiny, *small])
    assert cfg.model.vocab_size == 201088 and cfg.model.lora.rank > 0
    result = loop.run(cfg)
    assert result.status == "finished" and (out / "hf_final" / "config.json").is_file()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "pg/loss" in m] == [1, 2]
    assert all(math.isfinite(m["pg/loss"]) and m["reward/errors"] == 0.0 for m in lines if "pg/loss" in m)

    # evaluate: the README's flags on hf_final, paths replaced
    args = evaluate[2:]
    assert evaluate[1] == "tools/evaluate.py" and "--greedy" in args
    args[args.index("--checkpoint") + 1] = str(out / "hf_final")
    args[args.index("--data") + 1] = str(test_file)
    args[args.index("--output") + 1] = str(tmp_path / "eval.jsonl")
    metrics = load_tool("evaluate").main([*args, "--max-new-tokens", "8", "--no-progress"])
    assert (
        metrics["rows"] == 2
        if "rows" in metrics
        else len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
    )

    # export: the checkpoints merged into a plain GPT-OSS that loads
    assert export[1] == "tools/convert_dist_to_hf.py" and len(export) == 4
    load_tool("convert_dist_to_hf").main(
        [str(out / "checkpoints"), str(tmp_path / "merged"), "--no-progress"]
    )
    merged = load_hf(tmp_path / "merged")
    assert merged.config.hidden_size == 64 and merged.config.lora.rank == 0
