"""CUDA-only checks (skipped without a GPU): graph capture, no host sync, > 2^31 elements,
20 000 tensors, streams, agreement with the CPU backend, bitwise repeatability, the
optimizer-update op against the real step."""
import math

import pytest
import torch
from helpers import assert_stats_close

import gradfuse
from gradfuse import ops
from gradfuse.ops import library

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not library.has_kernel("cuda"), reason="gradfuse._C built without CUDA"),
]
CHUNK = 65536


def params_with_grads(sizes, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device="cuda"))
        p.grad = torch.randn(n, generator=g, dtype=dtype, device="cuda")
        out.append(p)
    return out


def test_backend_is_cuda():
    assert gradfuse.backend("cuda") == "cuda"


def test_no_host_sync_in_stats_clip_and_clip_grad_norm():
    params = params_with_grads([1000, 0, 3 * CHUNK + 5, 7])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gradfuse.stats(params)
        s = gradfuse.clip_(params, max_norm=0.1)
        _ = s.l2, s.mean, s.zero_fraction, s.nonfinite, s.clipped  # derived on the device
        gradfuse.clip_grad_norm_(params, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_graph_capture_and_replay_with_changing_gradients():
    params = params_with_grads([5000, 70000, 3])
    grads = [p.grad for p in params]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the graph, as capture requires
        for _ in range(2):
            gradfuse.clip_(params, max_norm=1.0)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gradfuse.clip_(params, max_norm=1.0)
        captured = (out.total_norm, out.l2, out.clip_coef)
    for scale in (0.001, 10.0, 3.0):
        fresh = [torch.randn_like(g) * scale for g in grads]
        for g, f in zip(grads, fresh):
            g.copy_(f)
        graph.replay()
        expect_total = torch.linalg.vector_norm(torch.cat([f.double() for f in fresh]))
        torch.testing.assert_close(captured[0].double(), expect_total, rtol=1e-5, atol=0)
        coef = min(1.0, 1.0 / (expect_total.item() + 1e-6))
        for g, f in zip(grads, fresh):
            torch.testing.assert_close(g, f * coef, rtol=1e-5, atol=1e-7)


def test_matches_cpu_backend_and_is_bitwise_repeatable():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tensors = [t.grad for t in params_with_grads([CHUNK * 3 + 11, 1, 0, 4099], dtype)]
        tensors[0][CHUNK + 1] = math.nan
        tensors[3][5] = -math.inf
        first = ops.multi_tensor_stats(tensors, 2.0)
        for _ in range(3):
            again = ops.multi_tensor_stats(tensors, 2.0)
            assert torch.equal(first[0].nan_to_num(), again[0].nan_to_num())
            assert torch.equal(first[1], again[1])
        cpu = ops.multi_tensor_stats([t.cpu() for t in tensors], 2.0)
        torch.testing.assert_close(first[1].cpu(), cpu[1], rtol=0, atol=0)
        torch.testing.assert_close(first[0].cpu(), cpu[0], rtol=1e-5, atol=1e-6, equal_nan=True)
        assert_stats_close(tensors, first)


def test_twenty_thousand_tensors():
    sizes = [(i * 37) % 3000 for i in range(20_000)]
    params = params_with_grads(sizes)
    s = gradfuse.stats(params)
    expect = torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params])
    torch.testing.assert_close(s.l2, expect, rtol=1e-5, atol=1e-12)
    gradfuse.clip_(params, max_norm=1.0)
    torch.testing.assert_close(gradfuse.stats(params).total_norm.double(),
                               torch.tensor(1.0, dtype=torch.float64, device="cuda"), rtol=1e-4, atol=0)


