#!/usr/bin/env bash
# Every GPU test and the trainer's bf16 engine/learner mismatch guard, on this machine's GPUs, in one command.
# Run it before landing any change to a kernel, a log-prob path or sampling: the CPU tests run in fp32 and
# cannot see a bf16 regression. GPU_CHECK_PARTS picks parts (default all three), so that the check can be
# split over calls of a limited length:
#   bash tools/gpu_check.sh                 # extra arguments go to the GPU tests' pytest
#   GPU_CHECK_PARTS=tests bash tools/gpu_check.sh; GPU_CHECK_PARTS="guard fidelity" bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
parts=" ${GPU_CHECK_PARTS:-tests guard fidelity} "
for part in $parts; do
  [[ " tests guard fidelity " == *" $part "* ]] || { echo "GPU_CHECK_PARTS: unknown part '$part'"; exit 2; }
done
if [[ $parts == *" tests "* ]]; then
  echo "== GPU tests"
  python3 -m pytest -q -m gpu -ra --durations=10 tests --ignore=tests/rl/test_mismatch_gpu.py "$@" || status=1
fi
if [[ $parts == *" guard "* ]]; then
  echo "== the trainer's bf16 mismatch guard (tests/rl/test_mismatch_gpu.py)"
  python3 -m pytest -q -s -m gpu tests/rl/test_mismatch_gpu.py || status=1
fi
if [[ $parts == *" fidelity "* ]]; then
  echo "== engine/learner fidelity at gpt-oss-120b width (benchmarks/bench_bitwise.py --rows 128)"
  python3 benchmarks/bench_bitwise.py --rows 128 --cost-tokens 0 2>&1 | grep -v " \.\.\.$" || status=1
fi
echo "gpu_check ($parts): $([[ $status == 0 ]] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $status
