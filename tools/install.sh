#!/usr/bin/env bash
# Install megatron-gptoss and what it needs into the current Python (CPU build of torch 2.13.0).
# Usage: bash tools/install.sh [extras]   (extras default: dev)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[${extras}]"
