"""setup.py builds with OpenMP where the C++ compiler takes -fopenmp, and without it where it does
not (Apple clang): the branch forced here with GRADFUSE_OPENMP=0 and with a compiler that fails."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup_namespace(monkeypatch, env: dict) -> dict:
    """setup.py's functions, without running setup() or writing the build config."""
    for key in ("GRADFUSE_OPENMP", "CXX"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GRADFUSE_CUDA", "0")
    source = (ROOT / "setup.py").read_text()
    source = source[:source.index("if tuple(int(x) for x in re.findall(r\"\\d+\", setuptools.__version__)")]
    namespace = {"__file__": str(ROOT / "setup.py"), "__name__": "gradfuse_setup"}
    exec(compile(source, "setup.py", "exec"), namespace)
    namespace["write_build_config"] = lambda *args: None
    monkeypatch.setattr(sys, "argv", ["setup.py", "build_ext"])
    return namespace


def _flags(namespace) -> tuple[list, list]:
    (ext,) = namespace["extensions"]()
    return ext.extra_compile_args["cxx"], ext.extra_link_args


def test_openmp_where_the_compiler_takes_it(monkeypatch):
    ns = _setup_namespace(monkeypatch, {})
    assert ns["compiler_takes_openmp"]()  # gcc here
    cxx, link = _flags(ns)
    assert "-fopenmp" in cxx and "-fopenmp" in link


@pytest.mark.parametrize("env", [{"GRADFUSE_OPENMP": "0"}, {"CXX": "false"}], ids=["forced-off", "no-openmp-compiler"])
def test_no_openmp_without_a_compiler_that_takes_it(monkeypatch, env):
    ns = _setup_namespace(monkeypatch, env)
    cxx, link = _flags(ns)
    assert "-fopenmp" not in cxx and "-fopenmp" not in link
    assert "-O3" in cxx  # the rest of the flags stay


def test_openmp_forced_on_without_support_stops(monkeypatch):
    ns = _setup_namespace(monkeypatch, {"GRADFUSE_OPENMP": "1", "CXX": "false"})
    with pytest.raises(SystemExit, match="does not take -fopenmp"):
        ns["decide_openmp"]()
