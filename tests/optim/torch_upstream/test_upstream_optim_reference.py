# From PyTorch, https://github.com/pytorch/pytorch, test/test_optim.py.
# Copyright (c) 2016- Facebook, Inc (Adam Paszke), and the other copyright holders that LICENSE,
# next to this file, names.
# Licensed under the BSD 3-Clause License: its conditions and disclaimer are in LICENSE, next to
# this file (torch's LICENSE as the torch wheel ships it).
# ruff: noqa: E402  (the imports follow the skip without expecttest)
"""torch's tests that compare two implementations of an optimizer (``test_foreach_matches_forloop``,
``test_fused_matches_forloop``, ``test_set_default_dtype_works_with_foreach`` and
``test_mixed_device_dtype`` of ``TestOptimRenewed`` in test/test_optim.py, read at commit
a8ad7b74fcf731888429aa32e06d839947a0e321 of PyTorch's main branch), with torch's class (its default
CPU step: the for-loop) as one implementation and gradfuse's as the other, over the inputs of
torch's OptimizerInfo database (``torch_upstream_helpers.optim_db``), on the CPU.

Copied unchanged: ``_compare_between`` (7 steps of a small model, step 2 with no gradients, a
layer frozen for steps 3-4; weights and every state tensor compared after each step).
Changed: ``_test_derived_optimizers`` becomes ``_test_matches_torch``: torch's class and
gradfuse's in place of one class with a flag off and on, compared bit for bit (torch's tests
allow a tolerance between its implementations; gradfuse's step is torch's to the bit), and
checking that the weights moved. ``test_matches_torch_forloop`` takes the dtypes of
``test_fused_matches_forloop`` (float16, bfloat16, float32, float64);
``test_set_default_dtype_matches_torch`` and ``test_mixed_dtype_matches_torch`` run on the CPU
what torch runs on CUDA only (one CPU in place of two GPUs for the mixed dtypes).

gradfuse's own, on torch's database: ``test_refused_inputs_raise`` (every input of torch's lists,
CUDA's included, that sets what gradfuse refuses raises ValueError naming the setting at
construction; every other input constructs).
"""
import re
from copy import deepcopy

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal.common_utils imports it

from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_dtype import floating_types_and
from torch.testing._internal.common_optimizers import TensorTracker, optims
from torch.testing._internal.common_utils import TestCase, markDynamoStrictTest
from torch_upstream_helpers import GRADFUSE_CLASSES, TORCH_CLASSES, optim_db, refused_setting, torch_optim_db

BIT_FOR_BIT = {"atol": 0, "rtol": 0}


