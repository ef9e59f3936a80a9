#!/usr/bin/env python3
"""The supported-versions matrix, measured: for each (Python, torch) cell, a fresh venv with that
torch from the package index, a build of gradfuse._C from this checkout, and the test suite.

    python3 scripts/version_matrix.py                    # every cell in CELLS, then the table
    python3 scripts/version_matrix.py 3.12:2.11.0        # one cell (its row is replaced)
    python3 scripts/version_matrix.py --table-only       # rewrite the table from saved results

Venvs, source copies and logs live under --dir (default /work/matrix, outside the repo); the
table goes to docs/supported-versions.md. The CPU kernels are built in every cell; the CUDA
kernels where torch's CUDA major version equals the local nvcc's (elsewhere setup.py would refuse
the mismatch, so that cell builds with GRADFUSE_CUDA=0 and says so). Tests run with
GRADFUSE_REQUIRE_EXT=1, so a cell whose extension does not load fails instead of quietly testing
the pure-PyTorch reference. Without a GPU the CUDA kernels are compiled, not run.

Cost: a CUDA build of torch is 3-6 GB of downloads per venv (once; later runs reuse the venv).
Each cell then takes a build (about 1 min CPU-only, about 6 min with the CUDA kernels for four
architectures, on one core) and the test suite (several minutes). Use MAX_JOBS=1 and `nice` on a
shared machine.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "supported-versions.md"
MIN_TORCH = (2, 6)  # setup.py's floor
# (python, torch): the oldest torch claimed, a middle release, the GPU machines' release, the
# newest this project pins; Python 3.10-3.12 spread over them.
CELLS = ["3.10:2.6.0", "3.11:2.8.0", "3.12:2.11.0", "3.11:2.14.1"]
# Measured once and kept in the table to show why setup.py's floor is torch 2.6; below the floor
# a rerun only sees setup.py refuse it.
BELOW_FLOOR = ["3.10:2.4.1"]
# What the test suite imports besides torch (requirements-dev.txt less its torch pin).
TEST_REQUIREMENTS = [line.strip() for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
                     if line.strip() and not line.startswith("#") and not line.startswith("torch")]


def log(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def find_python(version: str) -> str | None:
    """An interpreter for `version` ("3.10"): on PATH, else under pyenv's versions folder (pyenv's
    shims answer only for the versions made global)."""
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True)
    for exe in filter(None, candidates):
        ok = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True)
        if ok.returncode == 0 and ok.stdout.strip() == version:
            return exe
    return None


def nvcc_major() -> int | None:
    nvcc = shutil.which("nvcc") or (os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/bin/nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def run_logged(cmd, log_path: Path, env=None, cwd=None) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        rc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    return rc, time.monotonic() - t0


def copy_tracked_tree(dest: Path) -> None:
    """The checkout's tracked and new (not ignored) files, as a fresh clone would have them. An
    earlier copy keeps its build outputs (ignored files): sources copied with their timestamps
    leave ninja nothing to redo when they did not change."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    files = {rel for rel in files if rel and (ROOT / rel).is_file()}
    if dest.exists():
        stale = [p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()]
        stale = [rel for rel in stale if rel not in files]
        ignored = set(subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(stale),
                                     capture_output=True, text=True).stdout.split("\n"))
        for rel in stale:
            if rel not in ignored:
                (dest / rel).unlink()  # deleted or renamed in the checkout since
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def test_counts(junit: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if not junit.exists():
        return counts
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def git_commit() -> str:
    """The commit a row measures: the checkout's HEAD (the cell copies its working tree), and
    when that tree has uncommitted changes, "+dirty." and the first 8 hex digits of the sha1 of
    `git diff HEAD` (so two dirty rows of one commit can be told apart)."""
    head = git("rev-parse", "--short=10", "HEAD") or "?"
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ROOT, capture_output=True).stdout
    untracked = git("ls-files", "--others", "--exclude-standard")
    if diff or untracked:
        digest = hashlib.sha1(diff + untracked.encode()).hexdigest()[:8]
        return f"{head}+dirty.{digest}"
    return head


