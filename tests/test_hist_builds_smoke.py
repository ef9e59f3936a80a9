"""benchmarks/hist_builds.py (issue 19 diagnostic) runs: tiny tensor, one round, untimed."""
import os
import sys

import pytest

from gradfuse import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(_ext._C is None, reason="gradfuse._C not built")


def test_hist_builds_script(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import hist_builds
    finally:
        sys.path.pop(0)
    before = _ext._C.cpu_capability()
    assert hist_builds.main(["--rounds", "1", "--elems", "4096"]) == 0
    assert _ext._C.cpu_capability() == before  # left as it was
    out = capsys.readouterr().out
    if _ext._C.build_info()["best_cpu_capability"] == "avx2":
        assert "torch.bfloat16:" in out and "avx2 / default" in out
    else:
        assert "nothing to compare" in out
