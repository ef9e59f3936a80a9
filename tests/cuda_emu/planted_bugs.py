"""Plants classic kernel bugs into a copy of csrc/, one at a time, and runs part of the emulated
test grid against each: every bug must make it fail, for the reason expected.

    python tests/cuda_emu/planted_bugs.py [name ...]   # four builds: about 5 minutes on 2 cores

The copies and their builds live in build/cuda_emu/planted/ (rebuilt only when csrc/ changes).
Exit status 0 when every bug was caught and the unchanged kernels pass the same tests.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import cuda_emu  # noqa: E402

KERNELS = "cuda/multi_tensor.cuh"

# (name, regex whose first match in multi_tensor.cuh is replaced, replacement, sanitized run?,
#  tests to run, evidence expected in the output). The regexes match the launcher's one traversal
# and block reduction, which every op uses, and keep matching when the kernels are reorganised.
BUGS = [
    ("misaligned 16-byte load",  # the 16-byte path taken for any element-aligned pointer
     r"reinterpret_cast<uintptr_t>\(x\) % sizeof\(P\) == 0",
     "reinterpret_cast<uintptr_t>(x) % sizeof(scalar_t) == 0",
     True, "test_misaligned_views and float32", r"runtime error: [a-z ]*misaligned address .*"),
    ("out-of-bounds read",  # the element-wise tail loop reads one element past the chunk
     r"(for \(int(?:64_t)? j = i \+ (?:threadIdx\.x|tid); j )<( (?:ref\.)?n;)",
     r"\1<=\2",
     True, "test_sizes_and_planted_values and float32-2.0", r"AddressSanitizer: heap-buffer-overflow.*"),
    ("missing __syncthreads",  # thread 0 combines the warps' rows before they are written
     r"\n\s*__syncthreads\(\);(\n\s*if \(threadIdx\.x == 0\) \{)",
     r"\1",
     False, "test_sizes_and_planted_values and float32-2.0", r"(Mismatched elements|AssertionError: tensor \d+ col).*"),
    ("divergent shuffle",  # the upper half of each warp skips the warp reduction (any row type)
     r"(\n\s*)warp_reduce\(s\);",
     r"\1if (threadIdx.x % 32 < 16) warp_reduce(s);",
     False, "test_sizes_and_planted_values and float32-2.0", r"deadlock .*wait in __shfl_down_sync.*"),
]


def planted_copy(dest: Path, kernels_text: str) -> None:
    """csrc/ copied to dest with the kernels replaced; files already right are left alone, so
    that the cached build of the copy is reused."""
    for src in (ROOT / "csrc").rglob("*"):
        if src.is_dir() or "generated" in src.parts:
            continue
        dst = dest / src.relative_to(ROOT / "csrc")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.relative_to(ROOT / "csrc").as_posix() == KERNELS:
            if not dst.exists() or dst.read_text() != kernels_text:
                dst.write_text(kernels_text)
        elif not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copy2(src, dst)


def run_grid(csrc: Path, sanitize: bool, selection: str) -> subprocess.CompletedProcess:
    # Uncaptured and unbuffered: a sanitizer aborts the process, losing what pytest holds.
    env = dict(os.environ, GRADFUSE_EMU_CSRC=str(csrc), PYTHONUNBUFFERED="1")
    env = cuda_emu.sanitizer_env(env) if sanitize else env
    cmd = [sys.executable, "-m", "pytest", "tests/cuda/test_cuda_emulated.py", "-x", "-q", "-s", "-p", "no:randomly",
           "-p", "no:cacheprovider", "-k", selection]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def main(only: list[str]) -> int:
    source = (ROOT / "csrc" / KERNELS).read_text()
    work = ROOT / "build" / "cuda_emu" / "planted"
    failures = 0
    for name, pattern, replacement, sanitize, selection, evidence in BUGS:
        if only and not any(o in name for o in only):
            continue
        planted, count = re.subn(pattern, replacement, source, count=1)
        if count == 0:
            print(f"{name}: {pattern!r} is not in {KERNELS}; update {__file__}")
            failures += 1
            continue
        csrc = work / re.sub(r"\W+", "_", name).strip("_") / "csrc"
        planted_copy(csrc, planted)
        proc = run_grid(csrc, sanitize, selection)
        out = proc.stdout + proc.stderr
        found = re.search(evidence, out)
        caught = proc.returncode != 0 and found is not None
        failures += not caught
        how = "ASan+UBSan" if sanitize else "plain"
        print(f"{name:24s} {how:10s} {'caught' if caught else 'NOT CAUGHT'}: "
              f"{found.group(0)[:150] if found else out[-800:]}")
    for sanitize in ([] if only else [False, True]):  # the unchanged kernels pass the same tests
        selection = " or ".join(f"({b[4]})" for b in BUGS if b[3] == sanitize)
        proc = run_grid(ROOT / "csrc", sanitize, selection)
        ok = proc.returncode == 0
        failures += not ok
        print(f"{'unchanged kernels':24s} {'ASan+UBSan' if sanitize else 'plain':10s} "
              f"{'pass' if ok else 'FAIL'}: {proc.stdout.strip().splitlines()[-1] if ok else proc.stdout[-2000:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
