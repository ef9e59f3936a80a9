"""Every ```python example of README.md and docs/**/*.md runs, and prints what the page shows.

The rules a page follows (a reader pastes its examples in order into one interpreter):

- The ```python fences of one page run in order, in one namespace, in one fresh Python process
  (working directory: an empty temporary folder, so files an example writes land there), so a
  later fence may use the names an earlier one defined. Each fence has FENCE_TIMEOUT_S seconds.
- A fence preceded by ``<!-- example: skip reason="..." -->`` (only blank lines between) is not
  run: the test is skipped with that reason (for GPU-only or multi-process examples).
- A ```text (or ```output) fence right after a python fence (only blank lines between) is that
  fence's expected stdout. It must match exactly, after one normalisation: trailing whitespace of
  every line and trailing blank lines are dropped. Warnings go to stderr and are not compared.
- ``test_every_shown_example_is_run_or_marked`` checks, per page, that the examples run are the
  examples shown minus the marked ones.

Test ids are ``<page>:<line of the fence>``, so a failure names the file and line to fix.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import gradfuse

ROOT = Path(__file__).resolve().parent.parent
FENCE_TIMEOUT_S = 120

# A fenced block: its indentation, its info string's language, its body, its closing fence.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
SKIP_MARK = re.compile(r'<!--\s*example:\s*skip\s+reason="(?P<reason>[^"]*)"\s*-->\s*\Z')
OUTPUT_LANGS = ("text", "output")


@dataclass(frozen=True)
class Example:
    page: str                 # path relative to ROOT
    line: int                 # 1-based line of the opening fence
    code: str
    expected: str | None      # the following text/output fence, if any
    skip_reason: str | None   # from <!-- example: skip reason="..." -->

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    found = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    if (ROOT / "docs").is_dir():
        found += sorted((ROOT / "docs").rglob("*.md"))
    return found


def dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent):] if line.startswith(indent) else line
                   for line in body.splitlines(keepends=True))


def examples_of(path: Path) -> list[Example]:
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(ROOT).as_posix()
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group("lang") != "python":
            continue
        before = text[fences[i - 1].end() if i else 0:m.start()]
        skip = SKIP_MARK.search(before)
        expected = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            if nxt.group("lang") in OUTPUT_LANGS and not text[m.end():nxt.start()].strip():
                expected = dedent(nxt.group("body"), nxt.group("indent"))
        out.append(Example(page=page, line=text.count("\n", 0, m.start()) + 1,
                           code=dedent(m.group("body"), m.group("indent")), expected=expected,
                           skip_reason=skip.group("reason") if skip else None))
    return out


ALL_EXAMPLES = [e for p in pages() for e in examples_of(p)]

# Runs in the child: every fence of one page in order, in one namespace; stdout captured per fence.
RUNNER = r'''
import contextlib, io, json, signal, sys, time, traceback
fences, out_path, timeout = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])

class FenceTimeout(Exception):
    pass

def on_alarm(signum, frame):
    raise FenceTimeout(f"the example ran past {timeout} s")

signal.signal(signal.SIGALRM, on_alarm)
namespace = {"__name__": "__main__"}
results = {}
for fence in fences:
    buf, error, start = io.StringIO(), None, time.monotonic()
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(fence["code"], fence["name"], "exec"), namespace)
    except BaseException:
        error = traceback.format_exc()
    finally:
        signal.alarm(0)
    results[fence["name"]] = {"stdout": buf.getvalue(), "error": error,
                              "seconds": round(time.monotonic() - start, 2)}
    with open(out_path, "w") as f:   # after every fence: a crash still leaves the earlier ones
        json.dump(results, f)
'''


def normalise(output: str) -> str:
    """Trailing whitespace of each line and trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in output.rstrip().splitlines())


@functools.cache
def run_page(page: str) -> dict:
    """{example id: {"stdout", "error", "seconds"}} for the page's examples that are not marked."""
    to_run = [e for e in ALL_EXAMPLES if e.page == page and e.skip_reason is None]
    if not to_run:
        return {}
    work = Path(tempfile.mkdtemp(prefix="gradfuse-docs-"))
    try:
        spec = work / "fences.json"
        spec.write_text(json.dumps([{"name": e.id, "code": e.code} for e in to_run]))
        (work / "runner.py").write_text(RUNNER)
        cwd = work / "cwd"
        cwd.mkdir()
        env = dict(os.environ, MPLBACKEND="Agg", WANDB_MODE="disabled", PYTHONHASHSEED="0",
                   # the gradfuse these tests import (a checkout or an installed package)
                   PYTHONPATH=os.pathsep.join(
                       [str(Path(gradfuse.__file__).resolve().parent.parent)]
                       + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        done = subprocess.run([sys.executable, str(work / "runner.py"), str(spec),
                               str(work / "results.json"), str(FENCE_TIMEOUT_S)],
                              cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=FENCE_TIMEOUT_S * len(to_run) + 60)
        results = (json.loads((work / "results.json").read_text())
                   if (work / "results.json").exists() else {})
        if done.returncode != 0 or len(results) != len(to_run):
            results["__process__"] = {"returncode": done.returncode, "stderr": done.stderr[-4000:]}
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=lambda e: e.id)
def test_example_runs_and_prints_what_the_page_shows(example: Example):
    if example.skip_reason is not None:
        pytest.skip(f"{example.id}: {example.skip_reason}")
    results = run_page(example.page)
    result = results.get(example.id)
    if result is None:
        pytest.fail(f"{example.id}: not run; the page's process: {results.get('__process__')}")
    if result["error"]:
        pytest.fail(f"{example.id} raised:\n{result['error']}", pytrace=False)
    if example.expected is not None:
        assert normalise(result["stdout"]) == normalise(example.expected), (
            f"{example.id}: the output differs from the text block after the example")


@pytest.mark.parametrize("page", sorted({e.page for e in ALL_EXAMPLES}))
def test_every_shown_example_is_run_or_marked(page: str):
    shown = [e for e in ALL_EXAMPLES if e.page == page]
    marked = [e for e in shown if e.skip_reason is not None]
    ran = [k for k in run_page(page) if k != "__process__"]
    assert len(ran) == len(shown) - len(marked), (page, len(ran), len(shown), len(marked))
    assert sorted(ran) == sorted(e.id for e in shown if e.skip_reason is None)


def test_the_readme_shows_examples():
    assert any(e.page == "README.md" and e.skip_reason is None for e in ALL_EXAMPLES)


def test_fence_parser():
    text = ('intro\n```python\nprint(1)\n```\n\n```text\n1\n```\n'
            '<!-- example: skip reason="needs a GPU" -->\n```python\nx.cuda()\n```\n'
            '- item\n\n  ```python\n  print(2)\n  ```\n```bash\nls\n```\n')
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        path = Path(tmp) / "page.md"
        path.write_text(text)
        found = examples_of(path)
    assert [(e.line, e.code, e.expected, e.skip_reason) for e in found] == [
        (2, "print(1)\n", "1\n", None), (10, "x.cuda()\n", None, "needs a GPU"),
        (15, "print(2)\n", None, None)]
    assert normalise("a  \nb\n\n\n") == "a\nb"
