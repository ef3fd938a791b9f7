#!/usr/bin/env bash
# Every GPU test and the trainer's bf16 engine/learner mismatch guard, on this machine's GPUs, in one command
# (within one 10-minute call on one H100). Run it before landing any change to a kernel, a log-prob path or
# sampling: the CPU tests run in fp32 and cannot see a bf16 regression.
#   bash tools/gpu_check.sh                 # extra arguments go to the GPU tests' pytest
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
echo "== GPU tests"
python3 -m pytest -q -m gpu -ra --durations=10 tests --ignore=tests/rl/test_mismatch_gpu.py "$@" || status=1
echo "== the trainer's bf16 mismatch guard (tests/rl/test_mismatch_gpu.py)"
python3 -m pytest -q -s -m gpu tests/rl/test_mismatch_gpu.py || status=1
echo "== engine/learner fidelity at gpt-oss-120b width (benchmarks/bench_bitwise.py --rows 128)"
python3 benchmarks/bench_bitwise.py --rows 128 2>&1 | grep -v " \.\.\.$" || status=1
echo "gpu_check: $([[ $status == 0 ]] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $status
