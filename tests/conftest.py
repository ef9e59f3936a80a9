import pytest
import torch

import gradfuse

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
