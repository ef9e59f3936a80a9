"""The statistics rows are declared once in Python (gradfuse.ops.layout) and once in C++
(csrc/common/stats_math.h): the two agree, and every consumer of the rows follows the table
(the fake kernels, the reference, the compiled ops, the distributed reduction, the AMP unscale,
GradStats and the data reference). CONTRIBUTING.md's "Adding a statistic" lists the files a new
column touches; the tests below check that list against the code."""
import math
import re
from pathlib import Path

import pytest
import torch

import gradfuse
from gradfuse.core.grad_stats import PER_PARAM_FIELDS, STATISTICS
from gradfuse.ops import fake, layout, library, reference

ROOT = Path(__file__).resolve().parents[2]
needs_extension = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")


def table_entries(macro: str) -> list[str]:
    """The member names of a column table macro of stats_math.h, in order."""
    text = (ROOT / "csrc" / "common" / "stats_math.h").read_text()
    body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)+.*)", text).group(1)
    return re.findall(r"X\(k\w+, (\w+), \w+\)", body)


def test_the_cpp_table_and_the_python_table_agree():
    assert table_entries("GRADFUSE_FLOAT_STATS") == list(layout.FLOAT_NAMES)
    assert table_entries("GRADFUSE_COUNT_STATS") + ["numel"] == list(layout.COUNT_NAMES)


@needs_extension
def test_the_built_extension_has_the_python_layout():
    floats, counts = gradfuse.build_info()["stats_layout"]
    assert (tuple(floats), tuple(counts)) == (layout.FLOAT_NAMES, layout.COUNT_NAMES)


def test_every_float_column_says_how_it_combines_and_scales():
    for c in layout.FLOAT_COLUMNS:
        assert c.combine in ("sum", "max") and c.degree in (1, 2, "p"), c
    assert sorted(layout.SUMMED_FLOAT_COLUMNS + layout.MAX_FLOAT_COLUMNS) == list(range(layout.NUM_FLOAT_STATS))
    assert all(c.combine == "sum" and c.degree is None for c in layout.COUNT_COLUMNS)
    assert layout.COUNT_NAMES[-1] == "numel"  # written by the finish, not accumulated (stats_math.h)


def rows_of(op_result):
    floats, counts = op_result[:2]
    return floats.shape[1], counts.shape[1]


@pytest.mark.parametrize("op,args,empty_args", [
    ("multi_tensor_stats", (2.0,), (2.0,)),
    ("multi_tensor_moments", (), ()),
    ("multi_tensor_unit_stats", ([2], 2.0), ([], 2.0)),
    ("multi_tensor_clamp_", (0.5,), (0.5,)),
])
def test_every_op_returns_rows_of_the_layout(op, args, empty_args):
    x = torch.randn(4, 3)
    width = (layout.NUM_FLOAT_STATS, layout.NUM_COUNT_STATS)
    assert rows_of(getattr(reference, op)([x.clone()], *args)) == width
    assert rows_of(getattr(reference, op)([], *empty_args)) == width
    assert rows_of(fake.FAKES[op]([x.clone()], *args)) == width
    if library.extension is not None:
        assert rows_of(getattr(torch.ops.gradfuse, op)([x.clone()], *args)) == width


def test_the_reference_refuses_rows_that_miss_a_column():
    with pytest.raises(AssertionError, match="layout has"):
        reference.stack_columns({"sum": torch.zeros(())}, layout.FLOAT_NAMES, 0)


def test_gradstats_reports_every_statistic_of_the_table():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).square().sum().backward()
    model.bias.grad[0] = 0.0
    s = gradfuse.stats(model)
    row = s.to_dict()["params"]["weight"]
    assert list(row) == list(PER_PARAM_FIELDS)
    for st in STATISTICS:
        value = getattr(s, st.name)[0].item()
        assert isinstance(row[st.name], int if st.count else float)
        assert row[st.name] == pytest.approx(value), st.name
    assert row["l2"] > 0 and s.to_dict()["params"]["bias"]["zero_count"] == 1  # values to compare
    head = s.table().splitlines()[0].split()
    assert head == ["parameter"] + [st.header for st in STATISTICS if st.header is not None]


def test_amp_unscale_scales_each_column_by_its_degree():
    model = torch.nn.Linear(4, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(5, 4)).square().sum()).backward()
    from gradfuse.core.amp import unscaled_stats
    grads = [p.grad for p in model.parameters()]
    for p in (2.0, 3.0):
        s, _ = unscaled_stats(["weight", "bias"], grads, scaler, p)
        expected = gradfuse.ops.multi_tensor_stats([g / 8.0 for g in grads], p)[0]  # 8: exact in float
        torch.testing.assert_close(s.floats, expected, rtol=1e-6, atol=0)
        assert (s.floats[:, :3] != 0).all()  # something to compare


def test_the_data_reference_documents_the_rows_and_the_statistics():
    text = (ROOT / "docs" / "data-reference.md").read_text()
    assert layout.rows_markdown() in text, "docs/data-reference.md must hold:\n" + layout.rows_markdown()
    params = next(line for line in text.splitlines() if line.startswith("| `params` |"))
    assert re.findall(r"`(\w+)`", params)[1:1 + len(PER_PARAM_FIELDS)] == list(PER_PARAM_FIELDS)


