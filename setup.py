"""Builds gradfuse._C: the CPU kernels always, the CUDA kernels whenever a CUDA toolkit and a CUDA
build of torch are present (a visible GPU is not needed).

Build it against the torch that will run it, without build isolation:
    pip install --no-build-isolation .          (or -e . for development)
An isolated build stops with a message saying so (NO_TORCH_MESSAGE); sdist needs no torch.

Environment:
  GRADFUSE_CUDA=0/1        force the CUDA kernels off / on (on fails if they cannot be built)
  CUDA_HOME                the CUDA toolkit; found from nvcc when unset (see find_cuda_home)
  TORCH_CUDA_ARCH_LIST     GPU architectures; default DEFAULT_CUDA_ARCHS when no GPU is visible
  MAX_JOBS                 parallel compile jobs (ninja)
  DEBUG=1                  -O0 -g
  GRADFUSE_PTXAS_VERBOSE=1 print registers / spills per CUDA kernel
  GRADFUSE_OPENMP=0/1      force OpenMP off / on; by default on where the C++ compiler takes
                           -fopenmp (Apple clang does not: the CPU kernels then run on one thread)
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import setuptools
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# sm_80 (A100), sm_90 (H100/H200), sm_100 (B200), sm_120 (RTX 50xx), plus PTX for newer GPUs.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"
# The oldest torch the test suite passes with (docs/supported-versions.md; 2.4.1 fails in
# torch.compile of the in-place op and in DTensor's import path).
MIN_TORCH = (2, 6)
# pyproject.toml's SPDX `license` string needs it; older ones fail with an obscure schema error.
MIN_SETUPTOOLS = (77,)
# Commands that compile (directly or through a wheel); sdist and the metadata commands (egg_info,
# dist_info) do not, so they work without torch, e.g. in `python -m build --sdist`'s isolated env.
COMPILING_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install",
                      "bdist_egg", "bdist"}
NO_TORCH_MESSAGE = """\
[gradfuse setup] cannot build: torch is not importable by {python}.
gradfuse compiles C++/CUDA code against the torch it will run with, so it must be built in the
environment that has that torch, without build isolation (pip's default isolated build would
not see it, or would compile against another torch). Install torch first, then one of:
    pip install --no-build-isolation gradfuse-<version>.tar.gz   # an sdist
    pip install --no-build-isolation .                           # a checkout
    pip wheel --no-build-isolation --no-deps .                   # a wheel
    python -m build --wheel --no-isolation                       # the same with `build`
(uv: `uv pip install --no-build-isolation .`)"""


def log(msg):
    print(f"[gradfuse setup] {msg}", file=sys.stderr)


def find_cuda_home():
    """The real toolkit root. The nvcc on PATH may be a wrapper script outside the toolkit (then
    torch's guess, dirname(dirname(nvcc)), has no lib64/libcudart and linking fails), so ask nvcc
    itself where it lives: its dry run prints the directory of the real binary."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--dryrun", "-v", "-x", "cu", os.devnull],
                                 capture_output=True, text=True, timeout=60)
            m = re.search(r"^#\$ _HERE_=(.*)$", out.stdout + out.stderr, re.M)
            if m and Path(m.group(1).strip(), "nvcc").exists():
                return str(Path(m.group(1).strip()).parent)
        except (OSError, subprocess.SubprocessError) as e:
            log(f"could not ask {nvcc} for its toolkit: {e}")
    for candidate in ("/usr/local/cuda",):
        if Path(candidate, "bin", "nvcc").exists():
            return candidate
    return None


def nvcc_version(cuda_home):
    out = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "--version"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"could not read the CUDA version from nvcc --version:\n{out}")
    return int(m.group(1)), int(m.group(2))


def decide_cuda(torch):
    """Whether to build the CUDA kernels: (use_cuda, cuda_home, reason)."""
    want = os.environ.get("GRADFUSE_CUDA")
    if want == "0":
        return False, None, "GRADFUSE_CUDA=0"
    reason = None
    cuda_home = find_cuda_home()
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is not a CUDA build"
    elif cuda_home is None:
        reason = "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    if reason:
        if want == "1":
            raise SystemExit(f"[gradfuse setup] GRADFUSE_CUDA=1 but {reason}")
        return False, None, reason
    major, minor = nvcc_version(cuda_home)
    torch_major = int(torch.version.cuda.split(".")[0])
    if major != torch_major:
        raise SystemExit(
            f"[gradfuse setup] nvcc in {cuda_home} is CUDA {major}.{minor} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; the major versions "
            "must match. Point CUDA_HOME at a matching toolkit, or build CPU-only with GRADFUSE_CUDA=0.")
    return True, cuda_home, f"CUDA {major}.{minor} at {cuda_home}"


def write_build_config(torch, use_cuda, archs):
    """csrc/generated/build_config.h: what this build is for, checked again at import."""
    path = ROOT / "csrc" / "generated" / "build_config.h"
    path.parent.mkdir(exist_ok=True)
    text = (
        "// Written by setup.py; not in git.\n#pragma once\n"
        f'#define GRADFUSE_TORCH_VERSION "{torch.__version__}"\n'
        f'#define GRADFUSE_CUDA_VERSION "{torch.version.cuda if use_cuda else ""}"\n'
        f'#define GRADFUSE_CUDA_ARCHS "{archs if use_cuda else ""}"\n'
    )
    if not path.exists() or path.read_text() != text:  # keep ninja's timestamps when unchanged
        path.write_text(text)


