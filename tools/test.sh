#!/usr/bin/env bash
# The README's second command: install, lint, type-check and run every test (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh dev
python3 -m ruff check megatron_gptoss tests tools benchmarks launch
python3 -m ruff format --check megatron_gptoss tests tools benchmarks launch
python3 -m mypy megatron_gptoss
lint-imports  # the package layers (pyproject.toml, docs/architecture.md)
# Each test folder in its own process (each must pass alone), then the slowest tests of all; arguments
# go to pytest, and test paths among them run just those paths.
python3 tools/run_tests.py "$@"
