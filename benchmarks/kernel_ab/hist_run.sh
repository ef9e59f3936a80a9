#!/bin/bash
# Usage: bash benchmarks/kernel_ab/hist_run.sh [OLD_REV] [ROUNDS] [cache]   (default OLD_REV: 7b6f01c,
# the AVX2 kernel before its hot-field window and AVX-512 loop). Builds hist_kernel_ab.cpp with csrc/cpu/hist_avx2.cpp of the working tree
# and of OLD_REV (renamed namespaces) and runs it: single thread, no Python. Needs the venv's torch.
set -euo pipefail
cd "$(dirname "$0")"
REV=${1:-7b6f01c}
source ./common.sh
# The old file next to the current headers (csrc/cpu/ and csrc/common/ of the working tree).
OLD_SRC=$ROOT/csrc/cpu/.hist_avx2_old_ab.cpp
trap 'rm -rf "$TMP" "$OLD_SRC"' EXIT
git show "$REV":csrc/cpu/hist_avx2.cpp > "$OLD_SRC"
nice g++ -O3 -std=c++17 $INC -Dgradfuse=gf_old -c "$OLD_SRC" -o "$TMP/old.o"
rm -f "$OLD_SRC"
nice g++ -O3 -std=c++17 $INC -Dgradfuse=gf_new -c "$ROOT/csrc/cpu/hist_avx2.cpp" -o "$TMP/new.o"
g++ -O3 -std=c++17 hist_kernel_ab.cpp "$TMP/old.o" "$TMP/new.o" -o "$TMP/ab" -L"$LIB" -lc10 -Wl,-rpath,"$LIB"
uptime
"$TMP/ab" "${2:-15}" "${3:-}"
uptime
