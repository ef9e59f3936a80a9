"""The update ops' backends for the dynamics tests: the compiled CPU kernels (where the build has
them) and the float64 reference."""
import pytest

from gradfuse import ops


def update_backends():
    have = all(ops.library.OP_KERNELS.get((name, "cpu"), False)
               for name in ("multi_tensor_update_stats", "multi_tensor_update_clip_"))
    return ["compiled", "reference"] if have else ["reference"]


@pytest.fixture(params=update_backends())
def backend(request, monkeypatch):
    """Runs the test once per backend of the update ops (``"compiled"`` / ``"reference"``)."""
    if request.param == "reference":
        monkeypatch.setattr(ops, "op_compiled", lambda name, device: False)
    return request.param