def provenance(results: list[dict]) -> str:
    """Which code the rows measured, written with the table: each distinct commit with its date and
    subject, and how far behind the checkout that writes the table it is."""
    head = git("rev-parse", "HEAD")
    lines = []
    for commit in dict.fromkeys(r.get("commit", "?") for r in results):
        base = commit.split("+")[0].removesuffix("-dirty")
        cells = ", ".join(f"{r['python']}/{r['torch']}" for r in results if r.get("commit") == commit)
        full = git("rev-parse", "--verify", "--quiet", base + "^{commit}")
        if not full:
            lines.append(f"- `{commit}` ({cells}): not in this checkout's history")
            continue
        when, subject = git("show", "-s", "--format=%cs%x00%s", full).split("\0", 1)
        is_ancestor = bool(head) and subprocess.run(
            ["git", "merge-base", "--is-ancestor", full, head], cwd=ROOT).returncode == 0
        if full == head:
            state = "the checkout's HEAD"
        elif is_ancestor:
            state = f"{git('rev-list', '--count', f'{full}..{head}')} commit(s) behind it"
        else:
            state = "not an ancestor of it"
        dirty = ((", with uncommitted changes" + (" (sha1 of the diff after `dirty.`)" if "dirty." in commit
                                                   else "")) if "dirty" in commit else "")
        lines.append(f"- `{commit}` ({cells}): {when}, \"{subject}\"; {state}{dirty}")
    return (f"Rows measured these commits (the table written at `{head[:10] or '?'}`); a row "
            "describes the code of its commit, not newer code:\n\n" + "\n".join(lines))


def machine() -> str:
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("nvidia-smi") else ""
    return (f"{platform.machine()}, {os.cpu_count()} cores, nvcc {nvcc_major()}.x, "
            f"{gpu.splitlines()[0] if gpu else 'no GPU'}")


