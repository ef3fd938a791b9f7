#!/usr/bin/env bash
# The README's first command: install, then the demo on the CPU: a supervised cold start and GRPO from it on
# reversing four-digit strings (tools/demo_reverse.py says what it writes). Extra arguments are config
# overrides of both phases, e.g. run.seed=1 or run.output_dir=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0 bash tools/install.sh dev  # the demo uses the embedded engine: vLLM is not needed
python3 tools/demo_reverse.py "$@"
