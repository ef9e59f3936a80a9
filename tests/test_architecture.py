"""The package's layers, checked from the source by scripts/check_architecture.py: no upward
import, no cycle, no use of another module's private names, a layer stated by every package, no
history words (ticket numbers, work periods), no module over 300 lines of code and no README over
250 lines; and the checker itself finds each kind of violation."""
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_architecture", ROOT / "scripts" / "check_architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _checker()


def test_the_package_keeps_its_layers():
    _imports, findings = check.analyse(ROOT)
    assert findings == []


def test_no_issue_numbers_or_session_words():
    assert check.history_words(ROOT) == []


def test_every_module_has_a_layer():
    imports, _ = check.analyse(ROOT)
    assert len(imports) > 40
    for module in imports:
        check.layer_of(module)  # raises KeyError for a module no layer names


def _tree(tmp_path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


LAYERED = {
    "gradfuse/__init__.py": '"""top"""\nfrom gradfuse.monitor import m\n',
    "gradfuse/ops/__init__.py": '"""ops.\n\nLayer: ops.\n"""\n',
    "gradfuse/core/__init__.py": '"""core.\n\nLayer: core.\n"""\n',
    "gradfuse/core/engine.py": "from gradfuse import ops\n\ndef _helper():\n    pass\n\ndef run():\n    _helper()\n",
    "gradfuse/clip/__init__.py": '"""clip.\n\nLayer: clip.\n"""\n',
    "gradfuse/clip/norm.py": "from gradfuse.core import engine\n",
    "gradfuse/numerics/__init__.py": '"""numerics.\n\nLayer: numerics.\n"""\n',
    "gradfuse/monitor/__init__.py": '"""monitor.\n\nLayer: monitor.\n"""\nfrom gradfuse.clip import norm\nm = 1\n',
}


def test_a_clean_tree_passes(tmp_path):
    root = _tree(tmp_path, LAYERED)
    assert check.analyse(root)[1] == []


@pytest.mark.parametrize("rel, text, expected", [
    # the core importing a capability (a function-level import counts)
    ("gradfuse/core/engine.py", "def f():\n    from gradfuse.clip import norm\n",
     "imports gradfuse.clip.norm (capabilities)"),
    # capabilities side by side do not import each other
    ("gradfuse/numerics/hist.py", "from gradfuse.clip import norm\n", "imports gradfuse.clip.norm"),
    # another module's private name, imported or read through the module
    ("gradfuse/clip/per.py", "from gradfuse.core.engine import _helper\n", "private name _helper"),
    ("gradfuse/clip/per.py", "from gradfuse.core import engine\nengine._helper()\n", "private name _helper"),
    # only the ops layer loads the compiled module
    ("gradfuse/core/load.py", "from gradfuse import _C\n", "imports the compiled module"),
    # a package that does not say its layer
    ("gradfuse/viz/__init__.py", '"""pictures"""\n', "says no 'Layer:'"),
])
def test_each_violation_is_found(tmp_path, rel, text, expected):
    root = _tree(tmp_path, {**LAYERED, rel: text})
    findings = check.analyse(root)[1]
    assert any(expected in f for f in findings), findings


def test_a_cycle_is_found(tmp_path):
    root = _tree(tmp_path, {**LAYERED, "gradfuse/core/a.py": "from gradfuse.core import b\n",
                            "gradfuse/core/b.py": "def f():\n    from gradfuse.core import a\n"})
    findings = check.analyse(root)[1]
    assert "import cycle: gradfuse.core.a -> gradfuse.core.b -> gradfuse.core.a" in findings


def test_history_words_are_found(tmp_path):
    # The planted words are spelled in two pieces so that this file itself stays clean.
    root = _tree(tmp_path, {**LAYERED, "README.md": "# x\nAdded in iss" + "ue 17.\n",
                            "tests/test_x.py": "# measured last sess" + "ion\n",
                            "docs/a.md": "uses a requests.Session() object\n"})
    found = check.history_words(root)
    assert [f.split(":")[0] for f in found] == ["README.md", "tests/test_x.py"]


def test_history_words_are_found_wherever_a_contributor_reads(tmp_path):
    # Planted words spelled in two pieces, as above. Each file below but the last four is a finding.
    iss, sess = "iss" + "ue 18", "sess" + "ion"
    root = _tree(tmp_path, {**LAYERED,
                            "benchmarks/bench.py": f'"""Timed for {iss}."""\n',
                            "benchmarks/kernel_ab/run.sh": f"# default: the kernel of {sess} 5\n",
                            "benchmarks/RESULTS.md": f"Measured in the last {sess}.\n",
                            "scripts/tool.py": f"# see {iss}\n",
                            ".ci/run": f"# added for {iss}\n",
                            "requirements-dev.txt": f"# {iss}: the references\ntimm\n",
                            "CONTRIBUTING.md": f"Since {sess} 4 the docs build strictly.\n",
                            "docs/page.md": f"Fixed in {iss}.\n",
                            # not findings: pytest's fixture scope, tool caches, the changelog
                            "benchmarks/conftest.py": f'@pytest.fixture(scope="{sess}")\ndef f():\n    pass\n',
                            "tests/conftest.py": f"@pytest.fixture(scope='{sess}')\ndef g():\n    pass\n",
                            "benchmarks/.benchmarks/run.json": f'{{"note": "{iss}"}}\n',
                            "CHANGELOG.md": f"- the fix of {iss}\n"})
    found = sorted(f.split(":")[0] for f in check.history_words(root))
    assert found == sorted([".ci/run", "CONTRIBUTING.md", "benchmarks/RESULTS.md", "benchmarks/bench.py",
                            "benchmarks/kernel_ab/run.sh", "docs/page.md", "requirements-dev.txt",
                            "scripts/tool.py"])


def test_no_module_is_too_long_and_the_readme_is_short():
    assert check.oversized(ROOT) == []
    counts = [check.code_lines(path.read_text()) for path in check.modules(ROOT).values()]
    assert len(counts) > 40 and max(counts) > 200  # the modules were measured, not skipped
    assert 100 < len((ROOT / "README.md").read_text().splitlines()) <= check.MAX_README_LINES


# Seven lines of code (the class, the method and its return, the function, its two-line string and
# its return) among docstrings of every kind, comment lines and blank lines, which do not count.
PADDED_MODULE = '''\
"""The module's docstring,
over two lines."""
# a comment
#

{body}


class Thing:
    """One line."""

    # a comment inside the class
    def method(self):
        """Two
        lines."""
        return 1


def function():
    r"""A raw docstring,

    with a blank line inside."""
    text = """a string that is not a docstring
    counts on every line"""
    return text
'''


def _module_of(code_lines: int) -> str:
    body = "\n".join(f"x{i} = {i}  # a comment after code counts" for i in range(code_lines - 7))
    return PADDED_MODULE.format(body=body)


def test_code_lines_leaves_out_docstrings_comments_and_blank_lines():
    assert check.code_lines(_module_of(40)) == 40
    assert check.code_lines('def f(): """doc"""; return 1\n') == 1  # code beside a docstring counts
    assert check.code_lines('x = (1,\n     2)  # two lines of one statement\n') == 2


@pytest.mark.parametrize("code, too_long", [(300, False), (301, True)])
def test_a_module_over_the_limit_is_found_with_its_count(tmp_path, code, too_long):
    module = _module_of(code)
    assert len(module.splitlines()) > code + 15  # the padding is there, and does not count
    root = _tree(tmp_path, {**LAYERED, "gradfuse/core/big.py": module})
    assert check.analyse(root)[1] == []
    found = check.oversized(root)
    assert found == ([f"gradfuse/core/big.py: {code} lines of code, more than 300"] if too_long else [])


@pytest.mark.parametrize("lines, too_long", [(250, False), (251, True)])
def test_a_readme_over_the_limit_is_found(tmp_path, lines, too_long):
    root = _tree(tmp_path, {**LAYERED, "README.md": "# gradfuse\n" + "text\n" * (lines - 1)})
    assert check.oversized(root) == (["README.md: 251 lines, more than 250"] if too_long else [])


def test_the_command_line_reports_a_long_module(tmp_path, capsys):
    root = _tree(tmp_path, {**LAYERED, "gradfuse/monitor/big.py": _module_of(301)})
    assert check.main([str(root)]) == 1
    assert "too long: gradfuse/monitor/big.py: 301 lines of code" in capsys.readouterr().out
