#!/usr/bin/env bash
# The README's first command: install, then RL-train the tiny GPT-OSS demo on the CPU.
# Extra arguments are config overrides, e.g. run.steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0 bash tools/install.sh dev  # the demo uses the embedded engine: vLLM is not needed
python3 -m megatron_gptoss.train --config configs/demo_cpu.yaml "$@"
