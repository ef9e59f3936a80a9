#!/usr/bin/env bash
# Sets up a fresh checkout: .venv, its requirements, then builds gradfuse._C in place.
#   bash scripts/setup.sh test   (the default; scripts/test.sh, CI) requirements-dev.txt (then
#                                requirements-deepspeed.txt, against that torch), and the
#                                CPU and CUDA kernels (CUDA whenever a toolkit is found, for the
#                                emulated-grid and SASS-budget tests), for every default GPU arch
#   bash scripts/setup.sh demo   (scripts/demo.sh) requirements-demo.txt and the CPU kernels only
#                                (GRADFUSE_CUDA=0), unless a build with CUDA kernels is already
#                                there: that one is kept (and brought up to date)
# A build of the other kind is rebuilt (build_info()["with_cuda"] tells which is there).
# Safe to re-run: pip skips what is installed and ninja rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-test}
# Byte-code for what .venv's python imports is written on first import (pip --no-compile below
# leaves it out): with PYTHONDONTWRITEBYTECODE set, every later python (the build, the checks,
# the demo) would compile torch's modules again, about 4 s of CPU each time.
unset PYTHONDONTWRITEBYTECODE
PIP_EXTRA=()
case "$MODE" in
  test) REQUIREMENTS=requirements-dev.txt ;;
  # --no-compile: no .pyc for torch's thousands of modules now; the few the demo imports are
  # compiled when first imported
  demo) REQUIREMENTS=requirements-demo.txt; PIP_EXTRA=(--no-compile) ;;
  *) echo "usage: bash scripts/setup.sh [test|demo]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
echo "[setup] installing $REQUIREMENTS (torch 2.14.1 is several GB the first time)"
# (this machine's pip config names local mirrors that may be absent; their warnings are noise)
.venv/bin/python -m pip install -q --disable-pip-version-check ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} -r "$REQUIREMENTS" \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
if [ "$MODE" = test ]; then
  # DeepSpeed's setup.py imports torch: a second call, against the torch installed above (no
  # build isolation), building none of its ops (DS_BUILD_OPS=0). pip skips it once installed.
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
    -r requirements-deepspeed.txt 2> >(grep -v "^WARNING: Location 'file:" >&2)
  # torchtitan in a folder of its own (requirements-torchtitan.txt says why); pip skips nothing
  # with --target, so it runs only when the pinned set changed.
  if ! cmp -s requirements-torchtitan.txt .venv/torchtitan/.requirements 2>/dev/null; then
    echo "[setup] installing requirements-torchtitan.txt into .venv/torchtitan"
    rm -rf .venv/torchtitan
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target .venv/torchtitan \
      -r requirements-torchtitan.txt 2> >(grep -v "^WARNING: Location 'file:" >&2)
    cp requirements-torchtitan.txt .venv/torchtitan/.requirements
  fi
fi

# What is built in place now: "cuda", "cpu", or "none" (no build, or one that does not load),
# and on a second line gradfuse.build_info() as JSON.
build_state() {
  if ! compgen -G "gradfuse/_C*.so" > /dev/null; then
    echo none  # nothing built (a fresh clone): no need to start python and import torch
    return
  fi
  .venv/bin/python - <<'PY' 2>/dev/null || echo none
import json
import gradfuse
info = gradfuse.build_info()
print(("cuda" if info["with_cuda"] else "cpu") if info.get("extension_loaded") else "none")
print(json.dumps(info))
PY
}

build() {  # build [extra setup.py arguments]
  mkdir -p build
  if ! .venv/bin/python setup.py build_ext --inplace "$@" > build/setup.log 2>&1; then
    tail -n 60 build/setup.log
    echo "[setup] build failed; the whole log is build/setup.log" >&2
    exit 1
  fi
}

BEFORE=$(build_state)
BEFORE=${BEFORE%%$'\n'*}  # its first line
if [ "$MODE" = demo ] && [ "$BEFORE" != cuda ] && [ -z "${GRADFUSE_CUDA:-}" ]; then
  export GRADFUSE_CUDA=0  # the demo runs on the CPU: kernels for absent GPUs are for tests, CI, wheels
fi
echo "[setup] building gradfuse._C ($([ "${GRADFUSE_CUDA:-}" = 0 ] && echo "CPU kernels only" || echo "CPU and CUDA kernels when a toolkit is found"); a few minutes the first time; MAX_JOBS=${MAX_JOBS:-auto})"
build
WANT=$(grep -q "^\[gradfuse setup\] CUDA kernels: yes" build/setup.log && echo cuda || echo cpu)
STATE=$(build_state)
AFTER=${STATE%%$'\n'*}
if [ "$AFTER" != "$WANT" ]; then
  # setuptools skips an extension whose .so is newer than its sources, even when the last build
  # was of the other kind (the demo's CPU-only build before the tests) or no longer loads.
  echo "[setup] the build in place is '$AFTER', this setup wants '$WANT': rebuilding"
  build --force
  STATE=$(build_state)
  AFTER=${STATE%%$'\n'*}
  if [ "$AFTER" != "$WANT" ]; then
    echo "[setup] after a forced rebuild gradfuse._C is '$AFTER', not '$WANT'; see build/setup.log" >&2
    exit 1
  fi
fi
grep "^\[gradfuse setup\]" build/setup.log || true
echo "[setup] gradfuse build: ${STATE#*$'\n'}"
