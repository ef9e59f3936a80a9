#!/bin/bash
# Usage: bash benchmarks/kernel_ab/run.sh [OLD_REV]   (default: 0517da1, the kernels before the
# AVX2 pass-1 rework: four sum streams, software prefetch)
# Builds and runs stats_kernel_ab.cpp (single thread, no Python). Needs the venv's torch headers.
set -euo pipefail
cd "$(dirname "$0")"
REV=${1:-0517da1}
source ./common.sh
git show "$REV":csrc/cpu/kernels_impl.h | sed "s/namespace gradfuse::cpu::CPU_CAPABILITY {/namespace gradfuse::cpu::OLD { using namespace at::vec::CPU_CAPABILITY;/; s/#pragma once//; s#\"../common/chunk_plan.h\"#\"$ROOT/csrc/common/chunk_plan.h\"#; s#\"kernels.h\"#\"$ROOT/csrc/cpu/stats_kernels.h\"#" > "$TMP/old_impl.h"
g++ -O3 -std=c++17 -fopenmp -Wno-psabi $INC -I"$TMP" stats_kernel_ab.cpp -o "$TMP/ab" -L"$LIB" -lc10 -ltorch_cpu -Wl,-rpath,"$LIB"
uptime
"$TMP/ab"
uptime