def test_views_with_odd_offsets_and_mixed_dtypes():
    # (test_clip.py::test_mixed_dtypes compares mixed dtypes with torch on cuda as well.)
    base = torch.randn(CHUNK * 2 + 100, device="cuda")
    views = [base[1:], base[3:CHUNK + 8], base[5:6]]
    assert_stats_close(views, ops.multi_tensor_stats(views, 2.0))
    mixed = params_with_grads([300, 5000], torch.bfloat16) + params_with_grads([77, 9], torch.float32)
    s = gradfuse.clip_(mixed, 0.01)
    assert s.total_norm.dtype == torch.float32 and bool(s.clipped)
    after = gradfuse.stats(mixed).total_norm
    torch.testing.assert_close(after, torch.tensor(0.01, device="cuda"), rtol=2e-2, atol=0)


def test_two_streams():
    a = params_with_grads([CHUNK * 4], seed=1)
    b = params_with_grads([CHUNK * 4], seed=2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        ra = gradfuse.stats(a).total_norm
    with torch.cuda.stream(s2):
        rb = gradfuse.stats(b).total_norm
    torch.cuda.synchronize()
    torch.testing.assert_close(ra.double(), torch.linalg.vector_norm(a[0].grad.double()), rtol=1e-5, atol=0)
    torch.testing.assert_close(rb.double(), torch.linalg.vector_norm(b[0].grad.double()), rtol=1e-5, atol=0)


def test_more_than_2_pow_31_elements_bf16():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 2**20 + 3
    if free < 3 * n * 2:
        pytest.skip("needs about 13 GB of free GPU memory")
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    x[-1] = 2.0
    x[2**31 + 5] = math.nan
    x[5] = 0.0
    f, c = ops.multi_tensor_stats([x], 2.0)
    assert c[0].tolist() == [1, 0, 1, n]
    x[2**31 + 5] = 1.0
    f, c = ops.multi_tensor_stats([x], 2.0)
    assert f[0, 1].item() == pytest.approx(n - 1 - 1 + 4, rel=1e-6)
    assert f[0, 2].item() == 2.0
    ops.multi_tensor_scale_([x], torch.tensor(0.5, device="cuda"))
    assert x[-1].item() == 1.0 and x[2**31 + 6].item() == 0.5


def test_moments_match_the_float64_two_pass_without_a_host_sync():
    """multi_tensor_moments on the GPU: M2 of data far from zero, against a float64 two-pass and
    the CPU backend; the shift travels from the items to the finalize on the device."""
    from helpers import assert_moments_close
    g = torch.Generator(device="cuda").manual_seed(5)
    sizes = [2, 17, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5, 1000, 0]
    for dtype, offset in ((torch.float32, 1e6), (torch.bfloat16, 100.0), (torch.float64, 1e8)):
        tensors = [(offset + torch.randn(n, generator=g, device="cuda", dtype=torch.float64)).to(dtype)
                   for n in sizes]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ops.multi_tensor_moments(tensors)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        cpu = [t.cpu() for t in tensors]
        assert_moments_close(cpu, tuple(r.cpu() for r in got))
        assert_moments_close(cpu, tuple(r.cpu() for r in got), expected=ops.multi_tensor_moments(cpu))


@pytest.mark.parametrize("optimizer_cls, kwargs", [
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"capturable": True, "lr_tensor": True}),
    (torch.optim.Adam, {"capturable": True, "amsgrad": True, "weight_decay": 1e-2}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
], ids=["adamw_fused", "adamw_capturable_lr_tensor", "adam_capturable_amsgrad", "sgd_nesterov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_statistics_equal_the_real_step_without_a_host_sync(optimizer_cls, kwargs, dtype):
    """The CUDA update op against w_after - w_before of the real step, the state and the step
    counter on the device, no host read while planning and reducing."""
    from gradfuse.dynamics.update_plan import plan_updates
    from gradfuse.ops.layout import UPDATE_SUMSQ

    kwargs = dict(kwargs)
    lr = torch.tensor(3e-2, device="cuda") if kwargs.pop("lr_tensor", False) else 3e-2
    params = params_with_grads([1000, 3 * CHUNK + 5, 7], dtype=dtype)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn_like(p))
    opt = optimizer_cls(params, lr=lr, **kwargs)
    for _ in range(2):  # the state exists (the first step is the op's other case)
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = plan_updates([opt])
        got = rows.floats[:, UPDATE_SUMSQ]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    before = [p.detach().double().clone() for p in params]
    opt.step()
    after = [p.detach().double() for p in params]
    want = torch.stack([(a - b).square().sum() for a, b in zip(after, before)])
    assert bool((want > 0).all())
    # The real step's w_after is rounded to the dtype: each element's update is off by up to half an
    # ulp of w, e_i. Then |sum u^2 - sum (u + e)^2| <= 2 |u| |e| + |e|^2 (Cauchy-Schwarz).
    e2 = torch.stack([((torch.finfo(dtype).eps / 2) * a.abs()).square().sum() for a in after])
    bound = 2 * want.sqrt() * e2.sqrt() + e2 + 1e-5 * want
    assert bool(((got.to(want.device) - want).abs() <= bound).all()), (got, want, bound)


def test_update_ops_match_the_cpu_backend():
    """The same inputs through the CUDA and CPU kernels of multi_tensor_update_stats."""
    from gradfuse.ops.layout import HYPER_COLUMNS

    g = torch.Generator().manual_seed(0)
    sizes = [1000, 3 * CHUNK + 5, 7, 0]
    make = [lambda n: torch.randn(n, generator=g), lambda n: torch.randn(n, generator=g) * 0.1,
            lambda n: torch.randn(n, generator=g) * 0.1, lambda n: torch.rand(n, generator=g) * 0.01,
            lambda n: torch.rand(n, generator=g) * 0.02]
    lists = [[f(n) for n in sizes] for f in make]
    row = dict(lr=1e-3, weight_decay=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=5, flags=4 | 8)
    hyper = torch.tensor([[float(row[c]) for c in HYPER_COLUMNS]] * len(sizes), dtype=torch.float64)
    cpu = ops.multi_tensor_update_stats(*lists, hyper, 1)
    cuda = ops.multi_tensor_update_stats(*[[t.cuda() for t in lst] for lst in lists], hyper.cuda(), 1)
    torch.testing.assert_close(cuda[0].cpu(), cpu[0], rtol=1e-5, atol=0)
    assert torch.equal(cuda[1].cpu(), cpu[1])


# ---- The fused optimizer step (csrc/cuda/step_ops.cuh) against the CPU kernels


def _step_lists(config, dtype, sizes, seed=0):
    """CPU lists (params, grads, moment1, moment2, moment2_max), the table and the rule of a config:
    "sgd_first" (the buffer written on the first step), "sgd_nesterov", "adam_l2", "adamw_amsgrad"."""
    from gradfuse.ops.layout import RULE_ADAM, RULE_SGD
    from gradfuse.optim.table import adam_row, sgd_row

    g = torch.Generator().manual_seed(seed)

    def randn(n, scale=1.0):
        return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)

    params, grads = [randn(n) for n in sizes], [randn(n) for n in sizes]
    empty = [torch.empty(0, dtype=dtype) for _ in sizes]
    if config.startswith("sgd"):
        first = config == "sgd_first"
        row = sgd_row(dict(lr=0.05, momentum=0.9, dampening=0.1 if first else 0.0, weight_decay=1e-2,
                           nesterov=not first, maximize=False), first)
        buffers = [torch.full((n,), math.nan, dtype=dtype) if first else randn(n, 0.1) for n in sizes]
        lists, rule = [params, grads, buffers, empty, empty], RULE_SGD
    else:
        amsgrad = config == "adamw_amsgrad"
        group = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1 if amsgrad else 1e-2, amsgrad=amsgrad,
                     maximize=config == "adam_l2")
        row = adam_row(group, 5.0, decoupled=amsgrad)
        v = [randn(n, 0.1).square() for n in sizes]
        lists = [params, grads, [randn(n, 0.1) for n in sizes], v,
                 [x * 1.5 for x in v] if amsgrad else empty]
        rule = RULE_ADAM
    coefs = torch.tensor([row] * len(sizes), dtype=torch.float64)
    coefs[:, 3 if config.startswith("sgd") else 9] *= 1 + torch.arange(len(sizes)) % 3  # the lr per tensor
    return lists, coefs, rule


