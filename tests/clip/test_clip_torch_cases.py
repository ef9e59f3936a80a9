"""PyTorch's own clip tests (test/test_nn.py: test_clip_grad_norm,
test_clip_grad_norm_error_if_nonfinite) with every call sent to gradfuse and the assertions kept,
plus torch run live on the same inputs; -inf added to torch's list of orders."""
import itertools
import math

import pytest
import torch
from torch import nn

import gradfuse

inf, nan = math.inf, math.nan


@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2, 4, "inf", -1, "-inf"])
def test_clip_grad_norm(norm_type):
    layer = nn.Linear(10, 10)
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            reduce = max if norm_type > 0 else min
            return reduce(p.grad.abs().max() if norm_type > 0 else p.grad.abs().min()
                          for p in layer.parameters())
        total = 0
        for p in layer.parameters():
            total += p.grad.abs().pow(norm_type).sum()
        return pow(total, 1.0 / norm_type)

    def compare_scaling(grads):
        scale = torch.cat([p.grad.div(g).view(-1) for p, g in zip(layer.parameters(), grads)])
        torch.testing.assert_close(scale.std(), torch.tensor(0.0))
        return scale[0]

    def set_grads(grads):
        for p, g in zip(layer.parameters(), grads):
            p.grad = g.clone().view_as(p)

    def torch_result(grads):
        twin = nn.Linear(10, 10)
        for p, g in zip(twin.parameters(), grads):
            p.grad = g.clone().view_as(p)
        return nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type=norm_type), twin

    grads = torch.arange(1.0, 101).view(10, 10), torch.ones(10).div(1000)
    if float(norm_type) < 0:  # a negative order's norm is below the smallest |x|: scale it up
        grads = grads[0] * 100, grads[1] * 1e5
    set_grads(grads)
    norm_before = compute_norm(norm_type)
    norm = gradfuse.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_after, torch.tensor(float(max_norm)))
    assert norm_after <= norm_before
    compare_scaling(grads)
    t_norm, twin = torch_result(grads)
    torch.testing.assert_close(norm, t_norm)
    for p, q in zip(layer.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

    # Small gradients should be left unchanged
    grads = torch.rand(10, 10).div(10000), torch.ones(10).div(500)
    if float(norm_type) < 0:
        grads = grads[0] * 1e-4, grads[1] * 1e-4
    set_grads(grads)
    norm_before = compute_norm(norm_type)
    norm = gradfuse.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_before, norm_after)
    assert norm_after <= max_norm
    scale = compare_scaling(grads)
    torch.testing.assert_close(scale, torch.tensor(1.0))
    torch.testing.assert_close(norm, torch_result(grads)[0])

    # Should accept a single Tensor as input
    p1, p2 = torch.randn(10, 10), torch.randn(10, 10)
    g = torch.arange(1.0, 101).view(10, 10) * (100 if float(norm_type) < 0 else 1)
    p1._grad = g.clone()
    p2._grad = g.clone()
    gradfuse.clip_grad_norm_(p1, max_norm, norm_type=norm_type)
    gradfuse.clip_grad_norm_([p2], max_norm, norm_type=norm_type)
    torch.testing.assert_close(p1.grad, p2.grad)
    assert not torch.equal(p1.grad, g)

    # Should warn when the parameters generator is exhausted
    params = layer.parameters()
    for _ in params:
        pass
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient "
                                         "clipping will occur."):
        gradfuse.clip_grad_norm_(params, max_norm, norm_type=norm_type)


NORMS_POS = [0.1, 1, 2, 3.5, inf]
NORMS_NEG = [-0.1, -1, -2, -3.5]
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = NORMS_EXCEPT_0 + [0]

# grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite
# (torch's table, unchanged)
NONFINITE_CASES = [
    # Test errors from an infinite grad
    (False, False, [inf, -inf], NORMS_EXCEPT_0, [0]),
    (False, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, False, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    # Test errors from a NaN grad
    (False, False, [nan], NORMS_EXCEPT_0, [0]),
    (False, True, [nan], NORMS_EXCEPT_0, [0]),
    (True, False, [nan], NORMS_EXCEPT_0, [0]),
    (True, True, [nan], NORMS_EXCEPT_0, [0]),
    # Test a grad that should never error
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    # Test a grad that will overflow to inf for only some norm orders
    (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, False, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
]


def gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param):
    param = torch.ones(10, dtype=torch.float64, requires_grad=True)
    if grad_only_one_elem:
        param[1].mul(scalar).sum().backward()
    else:
        param.mul(scalar).sum().backward()
    if prefix_finite_grad_param:
        prefix_param = torch.ones(1, dtype=torch.float64, requires_grad=True)
        prefix_param.mul(1).sum().backward()
        return [prefix_param, param]
    return [param]


def run_case(clip, norm_type, error_if_nonfinite, scalar, grad_only_one_elem,
             prefix_finite_grad_param, is_norm_nonfinite):
    """PyTorch's run_test_case with ``clip`` as the clip function; returns (total norm or None
    when it raised, the gradients after)."""
    parameters = gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param)
    msg = (f"norm_type: {norm_type}, error_if_nonfinite: {error_if_nonfinite}, scalar: {scalar}, "
           f"grad_only_one_elem: {grad_only_one_elem}, prefix_finite_grad_param: "
           f"{prefix_finite_grad_param}, is_norm_nonfinite: {is_norm_nonfinite}")
    # Should only throw an error if the total norm is expected to be nonfinite and
    # error_if_nonfinite=True
    if is_norm_nonfinite and error_if_nonfinite:
        grads_before = [p.grad.clone() for p in parameters]
        with pytest.raises(RuntimeError, match=f"The total norm of order {float(norm_type)} "
                                               "for gradients"):
            clip(parameters, 1, norm_type=norm_type, error_if_nonfinite=True)
        # Grad should not change if error is thrown
        for before, p in zip(grads_before, parameters):
            torch.testing.assert_close(before, p.grad, equal_nan=True, msg=msg)
        return None, [p.grad for p in parameters]
    try:
        total = clip(parameters, 1, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
    except RuntimeError as e:
        raise AssertionError(msg) from e
    return total, [p.grad for p in parameters]


def iter_cases(extra_norms=()):
    for one_elem, prefix, scalars, norms_nonfinite, norms_finite in NONFINITE_CASES:
        for error_if_nonfinite in (False, True):
            for norms, nonfinite in ((norms_nonfinite, True), (norms_finite, False),
                                     (extra_norms, None)):
                for norm_type, scalar in itertools.product(norms, scalars):
                    yield norm_type, error_if_nonfinite, scalar, one_elem, prefix, nonfinite


def test_clip_grad_norm_error_if_nonfinite():
    cases = 0
    for case in iter_cases():
        ours = run_case(gradfuse.clip_grad_norm_, *case)
        theirs = run_case(nn.utils.clip_grad_norm_, *case)  # the table holds for torch too
        assert (ours[0] is None) == (theirs[0] is None)
        if ours[0] is not None:
            torch.testing.assert_close(ours[0], theirs[0], equal_nan=True, msg=str(case))
            assert bool(ours[0].isfinite()) == (not case[-1]), case
        for a, b in zip(ours[1], theirs[1]):
            torch.testing.assert_close(a, b, equal_nan=True, msg=str(case))
        cases += 1
    assert cases == 560  # torch's count


def test_clip_grad_norm_error_if_nonfinite_minus_inf():
    """-inf (min |x|) is not in torch's table: whatever torch does, gradfuse does."""
    cases = 0
    for norm_type, error_if_nonfinite, scalar, one_elem, prefix, _ in iter_cases([-inf]):
        if norm_type != -inf:
            continue
        params = gen_parameters(scalar, one_elem, prefix)
        nonfinite = not bool(nn.utils.get_total_norm([p.grad for p in params], -inf).isfinite())
        case = (norm_type, error_if_nonfinite, scalar, one_elem, prefix, nonfinite)
        ours = run_case(gradfuse.clip_grad_norm_, *case)
        theirs = run_case(nn.utils.clip_grad_norm_, *case)
        if ours[0] is not None:
            torch.testing.assert_close(ours[0], theirs[0], equal_nan=True, msg=str(case))
        for a, b in zip(ours[1], theirs[1]):
            torch.testing.assert_close(a, b, equal_nan=True, msg=str(case))
        cases += 1
    assert cases == 56  # 16 rows (4 with one scalar, 12 with two) x error_if_nonfinite
