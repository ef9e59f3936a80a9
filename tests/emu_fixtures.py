"""What the emulated-CUDA test files share: the emulated backend, one torch thread while they run,
and the reruns of a file under ASan/UBSan, with FMA contraction, or with the blocks and threads
scheduled in reverse order. Import the fixtures by name into a test file."""
import os
import subprocess
import sys

import cuda_emu
import pytest
import torch

SANITIZED = os.environ.get("GRADFUSE_EMU_SANITIZE") == "1"
FMA = os.environ.get("GRADFUSE_EMU_FMA") == "1"
REVERSED = os.environ.get("CUDA_EMU_SCHEDULE") == "reverse"
RERUN = SANITIZED or FMA or REVERSED  # a rerun does not start reruns of its own


@pytest.fixture(scope="module")
def emu():
    return cuda_emu.load()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The emulator runs on one thread, and the many small reductions of the comparisons only lose
    # to OpenMP wake-ups (seconds per test on a busy machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rerun_under_sanitizers(test_file: str, timeout: int = 1800) -> None:
    """Runs test_file again with the emulated backend built with -fsanitize=address,undefined:
    out-of-bounds and misaligned accesses, and undefined behaviour, abort the run."""
    if cuda_emu.sanitizer_runtime() is None:
        pytest.skip("the C++ compiler has no libasan")
    # Uncaptured and unbuffered: a sanitizer aborts the process, losing what pytest holds.
    env = dict(cuda_emu.sanitizer_env(os.environ), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-x", "-s", "-p", "no:randomly",
                           "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cuda_emu.ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout


def rerun_with_fma(test_file: str, keyword: str, timeout: int = 900) -> None:
    """Runs the tests of test_file selected by ``-k keyword`` again with the emulated backend built
    with -mfma -ffp-contract=fast, as nvcc contracts a*b+c into an FMA by default."""
    with open("/proc/cpuinfo") as f:
        if " fma" not in f.read():
            pytest.skip("this CPU has no FMA instructions")
    env = dict(os.environ, GRADFUSE_EMU_FMA="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-x", "-k", keyword, "-p", "no:randomly",
                           "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cuda_emu.ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout


def rerun_reversed(test_file: str, keyword: str, timeout: int = 900) -> None:
    """Runs the tests of test_file selected by ``-k keyword`` again with the emulator taking the
    blocks of every launch from the last down and the threads of a block from the last down
    (CUDA_EMU_SCHEDULE=reverse): a result that depends on the order blocks run in, or on which
    thread reaches shared memory first between two barriers, changes."""
    env = dict(os.environ, CUDA_EMU_SCHEDULE="reverse", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-x", "-k", keyword, "-p", "no:randomly",
                           "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cuda_emu.ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout
