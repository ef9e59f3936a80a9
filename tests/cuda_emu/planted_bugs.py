"""Plants classic kernel bugs into a copy of csrc/, one at a time, and runs part of the emulated
test grid against each: every bug must make it fail, for the reason expected.

    python tests/cuda_emu/planted_bugs.py [name ...]   # every bug whose name holds one of the words

The launcher's bugs (four builds: about 5 minutes on 2 cores) run the stats grid; the fused
optimizer step's (`step` selects them) run the step grid, one under FMA contraction (a rounding
that only a build contracting a*b+c into an FMA, as nvcc does, exposes). The copies and their
builds live in build/cuda_emu/planted/ (rebuilt only when csrc/ changes). Exit status 0 when every
bug was caught and the unchanged kernels pass the same tests.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import cuda_emu  # noqa: E402

LAUNCHER = "cuda/multi_tensor.cuh"
STEP = "cuda/step_ops.cuh"
STATS_GRID = "tests/cuda/test_cuda_emulated.py"
STEP_GRID = "tests/cuda/test_cuda_emulated_step.py"


class Bug(NamedTuple):
    name: str
    file: str  # under csrc/
    pattern: str  # regex whose first match in `file` is replaced
    replacement: str
    build: str  # "plain", "asan" (ASan+UBSan) or "fma" (-mfma -ffp-contract=fast)
    grid: str  # the test file run
    selection: str  # its tests (-k)
    evidence: str  # regex the output must match


# The launcher's regexes match its one traversal and block reduction, which every op uses, and keep
# matching when the kernels are reorganised.
BUGS = [
    Bug("misaligned 16-byte load",  # the 16-byte path taken for any element-aligned pointer
        LAUNCHER, r"reinterpret_cast<uintptr_t>\(x\) % sizeof\(P\) == 0",
        "reinterpret_cast<uintptr_t>(x) % sizeof(scalar_t) == 0",
        "asan", STATS_GRID, "test_misaligned_views and float32", r"runtime error: [a-z ]*misaligned address .*"),
    Bug("out-of-bounds read",  # the element-wise tail loop reads one element past the chunk
        LAUNCHER, r"(for \(int(?:64_t)? j = i \+ (?:threadIdx\.x|tid); j )<( (?:ref\.)?n;)", r"\1<=\2",
        "asan", STATS_GRID, "test_sizes_and_planted_values and float32-2.0",
        r"AddressSanitizer: heap-buffer-overflow.*"),
    Bug("missing __syncthreads",  # thread 0 combines the warps' rows before they are written
        LAUNCHER, r"\n\s*__syncthreads\(\);(\n\s*if \(threadIdx\.x == 0\) \{)", r"\1",
        "plain", STATS_GRID, "test_sizes_and_planted_values and float32-2.0",
        r"(Mismatched elements|AssertionError: tensor \d+ col).*"),
    Bug("divergent shuffle",  # the upper half of each warp skips the warp reduction (any row type)
        LAUNCHER, r"(\n\s*)warp_reduce\(s\);", r"\1if (threadIdx.x % 32 < 16) warp_reduce(s);",
        "plain", STATS_GRID, "test_sizes_and_planted_values and float32-2.0",
        r"deadlock .*wait in __shfl_down_sync.*"),
    # The fused optimizer step's.
    Bug("step: skip flag ignored",  # a skipped step written all the same
        STEP, r"b\.writes = write && !\(skip != nullptr && \*skip != 0\.0\);", "b.writes = write;",
        "plain", STEP_GRID, "test_step_options and skipped and sgd_momentum_first",
        r"params\[\d+\]: \d+ of \d+ differ"),
    Bug("step: scaled gradient not rounded",  # g * scale kept in float for a 16-bit gradient
        STEP, r"g = round_to<scalar_t>\(mul_rn\(g, b\.scale\)\)", "g = mul_rn(g, b.scale)",
        "plain", STEP_GRID, "test_step_options and scale and adamw_amsgrad", r"\[\d+\]: \d+ of \d+ differ"),
    Bug("step: first buffer not written",  # SGD's first step leaves the momentum buffer as it was
        STEP, r"run<kWG, W \| M>\(first,", "run<kWG, W>(first,",
        "plain", STEP_GRID, "test_step_grid and sgd_momentum_first and float32",
        r"moment1\[\d+\]: \d+ of \d+ differ"),
    Bug("step: partial row of another thread",  # the block's row stored by a thread that lacks it
        STEP, r"if \(threadIdx\.x == 0\) s\.store\(part_f", "if (threadIdx.x == 1) s.store(part_f",
        "plain", STEP_GRID, "test_step_grid and adamw and float32",
        r"AssertionError: \w+(: counts| \(CPU op's rows\))"),
    Bug("step: written-only list not checked for alignment",  # a 16-byte store to a misaligned buffer
        LAUNCHER, r"\(\(kLoaded \| kMaybe \| kWritten\) >> l\) & 1u", "((kLoaded | kMaybe) >> l) & 1u",
        "asan", STEP_GRID, "test_step_misaligned_lists and sgd_momentum_first and float32",
        r"runtime error: [a-z ]*misaligned address .*"),
    Bug("step: rescale contracted into an FMA",  # w + c * (w' - w) without its product rounded alone
        STEP, r"mul_rn\(b\.coef, s\.w - w_before\)", "b.coef * (s.w - w_before)",
        "fma", STEP_GRID, "test_step_options and coefs and no_stats and sgd-", r"params\[\d+\]: \d+ of \d+ differ"),
]


def planted_copy(dest: Path, file: str, text: str) -> None:
    """csrc/ copied to dest with `file` replaced by `text`; files already right are left alone, so
    that the cached build of the copy is reused."""
    for src in (ROOT / "csrc").rglob("*"):
        if src.is_dir() or "generated" in src.parts:
            continue
        dst = dest / src.relative_to(ROOT / "csrc")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.relative_to(ROOT / "csrc").as_posix() == file:
            if not dst.exists() or dst.read_text() != text:
                dst.write_text(text)
        elif not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copy2(src, dst)


def run_grid(csrc: Path, build: str, grid: str, selection: str) -> subprocess.CompletedProcess:
    # Uncaptured and unbuffered: a sanitizer aborts the process, losing what pytest holds.
    env = dict(os.environ, GRADFUSE_EMU_CSRC=str(csrc), PYTHONUNBUFFERED="1")
    env = cuda_emu.sanitizer_env(env) if build == "asan" else env
    if build == "fma":
        env["GRADFUSE_EMU_FMA"] = "1"
    cmd = [sys.executable, "-m", "pytest", grid, "-x", "-q", "-s", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-k", selection]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def main(only: list[str]) -> int:
    work = ROOT / "build" / "cuda_emu" / "planted"
    failures = 0
    chosen = [b for b in BUGS if not only or any(o in b.name for o in only)]
    for bug in chosen:
        source = (ROOT / "csrc" / bug.file).read_text()
        planted, count = re.subn(bug.pattern, bug.replacement, source, count=1)
        if count == 0:
            print(f"{bug.name}: {bug.pattern!r} is not in {bug.file}; update {__file__}")
            failures += 1
            continue
        csrc = work / re.sub(r"\W+", "_", bug.name).strip("_") / "csrc"
        planted_copy(csrc, bug.file, planted)
        proc = run_grid(csrc, bug.build, bug.grid, bug.selection)
        out = proc.stdout + proc.stderr
        found = re.search(bug.evidence, out)
        caught = proc.returncode != 0 and found is not None
        failures += not caught
        print(f"{bug.name:52s} {bug.build:6s} {'caught' if caught else 'NOT CAUGHT'}: "
              f"{found.group(0)[:150] if found else out[-800:]}")
    # The unchanged kernels pass the same tests, per build and grid.
    for build, grid in sorted({(b.build, b.grid) for b in chosen}):
        selection = " or ".join(f"({b.selection})" for b in chosen if (b.build, b.grid) == (build, grid))
        proc = run_grid(ROOT / "csrc", build, grid, selection)
        ok = proc.returncode == 0 and " passed" in proc.stdout
        failures += not ok
        print(f"{'unchanged kernels, ' + Path(grid).name:52s} {build:6s} "
              f"{'pass' if ok else 'FAIL'}: {proc.stdout.strip().splitlines()[-1] if ok else proc.stdout[-2000:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
