"""Run in each gloo process of tests/clip/test_fsdp2_torch_clip.py.

``check_torch_fsdp2_clip_1d`` is PyTorch's own FSDP2 clipping test, ``test_clip_grad_norm_1d``
and its ``_test_clip_grad_norm`` in ``test/distributed/_composable/fsdp/
test_fully_shard_clip_grad_norm_.py`` (PyTorch, BSD-3-Clause license, (c) PyTorch contributors),
re-expressed for 2 gloo ranks on CPU: same model (torch.testing._internal's Transformer, from the
installed torch), same reference (``replicate``), same checks, including the CommDebugMode count
of ``c10d_functional.all_reduce``; the one change: the sharded model is clipped by
``gradfuse.clip_grad_norm_`` instead of ``torch.nn.utils.clip_grad_norm_``.
``check_hsdp_clip`` runs the same checks on a 2-d (replicate x shard) mesh, where the expected
count is the one torch's own clip_grad_norm_ issues on the same gradients.
"""
import copy
import functools

import torch
from gloo_checks import run_checks
from torch import nn

import gradfuse


def _assert_equal(a, b):
    torch.testing.assert_close(a, b)


def _functional_all_reduces(comm_mode) -> int:
    return comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]


def _torch_clip_all_reduces(model, max_norm, norm_type) -> int:
    """How many functional all-reduces torch.nn.utils.clip_grad_norm_ issues on copies of
    ``model``'s DTensor gradients."""
    from torch.distributed.tensor.debug import CommDebugMode
    copies = []
    for p in model.parameters():
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.detach().clone()
        copies.append(q)
    with CommDebugMode() as comm_mode:
        torch.nn.utils.clip_grad_norm_(copies, max_norm=max_norm, norm_type=norm_type, foreach=True)
    return _functional_all_reduces(comm_mode)


def _clip_grad_norm_test(max_norm, norm_type, ref_model, ref_optim, model, optim, dp_mesh,
                         expected_from_torch=False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
    torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
    inp = torch.randint(0, model.model_args.vocab_size, (3, 16))
    for _iter_idx in range(10):
        ref_optim.zero_grad()
        ref_model(inp).sum().backward()
        optim.zero_grad()
        model(inp).sum().backward()

        ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
        local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
        for ref_grad, param in zip(ref_grads, model.parameters()):
            if tuple(param.placements) == (Shard(0), Shard(0)):  # as torch's test: skipped
                continue
            _assert_equal(ref_grad, param.grad.full_tensor())

        # every gradient's norm is above max_norm, so the clipping is not vacuous
        assert all(vector_norm_fn(g).item() > max_norm for g in ref_grads)
        assert all(vector_norm_fn(g).item() > max_norm for g in local_grads)

        ref_total_norm = torch.nn.utils.clip_grad_norm_(
            ref_model.parameters(), max_norm=max_norm, norm_type=norm_type)
        if expected_from_torch:
            expected_all_reduces = _torch_clip_all_reduces(model, max_norm, norm_type)
        comm_mode = CommDebugMode()
        with comm_mode:
            total_norm = gradfuse.clip_grad_norm_(  # torch's test: torch.nn.utils.clip_grad_norm_
                model.parameters(), max_norm=max_norm, norm_type=norm_type, foreach=True)
        _assert_equal(ref_total_norm, total_norm.full_tensor())
        if not expected_from_torch:
            # torch's expectation: one all-reduce per mesh dim for Partial -> Replicate
            expected_all_reduces = len(total_norm.placements)
        assert _functional_all_reduces(comm_mode) == expected_all_reduces, \
            (comm_mode.get_comm_counts(), expected_all_reduces)
        # and nothing else: no non-functional collective besides
        assert sum(comm_mode.get_comm_counts().values()) == expected_all_reduces, \
            comm_mode.get_comm_counts()
        # zero gradients are left as they are; every other one was scaled
        for param, grad in zip(ref_model.parameters(), ref_grads):
            assert vector_norm_fn(param.grad).item() <= max_norm
            if torch.count_nonzero(grad):
                assert not torch.equal(param.grad, grad)
        for param, grad in zip(model.parameters(), local_grads):
            assert vector_norm_fn(param.grad.to_local()).item() <= max_norm
            if torch.count_nonzero(grad):
                assert not torch.equal(param.grad.to_local(), grad)


def _models(mesh, ref_group=None):
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock
    torch.manual_seed(42)
    model = Transformer(ModelArgs(dropout_p=0.0))
    ref_model = replicate(copy.deepcopy(model), process_group=ref_group)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return ref_model, ref_optim, model, optim


def check_torch_fsdp2_clip_1d(rank, world):
    """PyTorch's test_clip_grad_norm_1d."""
    from torch.distributed.device_mesh import init_device_mesh
    dp_mesh = init_device_mesh("cpu", (world,))
    for norm_type in (2, 1, float("inf")):
        ref_model, ref_optim, model, optim = _models(dp_mesh)
        _clip_grad_norm_test(1, norm_type, ref_model, ref_optim, model, optim, dp_mesh)


def check_hsdp_clip(rank, world):
    """The same on a 2-d (replicate, shard) mesh: fully_shard(mesh=2-d) is HSDP, gradients
    placed (Replicate(), Shard(0)); the count is torch's own on the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for norm_type in (2, 1, 3, float("inf")):
        ref_model, ref_optim, model, optim = _models(mesh)
        for p in model.parameters():
            assert tuple(p.placements)[0].is_replicate() and tuple(p.placements)[1].is_shard()
        _clip_grad_norm_test(1, norm_type, ref_model, ref_optim, model, optim, mesh["shard"],
                             expected_from_torch=True)


def check_monitor_step_collectives(rank, world):
    """The monitor's ordinary step on FSDP2 gradients (norm, non-finite flag, clip): one
    functional scalar all-reduce and no other collective; a logging step reduces the rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    monitor = gradfuse.GradMonitor(model, max_norm=1e-3, every=2, on_nonfinite="skip")
    for step in range(4):
        model.zero_grad()
        torch.manual_seed(1 + rank + step)
        model(torch.randn(4, 8)).square().mean().backward()
        full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        with CommDebugMode() as comm_mode:
            report = monitor.step()
        counts = comm_mode.get_comm_counts()
        if step % 2:  # ordinary step
            assert _functional_all_reduces(comm_mode) == 1 and sum(counts.values()) == 1, counts
        assert not report.anomalies and not report.skip
        ref = gradfuse.tensor_stats(full)
        torch.testing.assert_close(report.stats.total_norm.full_tensor().double(), ref.total_norm.double())
        # rows (reduced on the logging step, or now on read: every rank reads) are the full ones
        torch.testing.assert_close(report.stats.l2, ref.l2)
        after = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]))
        assert float(ref.total_norm) > 1e-3 and abs(float(after) - 1e-3) < 1e-6, float(after)
    # a NaN on one rank: the flag travels in the total, every rank skips
    model.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    if rank == 0:
        model[0].weight.grad.to_local()[0, 0] = float("nan")
    with CommDebugMode() as comm_mode:
        report = monitor.step()  # no sink: the total alone, then the message reads the rows
    assert report.anomalies == ["nonfinite"] and report.skip, report
    assert "0.weight" in report.message, report.message


CHECKS = {"torch_1d": check_torch_fsdp2_clip_1d, "hsdp": check_hsdp_clip,
          "monitor": check_monitor_step_collectives}


def worker(rank, world, init_file, checks, result_dir):
    run_checks(rank, world, init_file, result_dir, [(name, CHECKS[name]) for name in checks], timeout_s=120)
