#!/usr/bin/env bash
# The harmony demo (configs/demo_word_problems.yaml): install, then word problems, a supervised cold start and
# GRPO from it on the CPU, with one plot of both phases (tools/demo_word_problems.py says what it writes).
# Extra arguments are config overrides of both phases, e.g. run.steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0 bash tools/install.sh dev  # the embedded engine: vLLM is not needed
python3 tools/demo_word_problems.py "$@"
