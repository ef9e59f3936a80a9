"""Every compiled op of gradfuse through torch.library.opcheck.

It checks the schema (mutations declared as the kernels do them), the fake kernels of
gradfuse/ops/fake.py against the real outputs (shapes, dtypes, devices), the autograd registration
and the AOT-dispatch path, for each dtype the ops take, over odd sizes, empty tensors and non-finite
values. (An empty list has no tensor to dispatch on: the wrappers in gradfuse.ops answer it without
calling the op.)"""
import math

import pytest
import torch

from gradfuse.ops import library
from gradfuse.optim.table import adam_row, sgd_row

pytestmark = pytest.mark.skipif(library.extension is None, reason="gradfuse._C not built")

OPS = ["multi_tensor_stats", "multi_tensor_moments", "multi_tensor_scale_", "multi_tensor_unit_stats",
       "multi_tensor_unit_scale_",
       "multi_tensor_clamp_", "multi_tensor_exponent_histogram", "multi_tensor_update_stats",
       "multi_tensor_update_clip_", "multi_tensor_optim_step_"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# (rows, cols) of each tensor of a case; the unit ops cut tensor i into `rows` units.
CASES = {
    "odd_sizes": [(5, 3), (1, 1), (13, 7), (0, 3), (130, 3)],
    "one_empty": [(0, 5)],
    "one_element": [(1, 1)],
    "non_finite": [(4, 3), (9, 1)],
    "nan": [(6, 2), (3, 5)],
}
# opcheck compares the op's outputs under each check with torch.testing.assert_close, which calls
# NaN != NaN: a NaN in a float output (or in a tensor written in place) reads as a mismatch. NaN
# goes to the histogram only, whose output is counts; the other ops see +-inf, zeros and -0.0.
NAN_OPS = {"multi_tensor_exponent_histogram"}
# The moments of a tensor with an Inf are NaN: that op sees finite values only.
FINITE_ONLY_OPS = {"multi_tensor_moments"}


def tensors_for(case, dtype, device):
    g = torch.Generator().manual_seed(len(case))
    tensors = [(torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype).to(device) for shape in CASES[case]]
    if case == "non_finite":
        tensors[0][0, 0], tensors[0][1, 2], tensors[1][4, 0] = -0.0, math.inf, -math.inf
        tensors[1][5, 0] = 0.0
    if case == "nan":
        tensors[0][0, 0], tensors[0][5, 1], tensors[1][2, 4] = math.nan, math.inf, math.nan
    return tensors


def op_args(name, tensors, device):
    """The arguments of one call of op `name` on `tensors` (mutated tensors cloned per call)."""
    units = [t.shape[0] for t in tensors]
    clones = [t.clone() for t in tensors]
    if name == "multi_tensor_stats":
        return [(tensors, 2.0), (tensors, 1.0), (tensors, math.inf), (tensors, 3.5)]
    if name == "multi_tensor_scale_":
        return [(clones, torch.tensor(0.5, device=device), True),
                ([t.clone() for t in tensors], torch.tensor(2.0, device=device), False),
                ([t.clone() for t in tensors], torch.tensor(1.5, device=device), True)]
    if name == "multi_tensor_unit_stats":
        return [(tensors, units, 2.0), (tensors, units, math.inf)]
    if name == "multi_tensor_unit_scale_":
        coefs = torch.linspace(0.25, 1.75, sum(units), device=device)
        return [(clones, units, coefs, True), ([t.clone() for t in tensors], units, coefs.double(), False)]
    if name == "multi_tensor_clamp_":
        return [(clones, 0.5), ([t.clone() for t in tensors], 0.0)]
    if name in ("multi_tensor_exponent_histogram", "multi_tensor_moments"):
        return [(tensors,)]
    if name in ("multi_tensor_update_stats", "multi_tensor_update_clip_"):
        return update_op_args(name, tensors, device)
    if name == "multi_tensor_optim_step_":
        return step_op_args(tensors, device)
    raise AssertionError(name)


def step_op_args(tensors, device):
    """Calls of the fused optimizer step (weights, state and flags as the optimizers pass them),
    with `tensors` as the weights or the gradients; an infinite value only where the step stays
    free of NaN (plain SGD)."""
    g = torch.Generator().manual_seed(len(tensors))
    like = [(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.5).to(t.dtype).to(device) for t in tensors]
    pos = [x.abs() * 0.1 for x in like]
    absent = [t.new_empty(0) for t in tensors]
    n = len(tensors)
    finite = all(bool(t.isfinite().all()) for t in tensors)

    def table(row):
        return torch.tensor([row] * n, dtype=torch.float64, device=device).reshape(n, len(row))

    adam = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False, amsgrad=True)
    adamw = table(adam_row(adam, 3.0, True))
    sgd = table(sgd_row(dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=True,
                             maximize=False), False))
    plain = table(sgd_row(dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                               maximize=False), False))
    half = torch.tensor(0.5, device=device)
    coefs = torch.linspace(0.25, 1.5, n, dtype=torch.float64, device=device)
    threads = 2 if torch.device(device).type == "cpu" else 0  # torch's scalar tails: its CPU kernels' only
    return [([x.clone() for x in like], like, [x.clone() for x in like], [x.clone() for x in pos],
             [x * 2 for x in pos], adamw, 1, threads, half, None, coefs, True, True),
            ([x.clone() for x in like], like, [x.clone() for x in like], [x.clone() for x in pos],
             [x * 2 for x in pos], adamw, 1, 0, None, torch.tensor(True, device=device), None, True, True),
            ([t.clone() for t in tensors] if not finite else [x.clone() for x in like], like,
             absent if not finite else [x.clone() for x in like], absent, absent, plain if not finite else sgd, 0,
             threads, None, None, None, False, True)]


