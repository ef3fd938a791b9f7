#!/usr/bin/env bash
# The lookup demo (configs/demo_lookup.yaml): install, then the lookup task, a supervised cold start and GRPO
# with the lookup tool on the CPU, with one plot of both phases (tools/demo_lookup.py says what it writes).
# Extra arguments are config overrides of both phases, e.g. run.steps=20.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0 bash tools/install.sh dev  # the embedded engine: vLLM is not needed
python3 tools/demo_lookup.py "$@"
