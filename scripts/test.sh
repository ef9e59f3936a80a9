#!/usr/bin/env bash
# The test command: sets up a fresh machine (scripts/setup.sh test: every requirement, the CPU and
# CUDA kernels), then runs the test suite,
# including an untimed smoke run of every benchmark. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest tests "$@"
