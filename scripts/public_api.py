#!/usr/bin/env python3
"""The public API as data, and whether a new version keeps it compatible.

A snapshot lists, for ``gradfuse.__all__`` and the public module paths (``gradfuse.sinks``,
``gradfuse.histogram``, ``gradfuse.headroom``, ``gradfuse.optim``, ``gradfuse.integrations.*``), every function's
parameters (name, kind, default) and every class's public methods and properties. Compatible
means: no name, method or property removed; every old parameter still there with the same kind,
position (for positional ones) and default; every new parameter optional.

Usage:
  python scripts/public_api.py --check    compare with tests/public_api.json (exit 1 if broken)
  python scripts/public_api.py --write    write tests/public_api.json from the code (after a
                                          compatible change, e.g. a new name or keyword)
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "public_api.json"
if str(ROOT) not in sys.path:  # the checkout's gradfuse, also when run as a script from anywhere
    sys.path.insert(0, str(ROOT))
MODULES = {"gradfuse": None, "gradfuse.sinks": None, "gradfuse.histogram": None,
           "gradfuse.headroom": None, "gradfuse.optim": None,
           "gradfuse.integrations.pytorch": ["Attachment", "attach", "StepGate"],
           "gradfuse.integrations.lightning": ["GradfuseCallback"],
           "gradfuse.integrations.transformers": ["GradfuseCallback", "attach"],
           "gradfuse.integrations.torchtitan": ["TorchtitanAttachment", "attach", "check_version"]}


def _signature(obj) -> list | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, "<required>" if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in sig.parameters.values()]


def _describe(obj) -> dict:
    if inspect.isclass(obj):
        members = {}
        for klass in reversed(obj.__mro__):
            if klass is object or not klass.__module__.startswith("gradfuse"):
                continue
            for name, value in vars(klass).items():
                if name.startswith("_") and name != "__init__":
                    continue
                if isinstance(value, property) or (isinstance(value, object) and not callable(value)
                                                   and name != "__init__"
                                                   and not isinstance(value, (staticmethod, classmethod))):
                    members[name] = {"kind": "attribute"}
                elif callable(value) or isinstance(value, (staticmethod, classmethod)):
                    members[name] = {"kind": "method", "parameters": _signature(getattr(obj, name))}
        return {"kind": "class", "members": dict(sorted(members.items()))}
    if callable(obj):
        return {"kind": "function", "parameters": _signature(obj)}
    return {"kind": "value"}


def snapshot() -> dict:
    out = {}
    for module_name, names in MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an integration whose framework is not installed
            continue
        names = names or [n for n in module.__all__ if n != "__version__"]
        out[module_name] = {name: _describe(getattr(module, name)) for name in sorted(names)}
    return out


def _params_compatible(where: str, old: list | None, new: list | None) -> list[str]:
    if old is None or new is None:
        return []
    problems = []
    new_by_name = {p[0]: (i, p) for i, p in enumerate(new)}
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    for i, (name, kind, default) in enumerate(old):
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(p[1] == kind for p in new):
                problems.append(f"{where}: *{name} removed")
            continue
        if name not in new_by_name:
            problems.append(f"{where}: parameter {name!r} removed")
            continue
        j, (_n, new_kind, new_default) = new_by_name[name]
        if kind in positional and (new_kind not in positional or j != i):
            problems.append(f"{where}: parameter {name!r} moved from position {i} ({kind}) to {j} ({new_kind})")
        if kind == "KEYWORD_ONLY" and new_kind not in ("KEYWORD_ONLY", "POSITIONAL_OR_KEYWORD"):
            problems.append(f"{where}: keyword {name!r} became {new_kind}")
        if default != new_default:
            problems.append(f"{where}: default of {name!r} changed from {default} to {new_default}")
    old_names = {p[0] for p in old}
    for name, kind, default in new:
        if name not in old_names and default == "<required>" and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            problems.append(f"{where}: new required parameter {name!r}")
    return problems


def incompatibilities(old: dict, new: dict) -> list[str]:
    problems = []
    for module, names in old.items():
        if module not in new:
            problems.append(f"{module}: module gone (or its framework not installed)")
            continue
        for name, desc in names.items():
            where = f"{module}.{name}"
            now = new[module].get(name)
            if now is None:
                problems.append(f"{where}: removed")
                continue
            if now["kind"] != desc["kind"]:
                problems.append(f"{where}: was a {desc['kind']}, is a {now['kind']}")
                continue
            if desc["kind"] == "function":
                problems += _params_compatible(where, desc["parameters"], now["parameters"])
            elif desc["kind"] == "class":
                for member, m in desc["members"].items():
                    n = now["members"].get(member)
                    if n is None:
                        problems.append(f"{where}.{member}: removed")
                    elif m["kind"] == "method" and n["kind"] == "method":
                        problems += _params_compatible(f"{where}.{member}", m["parameters"], n["parameters"])
    return problems


def main(argv: list[str]) -> int:
    current = snapshot()
    if argv == ["--write"]:
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
        return 0
    if argv != ["--check"]:
        print(__doc__)
        return 2
    problems = incompatibilities(json.loads(SNAPSHOT.read_text()), current)
    for p in problems:
        print(p)
    print(f"{len(problems)} incompatibilit{'y' if len(problems) == 1 else 'ies'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
