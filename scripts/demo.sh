#!/usr/bin/env bash
# The main job: sets up a fresh machine (scripts/setup.sh), then runs the demo training loop.
# Extra arguments go to `python -m gradfuse demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m gradfuse demo "$@"