def recipe_files() -> list[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## Adding a statistic", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.M)


def test_the_recipe_names_at_most_six_files_and_they_exist():
    files = recipe_files()
    assert 0 < len(files) <= 6, files
    for f in files:
        assert (ROOT / f).is_file(), f


# Code outside the recipe's files that names a column, and the columns it names: pass 2's NaN and
# Inf counts (NonfiniteCount, the same for every column layout), and the clamp's fused loops, which
# take max |x| and the zero count from raw 16-bit lanes and carry their count of changed elements
# through a row's zero count (the sums go through add_sums and StatsAcc, like every other loop's).
OWN_WAY = {
    "csrc/cpu/clip_kernels_impl.h": {"maxabs", "zero", "nan", "inf"},
    "csrc/cuda/clip_ops.cuh": {"zero", "nan", "inf"},
    "csrc/cuda/stats_ops.cuh": {"nan", "inf"},
}


def test_every_file_that_names_a_column_is_in_the_recipe():
    """A file that names the columns of a row one by one (the per-element arithmetic, the vector
    lanes, the reference's formulas) is one of the recipe's; every other consumer follows the
    tables (widths, loops over the columns, StatsAcc's combine / store / load / for_each)."""
    members = "|".join(layout.FLOAT_NAMES + layout.COUNT_NAMES[:-1])
    files = set(recipe_files())
    found = {}
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".h", ".cpp", ".cu", ".cuh"):
            names = set(re.findall(rf"\.({members})\b(?!\()", path.read_text()))
            if names:
                found[str(path.relative_to(ROOT))] = names
    for path in (ROOT / "gradfuse").rglob("*.py"):  # a row of the statistics built column by column
        if re.search(r"stack_columns\(\{\s*\"(sum|nan)\"", path.read_text()):
            found[str(path.relative_to(ROOT))] = {"(all)"}
    outside = {f: names for f, names in found.items() if f not in files and not names <= OWN_WAY.get(f, set())}
    assert not outside, outside
    assert "csrc/common/stats_math.h" in found and "gradfuse/ops/reference.py" in found  # it looks


def test_width_four_is_spelled_nowhere():
    """No consumer hard-codes the rows' width."""
    offenders = []
    for path in (ROOT / "gradfuse").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(zeros|empty|full|ones)\(\s*\(\s*(0|n|len\([^)]*\)|u|count),\s*4\s*\)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_unit_rows_of_an_empty_unit_have_the_layout_width():
    floats, counts = reference.multi_tensor_unit_stats([torch.empty(2, 0)], [2])
    assert floats.shape == (2, layout.NUM_FLOAT_STATS) and counts.shape == (2, layout.NUM_COUNT_STATS)
    assert not math.isnan(floats.sum().item())


SCRATCH_PROGRAM = """
import warnings
import torch
warnings.simplefilter("ignore")
import gradfuse
from gradfuse.ops import fake, library
assert library.extension is None  # the reference computes every row
x = [torch.randn(6, 3, dtype=torch.float64), torch.arange(-2.0, 3.0, dtype=torch.float64)]
s = gradfuse.tensor_stats(x)
assert s.floats.shape == (2, 5) and fake.FAKES["multi_tensor_stats"](x, 2.0)[0].shape == (2, 5)
cubes = torch.stack([t.pow(3).sum() for t in x])
torch.testing.assert_close(s.sumcubes, cubes)
assert s.to_dict()["params"]["[0]"]["sumcubes"] == s.sumcubes[0].item() != 0
assert s.table().splitlines()[0].split()[-1] == "cubes"
model = torch.nn.Linear(3, 2).double()
scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
scaler.scale(model(x[0][:, :3]).sum()).backward()
from gradfuse.core.amp import unscaled_stats
u, _ = unscaled_stats(["w", "b"], [p.grad for p in model.parameters()], scaler, 2.0)
torch.testing.assert_close(u.sumcubes, torch.stack([(p.grad / 4).pow(3).sum() for p in model.parameters()]))
print("ok")
"""


def test_a_throwaway_column_added_by_the_recipe_reaches_the_python_side(tmp_path):
    """The recipe's Python steps (layout, reference, GradStats) on a scratch copy of the package,
    run on the reference backend: the new column is in the rows of every op and fake kernel, in
    GradStats, to_dict, table() and the AMP unscale, with nothing else changed."""
    import shutil
    import subprocess
    import sys

    pkg = tmp_path / "gradfuse"
    shutil.copytree(ROOT / "gradfuse", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))

    def edit(rel, old, new, count=1):
        path = pkg / rel
        text = path.read_text()
        assert text.count(old) == count, (rel, old)
        path.write_text(text.replace(old, new))

    edit("ops/layout.py", "COUNT_COLUMNS: tuple[Column, ...] = (",
         'FLOAT_COLUMNS += (Column("sumcubes", "sum", 3, "sum of cubes"),)\nCOUNT_COLUMNS: tuple[Column, ...] = (')
    edit("ops/reference.py", '"maxabs": maxabs, "powsum": powsum}',
         '"maxabs": maxabs, "powsum": powsum, "sumcubes": x.pow(3).sum()}')
    edit("ops/reference.py", '"powsum": powsum}, FLOAT_NAMES, 1)',
         '"powsum": powsum, "sumcubes": x.pow(3).sum(1)}, FLOAT_NAMES, 1)')
    edit("core/grad_stats.py", '    Statistic("zero_fraction", False, "zero%", 6, ".1f", 100.0),\n',
         '    Statistic("zero_fraction", False, "zero%", 6, ".1f", 100.0),\n'
         '    Statistic("sumcubes", False, "cubes", 10, ".4g"),\n')
    edit("core/grad_stats.py", "    @property\n    def nonfinite(self)",
         "    @property\n    def sumcubes(self) -> torch.Tensor:\n        return self.floats[:, 4]\n\n"
         "    @property\n    def nonfinite(self)")
    out = subprocess.run([sys.executable, "-c", SCRATCH_PROGRAM], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