@markDynamoStrictTest
class TestOptimMatchesTorch(TestCase):
    def _compare_between(
        self, inputs, models, optimizers, assert_eq_kwargs=None, assert_step_dtype=None
    ):
        # why 7? iteration 7 is where we start to see differences for RAdam
        # params interacting with the small eps value, because that's right
        # after rho_t becomes greater than 5 in step 6.
        if assert_eq_kwargs is None:
            assert_eq_kwargs = {}
        kIterations = 7
        tracker = TensorTracker(assert_eq_kwargs)
        for i in range(kIterations):
            state, updated_params = [], []
            if not isinstance(inputs, list):
                inputs = [inputs, inputs]
            for input, model, optimizer in zip(inputs, models, optimizers):
                optimizer.zero_grad()

                if i == 3:
                    # Freeze a layer to test if the step of this layer in 'fused' or 'foreach'
                    # is same as the step in 'forloop'.
                    model[2].requires_grad_(False)
                if i == 5:
                    # Unfreeze the layer after 2 iters.
                    model[2].requires_grad_(True)

                # Test that step behaves as expected (a no-op) when grads are set to None
                if i != 2:
                    output = model(input)
                    loss = output.sum()
                    loss.backward()

                optimizer.step()
                state.append(optimizer.state)
                updated_params.append(model.parameters())

            og_state, new_state = state
            for og_p, new_p in zip(updated_params[0], updated_params[1]):
                tracker.add(og_p)
                tracker.pop_check_set(new_p, self)

                # check that optimizer states are the same
                og_p_state = og_state[og_p]
                new_p_state = new_state[new_p]
                if assert_step_dtype is not None:
                    if torch.is_tensor(og_p_state.get("step", None)):
                        self.assertEqual(og_p_state["step"].dtype, assert_step_dtype)
                    if torch.is_tensor(new_p_state.get("step", None)):
                        self.assertEqual(new_p_state["step"].dtype, assert_step_dtype)
                for k in og_p_state:
                    tracker.add(og_p_state[k])
                    tracker.pop_check_set(new_p_state[k], self)

            self.assertTrue(tracker.all_popped())

    def _test_matches_torch(self, device, dtype, optim_info, assert_step_dtype=None):
        """The torch class and gradfuse's, each on the same model from the same seed, compared
        bit for bit after every step (from torch's ``_test_derived_optimizers``)."""
        optim_inputs = optim_info.optim_inputs_func(device=device, dtype=dtype)
        for optim_input in optim_inputs:
            models, optimizers = [], []
            for optim_cls in (TORCH_CLASSES[optim_info.optim_cls], optim_info.optim_cls):
                kwargs = deepcopy(optim_input.kwargs)
                if optim_cls in GRADFUSE_CLASSES:
                    kwargs["foreach"] = False  # torch's for-loop step, its default on the CPU
                input = torch.tensor(
                    [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype, device=device
                ).reshape(3, 2)

                torch.manual_seed(1)
                model = torch.nn.Sequential(
                    torch.nn.Linear(2, 3),
                    torch.nn.Sigmoid(),
                    torch.nn.Linear(3, 1),
                    torch.nn.Sigmoid(),
                )
                model.to(dtype=dtype, device=device)

                # foreach/fused optimizers should be tested with a
                # zero_size tensor as its last param.
                empty_param = torch.empty(
                    (), device=device, dtype=dtype, requires_grad=True
                )
                empty_param.grad = torch.rand_like(empty_param)
                params = list(model.parameters()) + [empty_param]

                optimizer = optim_cls(params, **kwargs)
                models.append(model)
                optimizers.append(optimizer)

            before = [p.detach().clone() for p in models[1].parameters()]
            self._compare_between(input, models, optimizers, BIT_FOR_BIT, assert_step_dtype)
            # the steps changed the weights: there was something to compare
            self.assertTrue(any(not torch.equal(b, p) for b, p in zip(before, models[1].parameters())))

    @optims(optim_db, dtypes=floating_types_and(torch.bfloat16, torch.float16))
    def test_matches_torch_forloop(self, device, dtype, optim_info):
        self._test_matches_torch(device, dtype, optim_info)

    @optims(optim_db, dtypes=[torch.float64])
    def test_set_default_dtype_matches_torch(self, device, dtype, optim_info):
        # We coerce step to always be float32 unless the
        # default dtype is higher prec float64
        old_default_dtype = torch.get_default_dtype()
        for default_dtype in [torch.float64, torch.float16]:
            try:
                torch.set_default_dtype(default_dtype)
                self._test_matches_torch(
                    device,
                    dtype,
                    optim_info,
                    assert_step_dtype=(
                        torch.float64
                        if default_dtype == torch.float64
                        else torch.float32
                    ),
                )
            finally:
                torch.set_default_dtype(old_default_dtype)

    @optims(optim_db)
    def test_mixed_dtype_matches_torch(self, device, dtype, optim_info):
        """Parameters of four dtypes in one optimizer (torch's ``test_mixed_device_dtype``
        spreads them over two GPUs as well), torch's class against gradfuse's, bit for bit."""
        params = [
            torch.rand(2, 3, dtype=torch.float64, device=device, requires_grad=True),
            torch.rand(2, 3, dtype=torch.float32, device=device, requires_grad=True),
            torch.rand(2, 3, dtype=torch.float16, device=device, requires_grad=True),
            torch.rand(2, 3, dtype=torch.bfloat16, device=device, requires_grad=True),
        ]

        for p in params:
            if p.requires_grad:
                p.grad = torch.rand_like(p, device=p.device, dtype=p.dtype)

        kIterations = 7
        optim_inputs = optim_info.optim_inputs_func(device=device)
        for optim_input in optim_inputs:
            updated_params, state = [], []
            for optim_cls in (TORCH_CLASSES[optim_info.optim_cls], optim_info.optim_cls):
                kwargs = deepcopy(optim_input.kwargs)
                params_clone = []
                for p in params:
                    p_clone = p.detach().clone()
                    if p.requires_grad:
                        p_clone.requires_grad = True
                        p_clone.grad = p.grad.detach().clone()
                        params_clone.append(p_clone)

                optimizer = optim_cls(params_clone, **kwargs)
                for _ in range(kIterations):
                    optimizer.step()

                state.append(optimizer.state)
                updated_params.append(params_clone)

            og_state, new_state = state
            # the steps moved the weights (those whose ulp is small enough for the lr)
            self.assertTrue(any(not torch.equal(p, og_p) for p, og_p in zip(params, updated_params[0])))
            for og_p, new_p in zip(updated_params[0], updated_params[1]):
                self.assertEqual(og_p, new_p, **BIT_FOR_BIT)

                # check that optimizer states are the same
                og_p_state = og_state[og_p]
                new_p_state = new_state[new_p]
                self.assertEqual(sorted(og_p_state), sorted(new_p_state))
                for k in og_p_state:
                    self.assertEqual(og_p_state[k], new_p_state[k], **BIT_FOR_BIT)

    def test_refused_inputs_raise(self, device):
        refused = 0
        for torch_cls, torch_info in torch_optim_db.items():
            for inputs_device in ("cpu", "cuda"):
                for optim_input in torch_info.optim_inputs_func(device=inputs_device):
                    kwargs = optim_input.kwargs
                    setting = refused_setting(kwargs)
                    param = torch.nn.Parameter(torch.randn(2, 3, device=device))
                    if setting is None:
                        GRADFUSE_CLASSES[torch_cls]([param], **kwargs)
                        continue
                    refused += 1
                    with self.assertRaisesRegex(ValueError, f"gradfuse.optim.{torch_cls.__name__}: "
                                                            f"{re.escape(setting)}"):
                        GRADFUSE_CLASSES[torch_cls]([param], **kwargs)
        self.assertGreater(refused, 0)


instantiate_device_type_tests(TestOptimMatchesTorch, globals(), only_for="cpu")