def update_op_args(name, tensors, device):
    """Calls of the optimizer-update ops, with `tensors` as the weights or the gradients and the
    state drawn alike (second moments >= 0), some of it absent (empty). An infinite weight or
    gradient goes only where the update stays free of NaN (which opcheck would read as a mismatch):
    plain SGD, AdamW's decay not applied to it."""
    g = torch.Generator().manual_seed(len(tensors))
    like = [(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.5).to(t.dtype).to(device) for t in tensors]
    pos = [x.abs() * 0.1 for x in like]
    absent = [t.new_empty(0) for t in tensors]
    n = len(tensors)
    finite = all(bool(t.isfinite().all()) for t in tensors)

    def hyper(rows):
        return torch.tensor([rows[i % len(rows)] for i in range(n)], dtype=torch.float64, device=device).reshape(n, 7)

    adamw = hyper([[1e-3, 1e-2, 0.9, 0.999, 1e-8, 3.0, 4.0], [1e-3, 1e-2, 0.9, 0.999, 1e-8, 3.0, 12.0]])
    adam = hyper([[1e-3, 0.0, 0.9, 0.999, 1e-8, 3.0, 4.0]])
    sgd = hyper([[0.1, 1e-2, 0.9, 0.1, 0.0, 0.0, 0.0], [0.1, 1e-2, 0.9, 0.0, 0.0, 0.0, 2.0]])
    plain_sgd = hyper([[0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    if name == "multi_tensor_update_stats":
        return [(like, like, [x.clone() for x in like], pos, [x * 2 for x in pos], adamw, 1),
                (tensors, like, absent, absent, absent, adamw if finite else plain_sgd, 1 if finite else 0),
                (like, tensors, [x.clone() for x in like], absent, absent, sgd, 0)]
    coefs = torch.linspace(0.25, 1.5, n, dtype=torch.float64, device=device)
    return [([t.clone() for t in tensors], like, [x.clone() for x in like], pos, [x * 2 for x in pos],
             adamw if finite else adam, coefs, 1),
            ([x.clone() for x in like], like, like, absent, absent, sgd, coefs, 0)]


def test_every_op_of_the_library_is_checked():
    # A new op in csrc/gradfuse.cpp must be added to OPS above.
    registered = {name for name in dir(torch.ops.gradfuse) if name.startswith("multi_tensor")}
    assert registered == set(OPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name, case", [(n, c) for n in OPS for c in CASES
                                         if (c != "nan" or n in NAN_OPS)
                                         and (c != "non_finite" or n not in FINITE_ONLY_OPS)])
def test_opcheck(name, case, dtype, device):
    op = getattr(torch.ops.gradfuse, name)
    tensors = tensors_for(case, dtype, device)
    for args in op_args(name, tensors, device):
        torch.library.opcheck(op, args)


def test_opcheck_finds_a_wrong_fake_kernel():
    # The control: the same op behind a fake kernel with one bin too few fails opcheck.
    lib = torch.library.Library("gradfuse_opcheck_control", "DEF")
    try:
        lib.define("hist(Tensor[] tensors) -> Tensor")
        lib.impl("hist", lambda tensors: torch.ops.gradfuse.multi_tensor_exponent_histogram(tensors), "CPU")
        real = torch.ops.gradfuse.multi_tensor_exponent_histogram([torch.ones(5)])
        torch.library.register_fake("gradfuse_opcheck_control::hist", lib=lib)(
            lambda tensors: tensors[0].new_empty((len(tensors), real.shape[1] - 1), dtype=torch.int64))
        with pytest.raises(Exception, match="Shapes"):
            torch.library.opcheck(torch.ops.gradfuse_opcheck_control.hist, ([torch.ones(5)],))
    finally:
        lib._destroy()
