"""Packaging, as a new user installs gradfuse.

Fast (every run): the sdist carries every file under csrc/ that the checkout has, the package and
the build files, and nothing else (no tests, build outputs, runs/, .venv); making it needs no
torch; a build that cannot see torch (an isolated build) stops with the commands to run; what
`python -m gradfuse info` says when the build and the running torch or GPU differ.

Compiling (GRADFUSE_PACKAGING_TESTS=1, set by scripts/check_packaging.sh, which CI runs): the
sdist (`pip install --no-build-isolation gradfuse-*.tar.gz`), a wheel of a clone (`pip wheel
--no-build-isolation .`) and a plain `pip install --no-build-isolation .` of the clone, each into
a fresh venv, then a stats/clip check against torch.nn.utils from outside the source tree; and
pip's default isolated build, which must stop with the message. The fresh venvs are made
`--without-pip` and see this interpreter's site-packages (torch, pip, setuptools, ninja) through a
.pth file, so nothing is downloaded; gradfuse itself lands in the venv's own site-packages. The
wheel and `pip install .` are made by one venv in one clone, one after the other as a user would,
so the second reuses the first's objects: one compile for those two, one for the sdist.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from gradfuse.__main__ import main
from gradfuse.ops import library

ROOT = Path(__file__).resolve().parents[2]
compiling = pytest.mark.skipif(os.environ.get("GRADFUSE_PACKAGING_TESTS") != "1",
                               reason="compiles gradfuse twice: run scripts/check_packaging.sh")
# Build outputs and local state a developer's checkout may hold; none may reach an sdist.
JUNK = ["build/temp.linux-x86_64-cpython-311/csrc/gradfuse.o", "gradfuse/_C.cpython-311-x86_64-linux-gnu.so",
        "csrc/generated/build_config.h", "csrc/cpu/__pycache__/x.cpython-311.pyc", "runs/demo/run.jsonl",
        ".venv/bin/python", "gradfuse.egg-info/PKG-INFO", "dist/old.tar.gz", "build.log"]
BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "  # `import torch` raises ImportError


def checkout_files() -> list[str]:
    """What a fresh clone of this checkout would hold: tracked files plus new, not ignored ones."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted(f for f in out.split("\0") if f and (ROOT / f).is_file())