def compiler_takes_openmp() -> bool:
    """Whether the C++ compiler compiles and links an OpenMP program with -fopenmp."""
    import tempfile
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "omp.cpp"
        src.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            done = subprocess.run([cxx, "-fopenmp", str(src), "-o", str(Path(tmp) / "omp")],
                                  capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def decide_openmp() -> tuple[bool, str]:
    """(use OpenMP, why): GRADFUSE_OPENMP=0/1, else whether the compiler takes -fopenmp."""
    want = os.environ.get("GRADFUSE_OPENMP")
    if want == "0":
        return False, "GRADFUSE_OPENMP=0"
    if compiler_takes_openmp():
        return True, "the C++ compiler takes -fopenmp"
    if want == "1":
        raise SystemExit("[gradfuse setup] GRADFUSE_OPENMP=1 but the C++ compiler does not take -fopenmp")
    return False, "the C++ compiler does not take -fopenmp (the CPU kernels run on one thread)"


def import_torch():
    try:
        import torch
    except ImportError:
        raise SystemExit(NO_TORCH_MESSAGE.format(python=sys.executable)) from None
    return torch


def extensions():
    if not COMPILING_COMMANDS.intersection(sys.argv[1:]):
        return []  # sdist / metadata only: no compiler, no torch needed
    torch = import_torch()
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < MIN_TORCH:
        raise SystemExit(f"[gradfuse setup] torch >= {'.'.join(map(str, MIN_TORCH))} is required, "
                         f"found {torch.__version__}")
    use_cuda, cuda_home, reason = decide_cuda(torch)
    if use_cuda:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    archs = ""
    if use_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            if torch.cuda.is_available():
                archs = ";".join(sorted({"{}.{}".format(*torch.cuda.get_device_capability(i))
                                         for i in range(torch.cuda.device_count())}))
            else:
                archs = DEFAULT_CUDA_ARCHS
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    log(f"CUDA kernels: {'yes' if use_cuda else 'no'} ({reason})" + (f", archs {archs}" if archs else ""))
    write_build_config(torch, use_cuda, archs)

    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.environ.get("DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # -fopenmp: at::parallel_for is a header template that expands to `#pragma omp parallel` in
    # our own objects; without the flag it silently runs on one thread.
    use_openmp, why = decide_openmp()
    log(f"OpenMP: {'yes' if use_openmp else 'no'} ({why})")
    openmp = ["-fopenmp"] if use_openmp else []
    cxx = opt + ["-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"] + openmp
    if not debug:
        # Python's sysconfig CFLAGS (put first on every host compile line) usually hold -g: debug
        # info for torch's headers costs compile time and nothing checks it (DEBUG=1 keeps it).
        # Last on the line, -g0 wins.
        cxx += ["-g0"]
    link = openmp
    sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").glob("*.cpp"))]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))]
    if not use_cuda:
        return [CppExtension("gradfuse._C", sources, extra_compile_args={"cxx": cxx},
                             extra_link_args=link)]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "cuda").glob("*.cu"))]
    nvcc = opt + ["-lineinfo", "--Werror", "all-warnings"] if not debug else opt
    if os.environ.get("GRADFUSE_PTXAS_VERBOSE") == "1":
        nvcc += ["-Xptxas", "-v"]
    return [CUDAExtension("gradfuse._C", sources, extra_link_args=link,
                          extra_compile_args={"cxx": cxx + ["-DGRADFUSE_WITH_CUDA"], "nvcc": nvcc})]


RECORD_NAME = "_build_record.py"  # beside gradfuse/_C*.so; not in git, not in the sdist


def build_ext_class():
    if not COMPILING_COMMANDS.intersection(sys.argv[1:]):
        return build_ext
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtAndRecord(BuildExtension.with_options(use_ninja=True)):
        """After a successful build, writes gradfuse/_build_record.py next to the .so, so that
        gradfuse can still say what the build was for when the .so no longer loads (a build for
        another torch usually fails with an undefined symbol before it can be asked)."""

        def run(self):
            super().run()
            import torch
            with_cuda = any(isinstance(s, str) and s.endswith(".cu")
                            for ext in self.extensions for s in ext.sources)
            text = ("# Written by setup.py after building gradfuse._C; not in git.\n"
                    f"TORCH_VERSION = {torch.__version__!r}\n"
                    f"CUDA_VERSION = {(torch.version.cuda if with_cuda else '')!r}\n")
            targets = [Path(self.build_lib, "gradfuse")] + ([ROOT / "gradfuse"] if self.inplace else [])
            for folder in targets:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / RECORD_NAME).write_text(text)

    return BuildExtAndRecord


if tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:1]) < MIN_SETUPTOOLS:
    raise SystemExit(f"[gradfuse setup] setuptools >= {MIN_SETUPTOOLS[0]} is required, found "
                     f"{setuptools.__version__}: pip install -U 'setuptools>={MIN_SETUPTOOLS[0]}'")

setup(
    packages=find_packages(include=["gradfuse", "gradfuse.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": build_ext_class()},
)
