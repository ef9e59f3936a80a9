#!/usr/bin/env bash
# The packaging checks that compile (tests/packaging/test_packaging.py with GRADFUSE_PACKAGING_TESTS=1):
# sdist, wheel and `pip install .` each installed into a fresh venv and checked from outside the
# source tree, and pip's isolated build stopping with the commands to run. Two CPU-only builds of
# gradfuse._C: about 2-3 min on 2 free cores. CI runs it after scripts/test.sh; uses .venv (made
# by scripts/setup.sh) unless PYTHON names another interpreter that has torch. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export GRADFUSE_PACKAGING_TESTS=1 MAX_JOBS=${MAX_JOBS:-2}
exec "$PY" -m pytest tests/packaging/test_packaging.py -p no:cacheprovider "$@"
