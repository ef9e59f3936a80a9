#!/usr/bin/env bash
# Sets up a fresh checkout: .venv with requirements-dev.txt, then builds gradfuse._C in place.
# Safe to re-run: pip skips what is installed and ninja rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
echo "[setup] installing requirements-dev.txt (torch 2.14.1 is several GB the first time)"
# (this machine's pip config names local mirrors that may be absent; their warnings are noise)
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
echo "[setup] building gradfuse._C (a few minutes the first time; MAX_JOBS=${MAX_JOBS:-auto})"
mkdir -p build
if ! .venv/bin/python setup.py build_ext --inplace > build/setup.log 2>&1; then
  tail -n 60 build/setup.log
  echo "[setup] build failed; the whole log is build/setup.log" >&2
  exit 1
fi
grep "^\[gradfuse setup\]" build/setup.log || true
.venv/bin/python -c "import gradfuse, json; print('[setup] gradfuse build:', json.dumps(gradfuse.build_info()))"