def run(cmd, cwd, env=None, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the checkout as a clone has it, plus a developer's leftovers (JUNK)."""
    dest = tmp_path_factory.mktemp("clone")
    for rel in checkout_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes((ROOT / rel).read_bytes())
    for rel in JUNK:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("junk")
    return dest


@pytest.fixture(scope="module")
def sdist(clone, tmp_path_factory) -> Path:
    """Made as `python -m build --sdist` makes it (setuptools' PEP 517 hook), with torch hidden."""
    out = tmp_path_factory.mktemp("sdist")
    run([sys.executable, "-c",
         BLOCK_TORCH + f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"], cwd=clone)
    (archive,) = out.glob("gradfuse-*.tar.gz")
    return archive


def sdist_files(archive: Path) -> set[str]:
    with tarfile.open(archive) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}


def test_sdist_carries_every_csrc_file_and_nothing_else(sdist):
    files = sdist_files(sdist)
    expected = {f for f in checkout_files() if f.startswith(("csrc/", "gradfuse/"))}
    expected |= {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "PKG-INFO", "setup.cfg"}
    metadata = {f for f in files if f.startswith("gradfuse.egg-info/")}
    assert any(f.startswith("csrc/common/") and f.endswith(".h") for f in expected)  # headers are compared
    assert any(f.endswith(".cu") for f in expected)
    assert files - metadata == expected
    assert not {f for f in files if f.endswith((".so", ".o", ".pyc"))}


def test_build_without_torch_stops_with_the_commands_to_run(clone, tmp_path):
    # What pip's default isolated build amounts to: metadata works, the compile stops and says why.
    run([sys.executable, "-c", BLOCK_TORCH + f"from setuptools import build_meta; "
         f"build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})"], cwd=clone)
    proc = run([sys.executable, "-c", BLOCK_TORCH + f"from setuptools import build_meta; "
                f"build_meta.build_wheel({str(tmp_path)!r})"], cwd=clone, check=False)
    assert proc.returncode != 0
    assert "torch is not importable" in proc.stderr
    assert "pip install --no-build-isolation ." in proc.stderr
    assert not list(tmp_path.glob("*.whl"))


def test_import_refuses_a_build_for_another_torch(tmp_path):
    # An installed copy whose .so no longer loads (as a build for another torch fails, on an
    # undefined symbol) and whose build record names another torch.
    package = tmp_path / "gradfuse"
    package.mkdir()
    for source in (ROOT / "gradfuse").rglob("*.py"):  # every subpackage: the import must reach the check
        rel = source.relative_to(ROOT / "gradfuse")
        if rel != Path("_build_record.py"):
            (package / rel).parent.mkdir(parents=True, exist_ok=True)
            (package / rel).write_text(source.read_text())
    (package / "_build_record.py").write_text("TORCH_VERSION = '1.0.0+cu100'\nCUDA_VERSION = '10.0'\n")
    for cmd in (["-c", "import gradfuse"], ["-m", "gradfuse", "info"]):
        proc = run([sys.executable, *cmd], cwd=tmp_path, check=False)
        assert proc.returncode != 0
        assert (f"gradfuse._C was built for torch 1.0.0+cu100 (CUDA 10.0 kernels) but torch {torch.__version__}"
                in proc.stderr), proc.stderr[-2000:]
        assert "pip install --no-build-isolation --no-deps --force-reinstall" in proc.stderr


@pytest.mark.parametrize("arch, capability, runs", [
    ("9.0", (9, 0), True), ("8.0", (8, 6), True), ("8.6", (8, 0), False), ("8.0", (9, 0), False),
    ("12.0+PTX", (12, 1), True), ("9.0+PTX", (10, 0), True), ("10.0+PTX", (9, 0), False), ("9.0a", (9, 0), True),
])
def test_which_built_archs_run_on_a_gpu(arch, capability, runs):
    assert library.arch_runs_on(arch, capability) is runs


class FakeExtension:
    def __init__(self, **info):
        self.info = {"torch_version": torch.__version__, "cuda_version": "", "cuda_archs": "", "with_cuda": False,
                     "chunk_elems": 65536, "best_cpu_capability": "default", **info}
        self.__file__ = "_C.cpython-311-x86_64-linux-gnu.so"

    def build_info(self):
        return dict(self.info)

    def cpu_capability(self):
        return "default"


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")


def test_info_matching_build(capsys, monkeypatch, one_gpu):
    monkeypatch.setattr(library, "extension", FakeExtension(with_cuda=True, cuda_version="13.0", cuda_archs="8.0;9.0"))
    monkeypatch.setitem(library.KERNELS, "cuda", True)
    assert library.mismatches() == []
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "built for" in out and torch.__version__ in out and "NVIDIA H200 (9.0)" in out
    assert "OK: the build serves every device here." in out


def test_info_gpu_but_no_cuda_kernels(capsys, monkeypatch, one_gpu):
    monkeypatch.setattr(library, "extension", FakeExtension(with_cuda=False))
    assert main(["info"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: a GPU is visible but this build has no CUDA kernels" in out
    assert "--no-build-isolation" in out and "GRADFUSE_CUDA=1" in out


def test_info_gpu_arch_not_built(capsys, monkeypatch, one_gpu):
    monkeypatch.setattr(library, "extension", FakeExtension(with_cuda=True, cuda_version="13.0", cuda_archs="8.0;10.0"))
    problems = library.mismatches()
    assert len(problems) == 1 and "compute capability 9.0" in problems[0]
    assert 'TORCH_CUDA_ARCH_LIST="9.0"' in problems[0]


def test_info_extension_missing(capsys, monkeypatch):
    monkeypatch.setattr(library, "extension", None)
    monkeypatch.setattr(library, "KERNELS", {"cpu": False, "cuda": False})
    monkeypatch.setattr(library, "load_error", "gradfuse._C could not be loaded (No module named 'gradfuse._C').")
    assert main(["info"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: gradfuse._C could not be loaded" in out and "pure-PyTorch reference" in out


# ---- compiling: each install path into a fresh venv, checked from outside the source tree ----

SMOKE = r"""
import sys
from pathlib import Path
import torch
import gradfuse
venv = Path(sys.prefix).resolve()
assert Path(gradfuse.__file__).resolve().is_relative_to(venv), (gradfuse.__file__, venv)
assert gradfuse.build_info()["extension_loaded"] and gradfuse.backend("cpu").startswith("cpu-"), gradfuse.build_info()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
model(torch.randn(32, 8)).pow(2).sum().backward()
grads = [p.grad.clone() for p in model.parameters()]
assert all(g.abs().sum() > 0 for g in grads)
expected_l2 = torch.stack([g.double().norm() for g in grads])
twins = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
for twin, g in zip(twins, grads):
    twin.grad = g.clone()
expected_total = torch.nn.utils.clip_grad_norm_(twins, max_norm=0.5)
s = gradfuse.clip_(model, max_norm=0.5)
assert bool(s.clipped) and float(expected_total) > 0.5
torch.testing.assert_close(s.total_norm, expected_total)
torch.testing.assert_close(s.l2, expected_l2)
for p, twin in zip(model.parameters(), twins):
    torch.testing.assert_close(p.grad, twin.grad)
t = torch.tensor([1.0, float("nan"), 0.0])
assert gradfuse.tensor_stats([t]).nan_count.tolist() == [1]
print("smoke ok:", gradfuse.backend("cpu"), float(expected_total))
"""


def fresh_venv(path: Path) -> Path:
    """A venv whose own site-packages is empty and which sees this interpreter's (torch, pip,
    setuptools, ninja) after its own."""
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=path).stdout.strip()
    (Path(purelib) / "_host_site_packages.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    return python


def check_installed(python: Path, outside: Path) -> None:
    outside.mkdir(parents=True)
    assert "smoke ok: cpu-" in run([python, "-I", "-c", SMOKE], cwd=outside).stdout
    info = run([python, "-I", "-m", "gradfuse", "info"], cwd=outside).stdout
    assert "OK: the build serves every device here." in info and torch.__version__ in info


BUILD_ENV = {"GRADFUSE_CUDA": "0", "MAX_JOBS": os.environ.get("MAX_JOBS", "2")}  # CPU-only: CI has no GPU


@compiling
def test_sdist_installs_and_works(sdist, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "--no-build-isolation", sdist], cwd=tmp_path, env=BUILD_ENV)
    check_installed(python, tmp_path / "elsewhere")


@compiling
def test_wheel_and_pip_install_of_a_clone_work(clone, tmp_path):
    # Both from the same clone and the same venv, as a user would run them one after the other:
    # the second finds the first's objects in build/ (same compiler commands) and compiles nothing.
    builder = fresh_venv(tmp_path / "builder")
    run([builder, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "wheels", "."],
        cwd=clone, env=BUILD_ENV)
    (wheel,) = (tmp_path / "wheels").glob("gradfuse-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert any(n.startswith("gradfuse/_C.") and n.endswith(".so") for n in names)
    assert {n for n in names if n.startswith("gradfuse/") and n.endswith(".py")} == \
        {f for f in checkout_files() if f.startswith("gradfuse/") and f.endswith(".py")} | {"gradfuse/_build_record.py"}
    assert not [n for n in names if n.startswith(("csrc/", "tests/", "build/"))]

    run([builder, "-m", "pip", "install", "--no-build-isolation", "."], cwd=clone, env=BUILD_ENV)
    assert not list((tmp_path / "builder" / "lib").rglob("__editable__*"))  # a real install, not a link
    check_installed(builder, tmp_path / "from-clone")

    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", wheel], cwd=tmp_path)
    check_installed(python, tmp_path / "from-wheel")


@compiling
def test_isolated_pip_install_stops_with_the_commands_to_run(clone, tmp_path):
    # pip's default: it installs setuptools and ninja into a throwaway env (from the index),
    # which has no torch; gradfuse must stop there instead of compiling against a fresh torch.
    python = fresh_venv(tmp_path / "venv")
    proc = run([python, "-m", "pip", "install", "."], cwd=clone, env=BUILD_ENV, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "torch is not importable" in out and "pip install --no-build-isolation ." in out, out[-3000:]
    assert run([python, "-c", "import importlib.util; print(importlib.util.find_spec('gradfuse'))"],
               cwd=tmp_path).stdout.strip() == "None"
