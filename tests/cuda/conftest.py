"""The emulated-CUDA files start Python processes that import cuda_emu (tests/cuda_emu) by name:
they find it through PYTHONPATH."""
import os

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def tests_on_pythonpath(monkeypatch):
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != TESTS]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, *rest]))
