#!/usr/bin/env bash
# Times a new user's first run: a fresh clone of this checkout, then `bash scripts/demo.sh` (it
# creates .venv, installs requirements-demo.txt, builds gradfuse._C, runs the demo). Each output
# line is stamped with the seconds since the clone; the summary gives the phases (venv, pip,
# build, first demo line) and the total, with `uptime` before and after (the load matters).
#   bash benchmarks/first_run.sh [clone dir (default /tmp/gradfuse-first-run)] [demo.sh arguments]
#   REV=<commit> bash benchmarks/first_run.sh ...   times that commit of the clone instead of HEAD
# On a shared machine wrap it in `flock /tmp/gradfuse-bench.lock`. Needs the disk for a new .venv
# (about 5.5 GB with torch's CUDA libraries).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-/tmp/gradfuse-first-run}
shift || true
rm -rf "$DEST"
echo "uptime before: $(uptime)"
echo "commit: $(git -C "$SRC" rev-parse --short "${REV:-HEAD}")  ($(git -C "$SRC" status --porcelain | wc -l) uncommitted changes are not in the clone)"
START=$(date +%s.%N)
git clone -q "$SRC" "$DEST"
if [ -n "${REV:-}" ]; then git -C "$DEST" checkout -q "$REV"; fi
LOG=$(mktemp)
set +e
(cd "$DEST" && bash scripts/demo.sh "$@" 2>&1) | while IFS= read -r line; do
  printf '%7.1f %s\n' "$(echo "$(date +%s.%N) - $START" | bc)" "$line"
done | tee "$LOG"
STATUS=${PIPESTATUS[0]}
set -e
END=$(date +%s.%N)
echo "uptime after: $(uptime)"
at() {  # seconds stamped on the first line matching $1
  grep -m1 -E "^ *[0-9.]+ $1" "$LOG" | awk '{print $1}'
}
venv=$(at "\[setup\] creating") pip=$(at "\[setup\] installing") build=$(at "\[setup\] building")
built=$(at "\[gradfuse setup\]") first=$(at "gradfuse demo:")
printf 'phases (s since the clone): venv %s, pip %s, build %s, build done %s, first demo line %s, total %.1f (exit %s)\n' \
  "${venv:-?}" "${pip:-?}" "${build:-?}" "${built:-?}" "${first:-?}" "$(echo "$END - $START" | bc)" "$STATUS"
rm -f "$LOG"
exit "$STATUS"