def run_cell(cell: str, base: Path, pytest_args: list[str], install_only: bool) -> dict | None:
    py_version, torch_version = cell.split(":")
    name = f"py{py_version}-torch{torch_version}"
    started = time.monotonic()
    logs = base / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    result = {"cell": cell, "python": py_version, "torch": torch_version, "name": name,
              "date": datetime.date.today().isoformat(), "commit": git_commit()}
    exe = find_python(py_version)
    if exe is None:
        log(f"{name}: no Python {py_version} here, skipped")
        return None
    venv = base / "venvs" / name
    vpy = venv / "bin" / "python"
    have = subprocess.run([vpy, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True) if vpy.exists() else None
    if have is None or have.returncode != 0 or have.stdout.strip().split("+")[0] != torch_version:
        log(f"{name}: creating the venv and installing torch {torch_version} (large download)")
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([exe, "-m", "venv", venv], check=True)
    # Every run (a no-op when nothing changed): requirements-dev.txt may have moved on.
    constraint = logs / "constraint.txt"
    constraint.write_text(f"torch=={torch_version}\n")
    rc, secs = run_logged([vpy, "-m", "pip", "install", "--disable-pip-version-check", "-c", constraint,
                           f"torch=={torch_version}", *TEST_REQUIREMENTS], logs / "install.log")
    result["install_s"] = round(secs)
    if rc != 0:
        log(f"{name}: install failed, see {logs / 'install.log'}")
        result["status"] = "install failed"
        return result
    if install_only:
        log(f"{name}: venv ready")
        return None
    info = json.loads(subprocess.run(
        [vpy, "-c", "import json, sys, torch; print(json.dumps({'torch': torch.__version__, "
                    "'cuda': torch.version.cuda, 'python': sys.version.split()[0]}))"],
        capture_output=True, text=True, check=True).stdout)
    result.update(torch_full=info["torch"], torch_cuda=info["cuda"], python_full=info["python"])
    local_major = nvcc_major()
    with_cuda = info["cuda"] is not None and local_major == int(info["cuda"].split(".")[0])
    result["kernels"] = "CPU + CUDA" if with_cuda else "CPU"
    if not with_cuda:
        result["why_no_cuda"] = ("CPU build of torch" if info["cuda"] is None
                                 else f"torch is CUDA {info['cuda']}, nvcc here is CUDA {local_major}")

    src = base / "src" / name
    copy_tracked_tree(src)
    # The same build command as benchmarks/gpu_check.sh (which adds ptxas' register report).
    env = dict(os.environ, GRADFUSE_CUDA="1" if with_cuda else "0", GRADFUSE_PTXAS_VERBOSE="1",
               MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    log(f"{name}: building ({result['kernels']})")
    rc, secs = run_logged([vpy, "setup.py", "build_ext", "--inplace"], logs / "build.log", env=env, cwd=src)
    result["build_s"] = round(secs)
    if rc != 0:
        log(f"{name}: build failed, see {logs / 'build.log'}")
        result["status"] = "build failed"
        return result

    log(f"{name}: testing")
    junit = logs / "junit.xml"
    env = dict(os.environ, GRADFUSE_REQUIRE_EXT="1")
    rc, secs = run_logged([vpy, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           f"--junitxml={junit}", *pytest_args], logs / "test.log", env=env, cwd=src)
    result.update(test_s=round(secs), pytest_rc=rc, **test_counts(junit))
    result["cell_min"] = round((time.monotonic() - started) / 60, 1)
    result["status"] = "ok" if rc == 0 else ("tests failed" if result["failed"] else f"pytest exit {rc}")
    log(f"{name}: {result['status']}: {result['passed']} passed, {result['failed']} failed, "
        f"{result['skipped']} skipped in {result['test_s']} s")
    return result


# What the table's page says of the optional training frameworks (not measured by the cells).
FRAMEWORKS = (
    "## Training frameworks\n\n"
    "The optional integrations are tested against the versions `bash scripts/setup.sh test` installs;\n"
    "the matrix cells above install requirements-dev.txt only, so there the DeepSpeed tests skip.\n\n"
    "| framework | tested | accepted | tests |\n"
    "|---|---|---|---|\n"
    "| DeepSpeed (ZeRO 0-3, `gradfuse.attach(engine)`) | 0.19.8, on torch 2.14.1, CPU, 2 gloo processes; "
    "with transformers 5.25.0 and accelerate 1.16.0 for the Trainer | `>=0.19,<0.20` "
    "(`gradfuse.integrations.deepspeed.TESTED_VERSIONS`); any other version is refused, as gradfuse reads "
    "DeepSpeed's gradient fragments through accessors that move between releases | "
    "tests/integrations/test_deepspeed.py, test_transformers_deepspeed.py |\n")


def write_table(base: Path, pytest_args: list[str]) -> None:
    results = []
    for path in sorted((base / "results").glob("py*.json")):
        results.append(json.loads(path.read_text()))
    order = {cell: i for i, cell in enumerate(BELOW_FLOOR + CELLS)}
    results.sort(key=lambda r: (order.get(r["cell"], len(order)), r["cell"]))
    rows = ["| Python | torch | torch's CUDA | kernels built | build | tests (passed / failed / skipped) | test time "
            "| measured |",
            "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        tests = (f"{r['passed']} / {r['failed']} / {r['skipped']}" if "passed" in r else "not run")
        status = "" if r.get("status") == "ok" else f" **{r.get('status')}**"
        rows.append(f"| {r.get('python_full', r['python'])} | {r.get('torch_full', r['torch'])} | "
                    f"{r.get('torch_cuda') or 'none'} | {r.get('kernels', '?')} | "
                    f"{r.get('build_s', '-')} s | {tests}{status} | {r.get('test_s', '-')} s | "
                    f"{r.get('date', '?')}, {r.get('commit', '?')} |")
        if r.get("why_no_cuda"):
            notes.append(f"- {r['name']}: CUDA kernels not built: {r['why_no_cuda']}.")
        for failure in r.get("failures", []):
            notes.append(f"- {r['name']}: failed `{failure}`")
    here = machine()
    no_gpu = ("There is no GPU on this machine: CUDA kernels are compiled (for the default "
              "architectures), not run, and the CUDA tests skip. ") if here.endswith("no GPU") else ""
    text = f"""# Supported versions, measured

Written by `python3 scripts/version_matrix.py` on {here}. The last run of each cell took
{' + '.join(str(r.get('cell_min', '?')) for r in results)} min (MAX_JOBS=1 under `nice`, on a
machine shared with other work; a rerun reuses the venv and the build). A first run costs far
more: on 2026-12-02 here, 3-6 GB of torch and CUDA wheels per venv (2-6 min each), CPU-only
builds of 6-15 min, CUDA builds (four architectures) of 14-36 min and test suites of 1.5-10 min
per cell: about 2 h in all. Rows below torch {'.'.join(map(str, MIN_TORCH))} were measured before
setup.py's floor was raised to it, and show why.

Each row: a fresh venv with that torch from the package index (the default Linux wheel, a CUDA
build), gradfuse._C built from this checkout with `setup.py build_ext --inplace`, and
`{' '.join(['pytest tests', *pytest_args])}` with `GRADFUSE_REQUIRE_EXT=1` (a build that does not load
fails the row instead of falling back to the pure-PyTorch reference). {no_gpu}The CPU kernels
are built and tested in every row; the CUDA kernels are built where torch's CUDA major version is
the local nvcc's (setup.py refuses a mismatch).

{chr(10).join(rows)}

{provenance(results)}

{chr(10).join(notes)}

{FRAMEWORKS}"""
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(text)
    log(f"wrote {TABLE}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", nargs="*", help="python:torch, e.g. 3.12:2.11.0 (default: all of CELLS)")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("GRADFUSE_MATRIX_DIR", "/work/matrix")))
    parser.add_argument("--install-only", action="store_true", help="create the venvs, build and test nothing")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from saved results")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '-m \"not slow\"'")
    args = parser.parse_args()
    pytest_args = args.pytest_args.split()
    (args.dir / "results").mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for cell in args.cells or CELLS:
            result = run_cell(cell, args.dir, pytest_args, args.install_only)
            if result is not None:
                (args.dir / "results" / f"{result['name']}.json").write_text(json.dumps(result, indent=1))
        if args.install_only:
            return 0
    write_table(args.dir, pytest_args)
    failed = [json.loads(p.read_text()) for p in (args.dir / "results").glob("py*.json")]
    return 0 if all(r.get("status") == "ok" for r in failed) else 1


if __name__ == "__main__":
    sys.exit(main())
