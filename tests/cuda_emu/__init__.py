"""The CUDA kernels of gradfuse, run on the CPU: builds (once, cached in build/cuda_emu/) a small
torch extension that registers ``torch.ops.gradfuse_emu.*`` on CPU tensors, running the glue of
``csrc/cuda/ops.h`` and the kernels of ``csrc/cuda/*_ops.cuh`` (on the launcher of
``csrc/cuda/multi_tensor.cuh``) through the CUDA emulation of ``cuda_emu.h``. See "CUDA kernels
without a GPU" in CONTRIBUTING.md.

Environment (read by :func:`load`):
  GRADFUSE_EMU_SANITIZE=1  build with -fsanitize=address,undefined (Python must then run with
                           libasan preloaded: see sanitizer_env)
  GRADFUSE_EMU_CSRC=dir    compile the kernels from another copy of csrc/ (planted-bug runs)
  GRADFUSE_EMU_FMA=1       build with -mfma -ffp-contract=fast: a*b+c contracted into one FMA
                           wherever the compiler likes, as nvcc does by default (the default
                           build targets baseline x86-64, where g++ contracts nothing)
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _compiler_library(name: str) -> str | None:
    out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else None


def sanitizer_runtime() -> str | None:
    """What a Python process must preload to load the sanitized build (None if the compiler has no
    libasan): libasan first, and libstdc++ with it, else ASan finds no __cxa_throw to intercept
    (Python itself does not link libstdc++) and aborts at the first C++ exception."""
    asan, cxx = _compiler_library("libasan.so"), _compiler_library("libstdc++.so")
    return f"{asan} {cxx}" if asan and cxx else None


def sanitizer_env(env: dict) -> dict:
    """Environment for a Python process that loads the sanitized build."""
    env = dict(env, GRADFUSE_EMU_SANITIZE="1", LD_PRELOAD=sanitizer_runtime() or "")
    # Python and torch are not instrumented and keep memory until exit: no leak report.
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def load():
    """Builds (if needed) and loads the emulated backend; returns ``torch.ops.gradfuse_emu``."""
    from torch.utils import cpp_extension

    sanitize = os.environ.get("GRADFUSE_EMU_SANITIZE") == "1"
    fma = os.environ.get("GRADFUSE_EMU_FMA") == "1"
    csrc = Path(os.environ.get("GRADFUSE_EMU_CSRC", ROOT / "csrc")).resolve()
    flags = ["-Wall", "-Wno-unknown-pragmas", f"-I{csrc}"]
    flags += ["-O1", "-g1"] + SANITIZE_FLAGS if sanitize else ["-O2"]
    flags += ["-mfma", "-ffp-contract=fast"] if fma else []
    # One build directory (and library name) per variant, so that each stays cached.
    variant = ("asan" if sanitize else "opt") + ("_fma" if fma else "") + (
        "" if csrc == ROOT / "csrc" else "_" + hashlib.sha1(str(csrc).encode()).hexdigest()[:8])
    build_dir = ROOT / "build" / "cuda_emu" / variant
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=f"gradfuse_emu_{variant}",
        sources=[str(HERE / "cuda_emu.cpp"), str(HERE / "emu_ops.cpp")],
        extra_cflags=flags,
        extra_ldflags=SANITIZE_FLAGS if sanitize else [],
        build_directory=str(build_dir),
        is_python_module=False,
        with_cuda=False,
        verbose=os.environ.get("GRADFUSE_EMU_VERBOSE") == "1",
    )
    return torch.ops.gradfuse_emu


class GuardedTensors:
    """Tensors of `dtype` and `sizes` on pages of their own (start shifted by `misalign`
    elements), which :meth:`unreadable` makes inaccessible: any access faults."""

    def __init__(self, dtype: torch.dtype, sizes: list[int], misalign: int = 0):
        elem = torch.empty(0, dtype=dtype).element_size()
        page = mmap.PAGESIZE
        spans = [-(-(n + misalign) * elem // page) * page or page for n in sizes]
        self._buffer = torch.empty(sum(spans) + page, dtype=torch.uint8)
        start = -self._buffer.data_ptr() % page
        self._region = (self._buffer.data_ptr() + start, sum(spans))
        self.tensors = []
        for n, span in zip(sizes, spans):
            shift = misalign * elem
            self.tensors.append(self._buffer[start + shift:start + span].view(dtype)[:n].normal_())
            start += span

    def _protect(self, prot: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        addr, size = self._region
        if libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(size), prot) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")

    @contextlib.contextmanager
    def unreadable(self):
        self._protect(0)  # PROT_NONE
        try:
            yield self.tensors
        finally:
            self._protect(mmap.PROT_READ | mmap.PROT_WRITE)
