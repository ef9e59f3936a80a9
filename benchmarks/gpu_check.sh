#!/usr/bin/env bash
# The GPU check, one command on a GPU machine with no network (the device tool's, or yours):
#   bash benchmarks/gpu_check.sh
# builds gradfuse against that machine's torch, runs the CUDA tests, runs the CUDA benchmark
# (GPT-2 small and 10 000 small tensors in fp32 and bf16, plus an 8 GB set), with the copy and
# read bandwidth measured in the same run, times the whole step with everything on and never
# waiting (benchmarks/never_waits.py), and prints a short table last. Full logs go to $OUT
# when it is set (the device tool), else build/gpu_check/. Budget: under 8 minutes.
# Needs only what the GPU machine has (Python 3.12, torch 2.11.0+cu130, nvcc 13, ninja,
# setuptools >= 77; no network): scripts/version_matrix.py runs this exact build command in its
# Python 3.12 + torch 2.11.0 cell (see docs/supported-versions.md).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-build/gpu_check}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
t0=$(date +%s)
stamp() { echo "=== $1 (t+$(( $(date +%s) - t0 ))s)"; }

stamp "build against $($PY -c 'import torch; print(torch.__version__)')"
if ! GRADFUSE_CUDA=1 GRADFUSE_PTXAS_VERBOSE=1 $PY setup.py build_ext --inplace > "$LOGS/build.log" 2>&1; then
  tail -n 40 "$LOGS/build.log"; echo "BUILD FAILED"; exit 1
fi
grep "^\[gradfuse setup\]" "$LOGS/build.log"
grep -A1 "spill" "$LOGS/build.log" | grep -v "0 bytes spill stores, 0 bytes spill loads" | grep -i "spill" | head -5
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
$PY -m gradfuse info

stamp "CUDA tests"
# Every test on the GPU (tests/cuda/test_cuda.py: the fused optimizer step against the CPU kernels,
# without a host sync, its skip flag in a CUDA graph; the device="cuda" cases of the others), not
# the emulated kernels' grids, which need no GPU and run for minutes.
timeout 240 $PY -m pytest tests -q -p no:cacheprovider -k "cuda and not emulated" -x 2>&1 | tee "$LOGS/tests.log" | tail -n 15
tests_rc=${PIPESTATUS[0]}

stamp "CUDA benchmark"
timeout 240 $PY -m pytest benchmarks -q -p no:cacheprovider --benchmark-only \
  --bench-device cuda --bench-size gpu --bench-workloads gpt2_small,many_small,few_large \
  --bench-dtypes float32,bfloat16 \
  --bench-methods torch_clip_foreach,hook_loop,torch_foreach_stats,gradfuse_stats,gradfuse_clip_noclip,gradfuse_clip_clipping,stats_op,moments_op,memory_read,memory_copy \
  --benchmark-json "$LOGS/bench.json" > "$LOGS/bench.log" 2>&1
bench_rc=$?
tail -n 5 "$LOGS/bench.log"

stamp "everything on, never waiting"
# The recommended configuration's whole step against torch's clipped step and the default
# monitor, with gradfuse's host reads per step counted (0 expected for the never-waiting one).
timeout 90 $PY benchmarks/never_waits.py --device cuda > "$LOGS/never_waits.log" 2>&1
never_rc=$?
tail -n 6 "$LOGS/never_waits.log"

stamp "summary"
$PY benchmarks/summarize.py "$LOGS/bench.json" -o "$LOGS/table.md" --png "$LOGS/chart.png" && cat "$LOGS/table.md"
echo "tests exit $tests_rc, benchmark exit $bench_rc, never-waiting step exit $never_rc, $(( $(date +%s) - t0 ))s in all"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$never_rc" = 0 ]
