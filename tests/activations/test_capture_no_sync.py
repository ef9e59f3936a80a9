"""capture_activations and host reads, checked on the CPU under the guard of tests/sync_guard.py.

On the CPU the capture reads small CPU values in its hooks on purpose (reading a CPU tensor is no
device sync): the dead-unit shortcuts and the trace mode's plain sums (see the module docstrings
of gradfuse.activations.capture and gradfuse.activations.dead_units). Those reads are counted here.
What it promises for an accelerator, "nothing is read in a hook", is checked by running the same
capture with every tensor answering ``is_cpu`` False: ``Tensor.is_cpu`` is the only thing the
capture asks to choose between the CPU shortcuts and the device path (``t.is_cpu`` /
``counts.is_cpu`` in ``ActivationCapture._rows`` and ``dead_units.unit_activity_rows``), so the hooks
then take the path an accelerator takes, on CPU tensors, and must read nothing; also with
``histogram=True``, whose exponent histograms are taken in the same hooks."""
import pytest
import torch
from sync_guard import SyncGuard, as_on_an_accelerator
from torch import nn

import gradfuse

CPU_READS = {"Tensor.tolist", "aten._local_scalar_dense.default"}


def model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
    with torch.no_grad():
        model[2].bias[:4] = -1e3  # four dead units after the second ReLU
    return model, torch.randn(7, 6)


def capture(model, x, **kwargs):
    with gradfuse.capture_activations(model, **kwargs) as cap:
        model(x).square().sum().backward()
    return cap


@pytest.mark.parametrize("kwargs", [{}, dict(trace_nonfinite=True), dict(histogram=True)],
                         ids=["default", "trace_nonfinite", "histogram"])
def test_on_the_cpu_the_hooks_read_only_small_cpu_values(kwargs):
    model, x = model_and_input()
    capture(model, x, **kwargs)  # warm-up
    with SyncGuard(allowed=None) as guard:
        capture(model, x, **kwargs)
    assert guard.saw_gradfuse_op()
    assert guard.reads and set(guard.reads) <= CPU_READS  # the documented CPU shortcuts, and nothing else


@pytest.mark.parametrize("kwargs", [{}, dict(trace_nonfinite=True), dict(histogram=True)],
                         ids=["default", "trace_nonfinite", "histogram"])
def test_the_accelerator_path_reads_nothing_in_hooks_and_gives_the_same_rows(kwargs):
    model, x = model_and_input()
    on_cpu = capture(model, x, **kwargs)
    with as_on_an_accelerator():
        assert not torch.ones(1).is_cpu
        capture(model, x, **kwargs)  # warm-up
        with SyncGuard() as guard:
            cap = capture(model, x, **kwargs)
    assert torch.ones(1).is_cpu
    assert guard.saw_gradfuse_op()
    for side in ("forward", "backward"):
        got, want = getattr(cap, side).to_dict()["params"], getattr(on_cpu, side).to_dict()["params"]
        assert list(got) == list(want)
        for name in want:
            for key in ("l2", "dead_units", "units", "zero_count", "nan_count"):
                assert got[name][key] == pytest.approx(want[name][key]), (side, name, key)
    assert cap.forward.to_dict()["params"]["3"]["dead_units"] == 4
    if kwargs.get("histogram"):  # the exponent histograms, taken in the hooks on the device path too
        assert "gradfuse.multi_tensor_exponent_histogram" in guard.seen
        for side in ("forward", "backward"):
            got, want = getattr(cap, side).exponent_histogram, getattr(on_cpu, side).exponent_histogram
            assert torch.equal(got, want) and got.sum() > 0
