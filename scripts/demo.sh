#!/usr/bin/env bash
# The main job: sets up a fresh machine for the demo (scripts/setup.sh demo: its few requirements,
# the CPU kernels), then runs the demo training loop.
# Extra arguments go to `python -m gradfuse demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # .venv's byte-code is written on first import (see scripts/setup.sh)
bash scripts/setup.sh demo
exec .venv/bin/python -m gradfuse demo "$@"
