"""Benchmark options and shared fixtures. See benchmarks/README.md."""
import gc

import pytest
import torch

from gradfuse.demo import workloads as wl

SIZES = {
    # tiny shapes for the untimed smoke run in the normal tests
    "smoke": {
        "gpt2_small": lambda: wl.gpt2_small(layers=1, d=64, vocab=500, ctx=32),
        "resnet50": lambda: wl.resnet50()[:20],
        "many_small": lambda: wl.many_small(count=200, lo=16, hi=64),
        "tiny": lambda: wl.tiny(count=200),
        "few_large": lambda: wl.few_large(count=2, numel=100_000),
    },
    # what runs on a 2-core CPU machine in a few minutes
    "cpu": {
        "gpt2_small": wl.gpt2_small,
        "llama_1b": wl.llama_1b,
        "resnet50": wl.resnet50,
        "many_small": wl.many_small,
        "tiny": wl.tiny,
        "few_large": lambda: wl.few_large(count=4, numel=32 * 2**20),
    },
    # the GPU check: adds a set of several GB
    "gpu": {
        "gpt2_small": wl.gpt2_small,
        "llama_1b": wl.llama_1b,
        "resnet50": wl.resnet50,
        "many_small": wl.many_small,
        "tiny": wl.tiny,
        "few_large": lambda: wl.few_large(count=8, numel=256 * 2**20),
    },
}


def pytest_addoption(parser):
    parser.addoption("--bench-size", default="cpu", choices=sorted(SIZES),
                     help="workload sizes: smoke (tiny), cpu, gpu")
    parser.addoption("--bench-device", default="cpu", help="cpu or cuda")
    parser.addoption("--bench-workloads", default="",
                     help="comma-separated workload names (default: all of the size)")
    parser.addoption("--bench-dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    parser.addoption("--bench-methods", default="", help="comma-separated method names (default: all)")


def _selected(config, option, all_names):
    raw = config.getoption(option)
    names = [n for n in raw.split(",") if n] if raw else list(all_names)
    unknown = set(names) - set(all_names)
    if unknown:
        raise pytest.UsageError(f"{option}: unknown {sorted(unknown)}; choose from {sorted(all_names)}")
    return names


def pytest_generate_tests(metafunc):
    from methods import METHODS
    config = metafunc.config
    sizes = SIZES[config.getoption("--bench-size")]
    if "workload" in metafunc.fixturenames:
        metafunc.parametrize("workload", _selected(config, "--bench-workloads", sizes), scope="module")
    if "dtype_name" in metafunc.fixturenames:
        metafunc.parametrize("dtype_name", _selected(config, "--bench-dtypes",
                                                      ["float32", "bfloat16", "float16", "float64"]),
                             scope="module")
    if "method" in metafunc.fixturenames:
        metafunc.parametrize("method", _selected(config, "--bench-methods", METHODS))


@pytest.fixture(scope="session")
def device(pytestconfig):
    d = torch.device(pytestconfig.getoption("--bench-device"))
    if d.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return d


@pytest.fixture(scope="module")
def named_grads(pytestconfig, workload, dtype_name, device):
    shapes = SIZES[pytestconfig.getoption("--bench-size")][workload]()
    named = wl.make_grads(shapes, getattr(torch, dtype_name), device)
    yield named
    del named
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
