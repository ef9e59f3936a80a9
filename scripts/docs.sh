#!/usr/bin/env bash
# Builds the documentation site into site/ with MkDocs (Material + mkdocstrings), strictly:
# any warning fails the build. Makes .venv-docs (requirements-docs.txt) on first use; no torch
# needed (the API pages are read from the source).
#   bash scripts/docs.sh            build site/
#   bash scripts/docs.sh serve      a live preview on http://127.0.0.1:8000
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv-docs
# (this machine's pip config names local mirrors that may be absent; their warnings are noise)
quiet_pip() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }

if [ ! -x "$VENV/bin/mkdocs" ] || ! cmp -s requirements-docs.txt "$VENV/requirements-docs.txt"; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  quiet_pip "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-docs.txt
  cp requirements-docs.txt "$VENV/requirements-docs.txt"
fi

if [ "${1:-}" = serve ]; then
  exec "$VENV/bin/mkdocs" serve
fi

# mkdocs-material and plugins print banners about MkDocs 2 (requirements-docs.txt pins 1.x)
export NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
status=0
"$VENV/bin/mkdocs" build --strict --site-dir site 2>&1 | tee "$LOG" || status=$?
if [ "$status" -ne 0 ] || grep -q "WARNING" "$LOG"; then
  echo "docs: build failed or warned (see above)" >&2
  exit 1
fi
echo "docs: site/ built with no warnings"
