#!/usr/bin/env python3
"""Checks the package's layers, and the words of what a contributor reads, from the source alone.

No import of gradfuse. It checks that:

- every module belongs to a layer (LAYERS below) and imports only from its own layer or those
  below it; the capabilities side by side (clip, numerics, activations, dynamics) do not import
  each other; function-level imports count;
- there is no import cycle between modules;
- no module uses another module's private names: ``from m import _x``, ``m._x`` on an imported
  gradfuse module, or ``obj._x`` where ``_x`` is defined only in other gradfuse modules (a
  class's ``self._x`` is its own, or what its base class leaves to subclasses);
- every package's docstring says its layer (a line starting ``Layer:``);
- no file a contributor reads (the package, csrc/, tests/, docs/, benchmarks/, scripts/, .ci/,
  README.md, CONTRIBUTING.md, the requirement lists and the build and site configuration) speaks of
  issue numbers or work periods (the history belongs in git and CHANGELOG.md); pytest's
  ``scope="session"`` and names such as ``requests.Session()`` are not history;
- no module of the package has more than MAX_CODE_LINES lines of code (blank lines, comment lines
  and docstrings not counted: ``code_lines``), and README.md has at most MAX_README_LINES lines
  (detail belongs on the docs site).

Usage: python scripts/check_architecture.py [ROOT]   (exit status 1 with a list of findings)
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

# (layer, module prefix). A module takes the layer of its longest matching prefix. Modules of one
# capability group may import each other; across groups only downwards.
LAYERS = [
    (0, "gradfuse._C"), (0, "gradfuse._build_record"), (0, "gradfuse.ops"), (0, "gradfuse.utils"),
    (1, "gradfuse.core"),
    (2, "gradfuse.clip"), (2, "gradfuse.numerics"), (2, "gradfuse.activations"), (2, "gradfuse.dynamics"),
    (2, "gradfuse.optim"),
    (3, "gradfuse.functional"),
    (4, "gradfuse.monitor"),
    (5, "gradfuse.viz"),
    (6, "gradfuse.integrations"),
    # the top: the public names, the CLI, the demo, and the module paths kept for users
    (7, "gradfuse"), (7, "gradfuse.cli"), (7, "gradfuse.__main__"), (7, "gradfuse.demo"),
    (7, "gradfuse.sinks"), (7, "gradfuse.histogram"), (7, "gradfuse.headroom"),
]
LAYER_NAMES = {0: "ops", 1: "core", 2: "capabilities", 3: "functional", 4: "monitor", 5: "viz",
               6: "integrations", 7: "top"}
HISTORY_WORDS = re.compile(r"\bissue[ #-]*[0-9]+|\bsessions?\b|\bas before\b|\balways (?:were|was|had)\b",
                           re.IGNORECASE)
HISTORY_EXEMPT = re.compile(r"Session\(|_session|session_|scope=[\"']session[\"']")
# Where the history-word check looks: these folders (all their text files) and these top-level
# files (glob patterns). CHANGELOG.md is where the history goes, so it is not among them.
HISTORY_DIRS = ("gradfuse", "csrc", "tests", "docs", "benchmarks", "scripts", ".ci")
HISTORY_FILES = ("README.md", "CONTRIBUTING.md", "requirements*.txt", "setup.py", "pyproject.toml", "mkdocs.yml",
                 "MANIFEST.in", "CITATION.cff", ".pre-commit-config.yaml")
BINARY_SUFFIXES = (".png", ".jpg", ".svg", ".so", ".pyc", ".o", ".a")
# A module that outgrows this is doing two things; split it where a reader would. The README is
# what a newcomer reads first: detail goes to the docs site.
MAX_CODE_LINES = 300
MAX_README_LINES = 250
NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER)


def layer_of(module: str) -> tuple[int, str]:
    best = None
    for layer, prefix in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[1]):
                best = (layer, prefix)
    if best is None:
        raise KeyError(module)
    return best


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "gradfuse").rglob("*.py")):
        if path.name == "_build_record.py":
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def analyse(root: Path):
    mods = modules(root)
    imports: dict[str, set[str]] = {m: set() for m in mods}
    findings: list[str] = []
    defined: dict[str, set[str]] = {}
    trees = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        trees[name] = tree
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
        defined[name] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    for name, tree in trees.items():
        rel = mods[name].relative_to(root)
        is_package = mods[name].name == "__init__.py"
        aliases: dict[str, str] = {}  # local name -> gradfuse module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "gradfuse":
                        imports[name].add(a.name if a.name in mods else a.name.rsplit(".", 1)[0])
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "gradfuse"
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, is_package, node)
                if target.split(".")[0] != "gradfuse":
                    continue
                for a in node.names:
                    full = f"{target}.{a.name}"
                    if full in mods or full in ("gradfuse._C", "gradfuse._build_record"):
                        imports[name].add(full)
                        aliases[a.asname or a.name] = full
                    else:
                        imports[name].add(target)
                        if a.name.startswith("_") and not a.name.startswith("__") and target != name:
                            findings.append(f"{rel}:{node.lineno}: private name {a.name} of {target}")
        own = defined[name]
        others = set().union(*(d for m, d in defined.items() if m != name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = aliases[value.id]
                if target != name and node.attr != "_C":
                    findings.append(f"{rel}:{node.lineno}: private name {node.attr} of {target}")
                continue
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue  # a class's own members, or those its base class leaves to subclasses
            if node.attr in others and node.attr not in own:
                findings.append(f"{rel}:{node.lineno}: private attribute {node.attr}, defined in another "
                                "gradfuse module")
    for name, targets in imports.items():
        src_layer, src_group = layer_of(name)
        for target in targets:
            if target in ("gradfuse._C", "gradfuse._build_record"):
                if src_layer != 0:
                    findings.append(f"{mods[name].relative_to(root)}: imports the compiled module "
                                    f"{target}; only gradfuse.ops may")
                continue
            if target not in mods:
                continue
            dst_layer, dst_group = layer_of(target)
            if dst_layer > src_layer or (dst_layer == src_layer == 2 and dst_group != src_group):
                findings.append(f"{mods[name].relative_to(root)}: {name} ({LAYER_NAMES[src_layer]}) "
                                f"imports {target} ({LAYER_NAMES[dst_layer]})")
    findings += [f"import cycle: {' -> '.join(c)}" for c in cycles(imports)]
    for name, path in mods.items():
        if path.name == "__init__.py" and name != "gradfuse":
            doc = ast.get_docstring(trees[name]) or ""
            if not re.search(r"^Layer:", doc, re.M):
                findings.append(f"{path.relative_to(root)}: the package docstring says no 'Layer:'")
    return imports, findings


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def history_words(root: Path) -> list[str]:
    found = []
    paths = [p for pattern in HISTORY_FILES for p in sorted(root.glob(pattern))]
    for d in HISTORY_DIRS:
        for path in sorted((root / d).rglob("*")):
            inner = path.relative_to(root / d).parts
            # caches and tool output (__pycache__, .hypothesis, .benchmarks, ...) are no one's reading
            if "__pycache__" in inner or any(part.startswith(".") for part in inner):
                continue
            paths.append(path)
    for path in paths:
        if not path.is_file() or path.suffix in BINARY_SUFFIXES:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if HISTORY_WORDS.search(line) and not HISTORY_EXEMPT.search(line):
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()[:100]}")
    return found


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code: not blank, not only a comment, not part of a
    module's, class's or function's docstring. A line with code and a comment counts; so does
    every line of a string that is not a docstring."""
    docstrings = []  # (start, end) positions of each docstring
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                value = first.value
                docstrings.append(((value.lineno, value.col_offset), (value.end_lineno, value.end_col_offset)))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in NOT_CODE or any(start <= token.start < end for start, end in docstrings):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def oversized(root: Path) -> list[str]:
    """Every module of the package over MAX_CODE_LINES lines of code, and README.md over
    MAX_README_LINES lines, each with its count."""
    found = []
    for path in modules(root).values():
        n = code_lines(path.read_text())
        if n > MAX_CODE_LINES:
            found.append(f"{path.relative_to(root)}: {n} lines of code, more than {MAX_CODE_LINES}")
    readme = root / "README.md"
    if readme.is_file():
        n = len(readme.read_text().splitlines())
        if n > MAX_README_LINES:
            found.append(f"README.md: {n} lines, more than {MAX_README_LINES}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent)
    _imports, findings = analyse(root)
    findings += [f"too long: {f}" for f in oversized(root)]
    findings += [f"history word: {f}" for f in history_words(root)]
    for f in findings:
        print(f)
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
