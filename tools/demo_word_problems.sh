#!/usr/bin/env bash
# The harmony demo (configs/demo_word_problems.yaml): install, write the word problems, a supervised cold start,
# then GRPO from it, on the CPU; one plot of both phases. Extra arguments are config overrides of the RL phase,
# e.g. run.steps=50; COLD_START_STEPS sets the cold start's length.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0 bash tools/install.sh dev  # the embedded engine: vLLM is not needed
config=configs/demo_word_problems.yaml
out=outputs/demo_word_problems
python3 tools/make_word_problems.py --train 4000 --test 200 --sft 4000 --out "$out/data"
python3 -m megatron_gptoss.train --config "$config" run.mode=sft run.steps="${COLD_START_STEPS:-60}" \
    optim.lr=3.0e-3 optim.lr_schedule=cosine run.output_dir="$out/cold_start"
python3 -m megatron_gptoss.train --config "$config" run.init_from_hf="$out/cold_start/hf_final" "$@"
python3 -m megatron_gptoss.utils.plot "$out/rl/metrics.jsonl" "$out/both_phases.png" \
    --before "$out/cold_start/metrics.jsonl"