def _same_bits(a, b):
    nan = a.isnan()
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a.reshape(-1).view(bits)[~nan.reshape(-1)],
                                                       b.reshape(-1).view(bits)[~nan.reshape(-1)])


@pytest.fixture
def correctly_rounded_cpu_sqrt():
    """The CPU kernels with the square root the CUDA kernels take (not MKL's)."""
    library.extension.set_step_torch_sqrt(False)
    yield
    library.extension.set_step_torch_sqrt(True)


@pytest.mark.parametrize("options", ["plain", "scale_coefs", "scale_per_tensor"])
@pytest.mark.parametrize("config", ["sgd_first", "sgd_nesterov", "adam_l2", "adamw_amsgrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_optim_step_equals_the_cpu_kernels_bit_for_bit(correctly_rounded_cpu_sqrt, dtype, config, options):
    sizes = [3 * CHUNK + 5, 1000, 0, 7, CHUNK]
    lists, coefs, rule = _step_lists(config, dtype, sizes)
    lists[1][0][[5, CHUNK + 3]] = math.nan  # a NaN gradient, counted in the rows
    kwargs = dict(stats=True)
    if options == "scale_coefs":
        kwargs.update(grad_scale=torch.tensor(0.5), update_coefs=torch.tensor([0.5, 1.0, 0.3, 2.0, 0.75],
                                                                              dtype=torch.float64))
    if options == "scale_per_tensor":
        kwargs.update(grad_scale=torch.tensor([0.5, 1.0, 0.3, 1.0, 0.01], dtype=torch.float64))
    cpu = [[t.clone() for t in lst] for lst in lists]
    f, c = torch.ops.gradfuse.multi_tensor_optim_step_(*cpu, coefs, rule, 0, **kwargs)
    gpu = [[t.cuda() for t in lst] for lst in lists]
    gf, gc = torch.ops.gradfuse.multi_tensor_optim_step_(*gpu, coefs.cuda(), rule, 0,
                                                         **{k: v.cuda() if isinstance(v, torch.Tensor) else v
                                                            for k, v in kwargs.items()})
    for name, a, b in zip(("params", "grads", "moment1", "moment2", "moment2_max"), gpu, cpu):
        for i, (x, y) in enumerate(zip(a, b)):
            assert _same_bits(x.cpu(), y), f"{name}[{i}]: {int((x.cpu() != y).sum())} differ"
    assert sum(int((x != y).sum()) for x, y in zip(cpu[0], lists[0])) > 0  # the step moved weights
    assert gf.device.type == "cuda" and torch.equal(gc.cpu(), c) and int(c[0, 0]) > 0
    eps = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    torch.testing.assert_close(gf.cpu(), f, rtol=8600 * eps, atol=0, equal_nan=True)  # summation orders


def test_optim_step_reads_its_flags_on_the_device_without_a_host_sync(correctly_rounded_cpu_sqrt):
    """The table, the scale, the skip flag and the update coefficients stay on the GPU: no host
    sync; a nonzero flag writes nothing, and the same call after the flag is cleared on the device
    writes the step."""
    lists, coefs, rule = _step_lists("adamw_amsgrad", torch.bfloat16, [3 * CHUNK + 5, 999, 0])
    gpu = [[t.cuda() for t in lst] for lst in lists]
    before = [[t.clone() for t in lst] for lst in gpu]
    coefs, scale = coefs.cuda(), torch.tensor(0.25, device="cuda")
    skip, ucoefs = torch.tensor(1.0, device="cuda"), torch.tensor([0.5, 1.0, 1.0], dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        skipped = torch.ops.gradfuse.multi_tensor_optim_step_(*gpu, coefs, rule, 0, grad_scale=scale, skip=skip,
                                                              update_coefs=ucoefs, stats=True)
        after_skipped = [[t.clone() for t in lst] for lst in gpu]
        skip.zero_()
        taken = torch.ops.gradfuse.multi_tensor_optim_step_(*gpu, coefs, rule, 0, grad_scale=scale, skip=skip,
                                                            update_coefs=ucoefs, stats=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for x, y in zip(after_skipped, before):
        assert all(_same_bits(a.cpu(), b.cpu()) for a, b in zip(x, y))
    assert not torch.equal(gpu[0][0], before[0][0])
    # the rows of the step skipped are those of the step then taken, and the CPU kernels'
    torch.testing.assert_close(skipped[0], taken[0], rtol=0, atol=0)
    cpu = [[t.clone() for t in lst] for lst in lists]
    f, c = torch.ops.gradfuse.multi_tensor_optim_step_(*cpu, coefs.cpu(), rule, 0, grad_scale=scale.cpu(),
                                                       update_coefs=ucoefs.cpu(), stats=True)
    assert torch.equal(taken[1].cpu(), c)
    for a, b in zip(gpu, cpu):
        assert all(_same_bits(x.cpu(), y) for x, y in zip(a, b))


def test_optim_step_in_a_cuda_graph_follows_the_skip_flag():
    lists, coefs, rule = _step_lists("sgd_nesterov", torch.float32, [CHUNK + 3, 5000])
    gpu = [[t.cuda() for t in lst] for lst in lists]
    coefs, skip = coefs.cuda(), torch.tensor(0.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as capture requires
        torch.ops.gradfuse.multi_tensor_optim_step_(*gpu, coefs, rule, 0, skip=skip, stats=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f, _ = torch.ops.gradfuse.multi_tensor_optim_step_(*gpu, coefs, rule, 0, skip=skip, stats=True)
    for flag in (1.0, 0.0, 1.0):
        skip.fill_(flag)
        before = gpu[0][0].clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gpu[0][0], before) == (flag != 0.0)
        assert float(f[0, 0]) > 0  # the rows of the step, taken or not


def test_fused_optimizer_on_cuda_equals_its_cpu_steps_in_float32(correctly_rounded_cpu_sqrt):
    """gradfuse.optim.AdamW and SGD on the GPU and on the CPU, three steps from no state: the same
    bits (float32 has no torch scalar tails, so the CPU's thread count does not enter)."""
    import gradfuse.optim

    for name, kwargs in (("AdamW", dict(lr=1e-3, weight_decay=0.05, amsgrad=True)),
                         ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2))):
        g = torch.Generator().manual_seed(1)
        cpu = [torch.randn(n, generator=g).requires_grad_() for n in (3 * CHUNK + 5, 77, 1)]
        gpu = [p.detach().cuda().requires_grad_() for p in cpu]
        opts = [getattr(gradfuse.optim, name)(ps, **kwargs) for ps in (cpu, gpu)]
        for step in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in cpu]
            for p, q, gr in zip(cpu, gpu, grads):
                p.grad, q.grad = gr.clone(), gr.cuda()
            for opt in opts:
                opt.step()
            for p, q in zip(cpu, gpu):
                assert _same_bits(q.detach().cpu(), p.detach()), (name, step)


def never_syncing(steps, step_of):
    """The reports of ``step_of(step)`` for each step, run under torch's sync debug mode "error"
    (which raises on any host synchronisation), the skip's warning expected."""
    torch.cuda.synchronize()
    reports = []
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            reports = [step_of(step) for step in range(steps)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return reports


def test_nonblocking_monitor_never_syncs_and_skips_on_the_device():
    """GradMonitor(blocking=False) with gradfuse.optim.AdamW under torch's sync debug mode set to
    "error" (any synchronising call raises): 30 steps, a planted NaN and a planted explosion,
    skipped on the device; the host hears of them one step later."""
    import gradfuse.optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = gradfuse.GradMonitor(model, max_norm=1.0, every=10, explode_threshold=1e4, optimizer=opt,
                                   blocking=False)
    xs = torch.randn(30, 16, 64, device="cuda")

    def step_of(step):
        model(xs[step]).square().mean().backward()
        if step == 7:
            model[0].weight.grad[0, 0] = math.nan
        if step == 19:
            torch._foreach_mul_([p.grad for p in model.parameters()], 1e7)
        report = monitor.step()
        opt.step()
        opt.zero_grad()
        return report

    reports = never_syncing(30, step_of)
    monitor.close()
    assert [r.step for r in reports if r.skip] == [7, 19]
    assert monitor.counters()["skipped_steps"] == 2
    assert float(opt.state_dict()["state"][0]["step"]) == 28


def test_everything_on_never_syncs_on_the_device(tmp_path):
    """The recommended configuration (the demo's: histograms, activations, the NaN trace, noise
    scale, update ratios, the flight recorder with updates, a JSONL sink, the clip riding
    gradfuse.optim's AdamW, blocking=False) under torch's sync debug mode "error": 24 steps of two
    micro-batches, a NaN planted in a forward and an explosion, skipped on the device, the NaN
    traced to its module; records written from the host copies."""
    import json

    import gradfuse.optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-3)
    log = tmp_path / "run.jsonl"
    monitor = gradfuse.GradMonitor(
        model, max_norm=1.0, every=4, explode_threshold=1e4, on_explode="skip", optimizer=opt, blocking=False,
        fused_step=True, histogram=True, activations=True, trace_nonfinite=True, noise_scale=True,
        update_ratios=opt, sinks=[gradfuse.JsonlSink(log)], check_double_clip=False,  # the planted explosion
        recorder=gradfuse.FlightRecorder(optimizer=opt, record_updates=True, dump_dir=tmp_path / "dumps"))
    nan_at, explode_at = 9, 17
    planted = {"on": False}
    model[2].register_forward_pre_hook(lambda _m, a: (a[0] * math.nan,) if planted["on"] else None)
    xs = torch.randn(24, 2, 16, 64, device="cuda")

    def step_of(step):
        for micro in range(2):
            planted["on"] = step == nan_at and micro == 0
            (model(xs[step, micro]).square().mean() / 2).backward()
            monitor.micro_step()
        if step == explode_at:
            torch._foreach_mul_([p.grad for p in model.parameters()], 1e7)
        report = monitor.step()
        opt.step()
        opt.zero_grad()
        return report

    reports = never_syncing(24, step_of)
    monitor.close()
    assert [r.step for r in reports if r.skip] == [nan_at, explode_at]
    assert reports[nan_at].first_nonfinite == ("forward", "2")
    assert float(opt.state_dict()["state"][0]["step"]) == 22
    records = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [r for r in records if r["step"] % 4 == 0]
    assert logged and all(r["act"] and r["exponents"] and r["update_ratio"] for r in logged)


@pytest.mark.parametrize("per", ["layer", "param"])
def test_per_layer_clip_rides_the_fused_step_without_a_host_sync(per):
    """GradMonitor(per=..., fused_step=True, blocking=False) on the device: one coefficient per
    parameter handed to the step as its gradient scale, under sync debug mode "error" (after a
    first step, which builds the optimizer's row index); the weights those of clipping first."""
    import gradfuse.optim

    def train(fused_step):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        opt = gradfuse.optim.AdamW([{"params": model[2].parameters()}, {"params": model[0].parameters()}], lr=1e-2)
        monitor = gradfuse.GradMonitor(model, max_norm=0.05, per=per, every=0, optimizer=opt, blocking=False,
                                       fused_step=fused_step)
        xs = torch.randn(6, 16, 64, device="cuda")
        for step in range(6):
            if step >= 1:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                model(xs[step]).square().sum().backward()
                monitor.step()
                opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monitor.close()
        return model, monitor

    first, clip_first = train(False)
    riding, ride = train(True)
    assert clip_first.counters()["clipped_steps"] == ride.counters()["clipped_steps"] >= 4
    for a, b in zip(first.parameters(), riding.parameters()):
        assert torch.equal(a, b)
