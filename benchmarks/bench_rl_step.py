"""The whole RL step of gpt-oss-20b or gpt-oss-120b with LoRA on one GPU (or --nproc of them), at full size:
rollout with the embedded engine, log-probs, update, weight sync, through the one trainer.

    python benchmarks/bench_rl_step.py                       # gpt-oss-20b, 64 prompts x 8, responses <= 1024
    python benchmarks/bench_rl_step.py --expert-format bf16  # the same step with the experts held in bf16
    python benchmarks/bench_rl_step.py --config configs/gpt_oss_20b_lora_24gb.yaml run.device_memory_gib=22
    python benchmarks/bench_rl_step.py --model gpt_oss_120b --steps 1 rollout.prompts_per_step=64
    python benchmarks/bench_rl_step.py --model gpt_oss_120b --nproc 2 parallel.expert_model_parallel_size=2 \
        rollout.expert_parallel_size=2                     # two GPUs, experts split over them
    python benchmarks/bench_rl_step.py --tiny                # toy model and batch (a CPU smoke run)

--model picks the config (`configs/gpt_oss_20b_lora_1gpu.yaml`, `configs/gpt_oss_120b_lora_1gpu.yaml`;
--config names another) and --expert-format how the frozen base holds its experts (`model.expert_format`: the
checkpoint's MXFP4 bytes as they are, or dequantized to bf16); further `key=value` arguments override the
config (e.g. `run.device_memory_gib=22` caps the process at a 24 GB card's budget). Every step runs 64
prompts x 8 samples unless an override says otherwise.

Weights: random. --weights checkpoint (gpt-oss-20b's default) writes a synthetic checkpoint in the released
layout (MXFP4 experts; `benchmarks/bench_rollout.py`'s writer, --ckpt, reused when present) and loads it by
`run.init_from_hf`; --weights random (gpt-oss-120b's default: its 61 GB checkpoint would not fit the disk of a
one-GPU machine) draws them on the device (`run.seed`; MXFP4 experts drawn, then quantized once). Prompts:
two-step word problems in GSM8K's format (`tools/make_word_problems.py`) rendered in harmony with the
o200k_harmony tokenizer (`data.max_prompt_tokens: 512`). Random weights rarely sample a stop token, so most
responses run to the budget: the step is close to its largest. Prints per step the seconds of each phase
(`time/*`), the sampled tokens per second of generation, the peak device memory allocated
(`perf/peak_gib`) and held by the allocator (`perf/reserved_gib`), the bytes the sync sent (`sync/bytes`) and
the engine/learner log-prob mismatch (`mismatch/abs_diff_mean`; under `moe.router_replay: r3`, the
gpt-oss-120b recipe's, also the mismatch the learner's own routing would have had and the fraction of tokens
it routes differently from the engine: `replay/*`), and where the generation's time went: the engine's
decode steps (mean ms, rows per step, the share replayed from CUDA graphs), its prefill and the KV cache
it made (`engine/*`; the cache as the sleep after generation freed it).
The first step includes the Triton compilations and the
capture of the decode graphs: later steps are the warm ones. No held-out evaluation runs
(the trainer's evaluations at step 0 and at the last step would each add a generation outside the phases).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_rollout import write_synthetic_mxfp4

from megatron_gptoss.config import load_config
from megatron_gptoss.envs.word_problems import write_splits

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "gpt_oss_20b": ROOT / "configs/gpt_oss_20b_lora_1gpu.yaml",
    "gpt_oss_120b": ROOT / "configs/gpt_oss_120b_lora_1gpu.yaml",
}
BATCH = ["rollout.prompts_per_step=64", "rollout.n_samples_per_prompt=8"]
TINY = ["model.preset=gpt_oss_demo", "model.vocab_size=201088", "model.make_vocab_size_divisible_by=128",
        "model.hidden_size=64", "model.intermediate_size=64", "model.lora.rank=4", "rollout.dtype=float32",
        "run.dtype=float32", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=8", "ppo.num_micro_batches=1", "ppo.num_mini_batches=1"]  # fmt: skip
COLUMNS = ["time/generate_s", "time/logprobs_s", "time/update_s", "time/sync_s"]
ENGINE_COLUMNS = [  # (label, metric, format) of the table of the engine's steps
    ("engine_steps", "engine/steps", "{:.0f}"), ("decode_steps", "engine/decode_steps", "{:.0f}"),
    ("decode_step_ms", "time/engine_decode_step_ms", "{:.2f}"),
    ("rows_per_decode_step", "engine/decode_rows_mean", "{:.1f}"),
    ("graph_frac", "engine/graph_frac", "{:.2f}"), ("captures", "engine/graph_captures", "{:.0f}"),
    ("capture_s", "time/engine_capture_s", "{:.1f}"),
    ("prefill_steps", "engine/prefill_steps", "{:.0f}"), ("prefill_s", "time/engine_prefill_s", "{:.1f}"),
    ("prefill_tokens", "engine/prefill_tokens", "{:,.0f}"),
    ("prefill_graph_frac", "engine/prefill_graph_frac", "{:.2f}"),
    ("stepping_s", "time/engine_step_s", "{:.1f}"), ("generate_s", "time/generate_s", "{:.1f}"),
    ("kv_cache_gib", "engine/kv_cache_gib", "{:.2f}"),  # what the sleep freed (rollout.sleep_level > 0)
]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="gpt_oss_20b")
    parser.add_argument("--config", type=Path, help="a config of its own instead of --model's")
    parser.add_argument("--expert-format", choices=["mxfp4", "bf16"], default="mxfp4")
    parser.add_argument("--weights", choices=["checkpoint", "random"], help="default: checkpoint for 20b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun); overrides give the layout")
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/bench_rollout_ckpt"))
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_rl_step"))
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        parser.error(f"unknown arguments {bad}: overrides are key=value")
    path = args.config or CONFIGS[args.model]
    held = f"model.expert_format={args.expert_format}"
    overrides = [*BATCH, held, *(TINY if args.tiny else []), *overrides]
    cfg = load_config(path, overrides)
    config = cfg.model
    weights = args.weights or ("checkpoint" if args.tiny or args.model == "gpt_oss_20b" else "random")
    init = []
    if weights == "checkpoint":
        ckpt = args.ckpt if not args.tiny else args.out / "ckpt"
        name = f"{config.num_layers}x{config.hidden_size}x{config.num_experts}"
        init = [f"run.init_from_hf={write_synthetic_mxfp4(config, ckpt / name)}"]
    data = args.out / "data"
    write_splits(data, train=max(512, cfg.rollout.prompts_per_step * args.steps), test=1)
    run_dir = args.out / "run"
    launch = [sys.executable]
    if args.nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
    command = [
        *launch, "-m", "megatron_gptoss.train", "--config", str(path), *init,
        f"data.train_files=[{data / 'train.jsonl'}]",
        "data.eval_files=[]", f"run.steps={args.steps}", "run.eval_every=0", "run.save_every=0",
        "run.export_hf=false", "run.progress=false", "run.tensorboard=false", f"run.output_dir={run_dir}",
        "run.overwrite=true", *overrides,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "time/generate_s" in line]
    print(f"## RL step: {path.name}, {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_experts} experts held as {config.expert_format}, LoRA rank {config.lora.rank}; "
          f"{rows} rollouts of up to {cfg.rollout.max_new_tokens} tokens, "
          f"{cfg.embedded.max_batch_slots} engine slots, weights {weights}")  # fmt: skip
    header = ["step", *[c.split("/")[1] for c in COLUMNS], "phases_s", "response_len", "gen_tok_per_s",
              "peak_gib", "reserved_gib", "sync_mib", "mismatch_mean", "own_routing_mismatch",
              "routed_differently"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for line in steps:
        length = line.get("response/length_mean", float("nan"))
        gen_tps = length * rows / line["time/generate_s"] if line.get("time/generate_s") else float("nan")
        total = sum(line.get(c, 0.0) for c in COLUMNS)
        cells = [str(line["step"]), *[f"{line.get(c, float('nan')):.2f}" for c in COLUMNS], f"{total:.2f}",
                 f"{length:.0f}",
                 f"{gen_tps:,.0f}", f"{line.get('perf/peak_gib', float('nan')):.1f}",
                 f"{line.get('perf/reserved_gib', float('nan')):.1f}",
                 f"{line.get('sync/bytes', float('nan')) / 2**20:.1f}",
                 f"{line.get('mismatch/abs_diff_mean', float('nan')):.2e}",
                 f"{line.get('replay/mismatch_off_abs_diff_mean', float('nan')):.2e}",
                 f"{line.get('replay/flip_frac', float('nan')):.4f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(
        "\n## Where generation's time went (the engine's steps; decode steps compute one token of each row)"
    )
    print("| step | " + " | ".join(label for label, _, _ in ENGINE_COLUMNS) + " |")
    print("|" + "---|" * (len(ENGINE_COLUMNS) + 1))
    for line in steps:
        cells = [form.format(line.get(key, float("nan"))) for _, key, form in ENGINE_COLUMNS]
        print(f"| {line['step']} | " + " | ".join(cells) + " |")
    return steps


if __name__ == "__main__":
    main()
