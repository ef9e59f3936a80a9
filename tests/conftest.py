"""Shared fixtures of the whole suite.

Layout: one folder per layer of the package (ops/, core/, clip/, numerics/, activations/,
dynamics/, monitor/, integrations/, cuda/, packaging/), none of them a Python package: pytest's
default import mode puts each test file's folder on sys.path and imports it by its basename, so
basenames stay unique across folders (pytest stops with "import file mismatch" otherwise). The
helpers every folder shares (helpers, clip_helpers, hist_helpers, gloo_checks, dist_workers,
emu_fixtures, cuda_emu) stay here in tests/, imported by bare name: this folder is put first on
sys.path below (processes started by torch.multiprocessing inherit sys.path). A worker script
used by one folder only lives next to its test."""
import os
import sys

import pytest
import torch

import gradfuse

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def pytest_report_header(config):
    info = gradfuse.build_info()
    return (f"gradfuse build: {info}\n"
            f"backends: " + ", ".join(f"{d}={gradfuse.backend(d)}" for d in DEVICES))


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request):
    return request.param


@pytest.fixture(params=["avx2", "default"])
def cpu_capability(request):
    """Runs a test with each build of the CPU kernels this machine can run."""
    from gradfuse.ops import library
    if library.extension is None:
        pytest.skip("gradfuse._C not built")
    best = library.extension.build_info()["best_cpu_capability"]
    if request.param == "avx2" and best != "avx2":
        pytest.skip("no AVX2 on this CPU")
    before = library.extension.cpu_capability()
    library.extension.set_cpu_capability(request.param)
    yield request.param
    library.extension.set_cpu_capability(before)


@pytest.fixture
def cpu_without_float64(monkeypatch):
    """The CPU as a device without kernels and without float64 (Apple's MPS), for the float32
    path of the reference; run the code under test in helpers.NoFloat64."""
    from gradfuse.ops import library
    monkeypatch.setattr(library, "KERNELS", {"cpu": False, "cuda": False})
    monkeypatch.setattr(library, "OP_KERNELS", {key: False for key in library.OP_KERNELS})
    monkeypatch.setattr(library, "_warned", {"cpu"})
    monkeypatch.setattr(library, "NO_FLOAT64", {"mps", "cpu"})
    gradfuse.core.walk_cache.clear()
