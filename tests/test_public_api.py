"""The public API stays compatible with the released one (tests/public_api.json): no public name,
method or property removed, no parameter removed, moved or given another default, no new
required parameter. After a compatible addition, refresh the snapshot with
``python scripts/public_api.py --write``."""
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("public_api", ROOT / "scripts" / "public_api.py")
public_api = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = public_api
spec.loader.exec_module(public_api)


def test_public_api_is_compatible_with_the_snapshot():
    old = json.loads((ROOT / "tests" / "public_api.json").read_text())
    assert len(old["gradfuse"]) >= 30
    assert public_api.incompatibilities(old, public_api.snapshot()) == []


def test_the_check_finds_breaking_changes():
    def f(parameters, max_norm, norm_type=2.0, *, group=None):
        pass

    old = {"m": {"f": public_api._describe(f), "gone": {"kind": "function", "parameters": []}}}

    def renamed(parameters, limit, norm_type=2.0, *, group=None):
        pass

    def new_default(parameters, max_norm, norm_type=1.0, *, group=None, extra=None):
        pass

    def new_required(parameters, max_norm, extra, norm_type=2.0, *, group=None):
        pass

    for g, expected in ((renamed, "parameter 'max_norm' removed"),
                        (new_default, "default of 'norm_type' changed"),
                        (new_required, "new required parameter 'extra'")):
        problems = public_api.incompatibilities(old, {"m": {"f": public_api._describe(g)}})
        assert any(expected in p for p in problems), problems
        assert "m.gone: removed" in problems

    def compatible(parameters, max_norm, norm_type=2.0, *, group=None, histogram=False):
        pass

    assert public_api.incompatibilities(
        {"m": {"f": old["m"]["f"]}}, {"m": {"f": public_api._describe(compatible)}}) == []
