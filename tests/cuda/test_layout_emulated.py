"""A column added to the C++ table of the statistics rows (csrc/common/stats_math.h) reaches every
part of the CUDA backend: a scratch copy of csrc/ gets a throwaway column (the sum of cubes) by
the steps of CONTRIBUTING.md's "Adding a statistic" for that file (the table entry; the
ElementAcc member, its line in add and in stats()), nothing else, and runs through the CUDA
emulation (tests/cuda_emu): the partial rows, the warp and block reductions, the finalize and the
op's result all carry it, and the other columns are unchanged.

The first run builds the scratch copy's emulation (about 40 s, cached in build/cuda_emu/).
"""
import os
import re
import shutil
import subprocess
import sys

import cuda_emu
import pytest
from emu_fixtures import SANITIZED

from gradfuse.ops import library

pytestmark = [pytest.mark.skipif(library.extension is None,
                                 reason="gradfuse._C (the CPU backend compared with) not built"),
              pytest.mark.skipif(SANITIZED, reason="the sanitized run is the grid's")]

PROGRAM = r"""
import sys
import torch
sys.path.insert(0, "tests")
import cuda_emu
from helpers import assert_stats_close

emu = cuda_emu.load()
torch.set_num_threads(1)
CHUNK = 65536
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    sizes = (0, 1, 7, 1000, CHUNK + 3, 2 * CHUNK)
    tensors = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    tensors.append(torch.randn(3 * CHUNK + 5, generator=g, dtype=torch.float64).to(dtype)[1:])  # a misaligned view
    floats, counts = emu.multi_tensor_stats(tensors, 2.0)
    assert floats.shape == (len(tensors), 5) and counts.shape == (len(tensors), 4), floats.shape
    assert_stats_close(tensors, (floats[:, :4], counts), expected=torch.ops.gradfuse.multi_tensor_stats(tensors, 2.0))
    cubes = torch.stack([t.double().pow(3).sum() for t in tensors])
    scale = torch.stack([t.double().abs().pow(3).sum() for t in tensors])
    assert ((floats[:, 4] - cubes).abs() <= 1e-4 * scale + 1e-12).all(), (floats[:, 4], cubes)
    assert (floats[1:, 4] != 0).all()  # something to compare
print("ok")
"""


def add_column(csrc) -> None:
    path = csrc / "common" / "stats_math.h"
    text = path.read_text()
    steps = [  # (pattern, replacement): the recipe's edits of stats_math.h
        (r"(  X\(kPowSum, powsum, Add\))\n", r"\1 \\\n  X(kSumCubes, sumcubes, Add)\n"),
        (r"(struct ElementAcc \{\n(?:  .*\n)*?  acc_t powsum = 0;\n)", r"\1  acc_t sumcubes = 0;\n"),
        (r"(\n    sumsq \+= x \* x;\n)", r"\1    sumcubes += x * x * x;\n"),
        (r"(\n    s\.powsum = powsum;\n)", r"\1    s.sumcubes = sumcubes;\n"),
    ]
    for pattern, replacement in steps:
        text, n = re.subn(pattern, replacement, text, count=1)
        assert n == 1, pattern
    path.write_text(text)


def test_a_throwaway_column_reaches_the_cuda_rows():
    scratch = cuda_emu.ROOT / "build" / "cuda_emu" / "scratch_column" / "csrc"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(cuda_emu.ROOT / "csrc", scratch)
    add_column(scratch)
    env = dict(os.environ, GRADFUSE_EMU_CSRC=str(scratch), PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=cuda_emu.ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-4000:] + out.stderr[-4000:]
