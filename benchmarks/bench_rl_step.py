"""The whole RL step of gpt-oss-20b with LoRA on one GPU, at full size: rollout with the embedded engine,
log-probs, update, weight sync, through the one trainer (`configs/gpt_oss_20b_lora_1gpu.yaml`).

    python benchmarks/bench_rl_step.py                       # 64 prompts x 8 samples, responses up to 1024
    python benchmarks/bench_rl_step.py --tiny                # toy model and batch (a CPU smoke run)

Weights: random, as a synthetic checkpoint in the released layout (MXFP4 experts;
`benchmarks/bench_rollout.py`'s writer, --ckpt, reused when present), loaded by `run.init_from_hf`. Prompts:
two-step word problems in GSM8K's format (`tools/make_word_problems.py`) rendered in harmony with the
o200k_harmony tokenizer (`data.max_prompt_tokens: 512`). Random weights rarely sample a stop token, so most
responses run to the budget: the step is close to its largest. Prints per step the seconds of each phase
(`time/*`), the sampled tokens per second of generation, the tokens (prompt and response) per second of the
whole step, the peak device memory (`perf/peak_gib`) and the bytes the sync sent (`sync/bytes`). The first
step includes the Triton compilations and the capture of the decode graphs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_rollout import write_synthetic_mxfp4

from megatron_gptoss.config import gpt_oss_20b, load_config
from megatron_gptoss.envs.word_problems import write_splits

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/gpt_oss_20b_lora_1gpu.yaml"
TINY = ["model.preset=gpt_oss_demo", "model.vocab_size=201088", "model.make_vocab_size_divisible_by=128",
        "model.hidden_size=64", "model.intermediate_size=64", "model.lora.rank=4", "rollout.dtype=float32",
        "run.dtype=float32", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=8", "ppo.num_micro_batches=1", "ppo.num_mini_batches=1"]  # fmt: skip
COLUMNS = ["time/generate_s", "time/logprobs_s", "time/update_s", "time/sync_s"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/bench_rollout_ckpt"))
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_rl_step"))
    args, overrides = parser.parse_known_args(argv)
    overrides = [*(TINY if args.tiny else []), *overrides]
    config = load_config(CONFIG, overrides).model
    ckpt = args.ckpt if not args.tiny else args.out / "ckpt"
    if config.num_layers != gpt_oss_20b().num_layers and not args.tiny:
        raise SystemExit("the full-size step needs gpt-oss-20b's layers; --tiny for a toy run")
    write_synthetic_mxfp4(config, ckpt)
    data = args.out / "data"
    write_splits(data, train=512, test=8)
    run_dir = args.out / "run"
    command = [
        sys.executable, "-m", "megatron_gptoss.train", "--config", str(CONFIG),
        f"run.init_from_hf={ckpt}", f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.eval_files=[{data / 'test.jsonl'}]", f"run.steps={args.steps}", "run.eval_every=0",
        "env.eval_size=8", "run.save_every=0", "run.export_hf=false", "run.progress=false",
        "run.tensorboard=false", f"run.output_dir={run_dir}", "run.overwrite=true", *overrides,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    cfg = load_config(CONFIG, overrides)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "time/generate_s" in line]
    print(f"## RL step: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_experts} "
          f"experts, LoRA rank {config.lora.rank}; {rows} rollouts of up to {cfg.rollout.max_new_tokens} "
          "tokens")  # fmt: skip
    header = ["step", *[c.split("/")[1] for c in COLUMNS], "phases_s", "response_len", "gen_tok_per_s",
              "peak_gib", "sync_mib"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for line in steps:
        length = line.get("response/length_mean", float("nan"))
        gen_tps = length * rows / line["time/generate_s"] if line.get("time/generate_s") else float("nan")
        total = sum(line.get(c, 0.0) for c in COLUMNS)
        cells = [str(line["step"]), *[f"{line.get(c, float('nan')):.2f}" for c in COLUMNS], f"{total:.2f}",
                 f"{length:.0f}",
                 f"{gen_tps:,.0f}", f"{line.get('perf/peak_gib', float('nan')):.1f}",
                 f"{line.get('sync/bytes', float('nan')) / 2**20:.1f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    return steps


if __name__ == "__main__":
    main()
