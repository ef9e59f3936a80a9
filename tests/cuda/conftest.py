"""The emulated-CUDA files start Python processes that import cuda_emu (tests/cuda_emu) by name:
they find it through PYTHONPATH. Their fixtures (the emulated backend, one torch thread) come from
emu_fixtures."""
import os

import pytest
from emu_fixtures import emu, one_thread  # noqa: F401 (the fixtures of this folder's tests)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def tests_on_pythonpath(monkeypatch):
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != TESTS]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, *rest]))
