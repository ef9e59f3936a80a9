"""The CUDA fused optimizer step without a GPU: StepOp of csrc/cuda/step_ops.cuh on the five-list
tables of csrc/cuda/multi_tensor.cuh, with the glue of csrc/cuda/ops.h, run on the CPU by the CUDA
emulation of tests/cuda_emu (see test_cuda_emulated.py).

Every weight and state tensor the emulated CUDA step writes is compared bit for bit (a NaN with a
NaN) with the CPU kernels' (gradfuse._C with a correctly rounded square root,
set_step_torch_sqrt(False), and torch_threads 0: no torch scalar tails), which
tests/optim/test_optim_exact.py compares with torch's own step; its statistics rows with the CPU
op's, the counts exactly and the sums within the rounding of their summation order. SGD and Adam /
AdamW (momentum, dampening, nesterov, maximize, amsgrad, L2 or decoupled decay, the first step,
state absent), every dtype, NaN and Inf, empty tensors, sizes across chunks, misaligned views, more
tensors than one launch table, a gradient scale, the skip flag (read on the device; a skipped step
without statistics touches no memory), update coefficients, write=False. The file reruns itself
under ASan+UBSan, built with FMA contraction (nvcc's default) and with the blocks and threads
scheduled in reverse order.
"""
import ast
import math
import os
import subprocess
import sys

import cuda_emu
import pytest
import torch
from emu_fixtures import RERUN, rerun_reversed, rerun_under_sanitizers, rerun_with_fma
from emu_grid import CHUNK, grid_params, plant, randn

from gradfuse.ops import library, step_reference
from gradfuse.ops.layout import NUM_STEP_COEFS, RULE_ADAM, RULE_SGD
from gradfuse.optim.table import adam_row, sgd_row

pytestmark = pytest.mark.skipif(library.extension is None or not hasattr(torch.ops.gradfuse,
                                                                         "multi_tensor_optim_step_"),
                                reason="gradfuse._C (the CPU step compared with) not built")

SGD_DEFAULTS = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
ADAM_DEFAULTS = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)

# name: (optimizer, group, step, state). SGD's step: True on its first (the buffer is written, not
# read: it holds NaN here), False after. state: the lists given ("m" moment1, "v" moment2, "x"
# moment2_max; "0": Adam's state as torch creates it, zeros).
CONFIGS = {
    "sgd": ("sgd", dict(lr=0.1), False, ""),
    "sgd_wd_maximize": ("sgd", dict(lr=0.05, weight_decay=0.01, maximize=True), False, ""),
    "sgd_momentum_first": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), True, "m"),
    "sgd_momentum": ("sgd", dict(lr=0.1, momentum=0.9), False, "m"),
    "sgd_dampening_wd": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.01), False, "m"),
    "sgd_nesterov_wd_maximize": ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                             maximize=True), False, "m"),
    "sgd_momentum_no_buffer": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.5), False, ""),
    "adam": ("adam", dict(lr=1e-3), 7, "mv"),
    "adam_first": ("adam", dict(lr=1e-3), 1, "mv0"),
    "adam_l2_maximize": ("adam", dict(lr=1e-3, weight_decay=0.01, maximize=True), 4, "mv"),
    "adam_small_beta1": ("adam", dict(lr=1e-2, betas=(0.3, 0.95), eps=1e-6), 3, "mv"),
    "adamw": ("adamw", dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6), 12, "mv"),
    "adamw_amsgrad": ("adamw", dict(lr=2e-3, weight_decay=0.1, betas=(0.8, 0.999), eps=1e-3, amsgrad=True), 9,
                      "mvx"),
    "adam_amsgrad_first": ("adam", dict(lr=1e-3, amsgrad=True), 1, "mvx0"),
    "adam_amsgrad_no_max": ("adam", dict(lr=1e-3, amsgrad=True), 5, "mv"),
    "adam_eps_dominated": ("adam", dict(lr=1e-3, eps=0.5), 30, "mv"),
}
# The statistics' sums, each over a chunk in the accumulation dtype (float64 for float64, else
# float32) and in an order of its own: the CPU kernels' lanes add up to 8192 terms one after the
# other (a chunk over 8 lanes), the CUDA threads 256 (a chunk over 256 threads) before their trees;
# each sum's relative rounding error is below (terms added in a row) x the dtype's epsilon. Against
# the CPU op: 8192 + 256 + the trees; against float64 sums of the emulated step's own terms: 256 +
# the trees.
ACC_EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -24,
           torch.float16: 2.0 ** -24}
CPU_RTOL = {d: 8600 * eps for d, eps in ACC_EPS.items()}
OWN_RTOL = {d: 400 * eps for d, eps in ACC_EPS.items()}
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


@pytest.fixture(scope="module", autouse=True)
def correctly_rounded_sqrt():
    """The CPU kernels with the square root the CUDA kernels take (not MKL's)."""
    library.extension.set_step_torch_sqrt(False)
    yield
    library.extension.set_step_torch_sqrt(True)



def coefs_of(config, n):
    """The table of n tensors, the learning rate varied per tensor."""
    kind, group, step, _ = CONFIGS[config]
    rows = []
    for i in range(n):
        lr = group["lr"] * (1 + i % 5 / 4)
        if kind == "sgd":
            rows.append(sgd_row({**SGD_DEFAULTS, **group, "lr": lr}, first=step))
        else:
            rows.append(adam_row({**ADAM_DEFAULTS, **group, "lr": lr}, float(step), decoupled=kind == "adamw"))
    rule = RULE_SGD if kind == "sgd" else RULE_ADAM
    return torch.tensor(rows, dtype=torch.float64).reshape(n, NUM_STEP_COEFS), rule


def state_of(config, params, dtype, seed=0, plant_values=False):
    """grads, moment1, moment2, moment2_max for params (empty where the config has none)."""
    kind, _, step, present = CONFIGS[config]
    grads, m1s, m2s, maxs = [], [], [], []
    empty = torch.empty(0, dtype=dtype)
    for i, w in enumerate(params):
        g = randn(w.shape, dtype, seed + 1000 + i)
        m = randn(w.shape, dtype, seed + 2000 + i) * 0.1
        v = randn(w.shape, dtype, seed + 3000 + i).square() * 0.01
        vm = torch.maximum(v, randn(w.shape, dtype, seed + 4000 + i).square() * 0.01)
        if "0" in present:
            m, v, vm = torch.zeros_like(m), torch.zeros_like(v), torch.zeros_like(vm)
        if kind == "sgd" and step is True:
            m = torch.full_like(m, math.nan)  # the first step writes the buffer without reading it
        if plant_values and w.numel() > 8:
            plant(g, i)
            m.view(-1)[[3 % w.numel(), (CHUNK + 3) % w.numel()]] = math.nan
            v.view(-1)[5 % w.numel()] = math.inf
            m.view(-1)[9 % w.numel()] = -math.inf
        grads.append(g)
        m1s.append(m if "m" in present else empty)
        m2s.append(v if "v" in present else empty)
        maxs.append(vm if "x" in present else empty)
    return grads, m1s, m2s, maxs


def misaligned_like(ts, shift=1):
    """Copies of ts (non-empty ones) in storage shifted by `shift` elements."""
    out = []
    for t in ts:
        if t.numel() == 0:
            out.append(t)
            continue
        view = torch.empty(t.numel() + shift, dtype=t.dtype)[shift:].view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def same_bits(a, b):
    """Equal bit for bit, a NaN equal to any NaN (a GPU writes its own NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.reshape(-1).view(bits)[~nan.reshape(-1)], b.reshape(-1).view(bits)[~nan.reshape(-1)])


def copy_of(t):
    """A copy of t whose first element sits at the same offset from a 64-byte boundary (a clone
    would be aligned: a misaligned view must stay misaligned)."""
    if t.numel() == 0:
        return t.clone()
    shift = t.data_ptr() % 64 // t.element_size()
    copy = torch.empty(t.numel() + shift, dtype=t.dtype)[shift:].view(t.shape)
    assert copy.data_ptr() % 64 == t.data_ptr() % 64
    return copy.copy_(t)


def both_steps(emu, lists, coefs, rule, **options):
    """The step on copies of lists by the emulated CUDA op and by the CPU op: ((lists, rows), (lists, rows))."""
    results = []
    for op in (emu.multi_tensor_optim_step_, torch.ops.gradfuse.multi_tensor_optim_step_):
        copies = [[copy_of(t) for t in lst] for lst in lists]
        rows = op(*copies, coefs, rule, 0, **options)
        results.append((copies, rows))
    return results


def assert_same_step(emu, lists, coefs, rule, what, **options):
    """The emulated step equal to the CPU kernels' (lists bit for bit, rows within the summation
    order's rounding); returns the emulated (lists, rows)."""
    (got, rows), (want, want_rows) = both_steps(emu, lists, coefs, rule, **options)
    names = ("params", "grads", "moment1", "moment2", "moment2_max")
    for name, g_list, w_list in zip(names, got, want):
        for i, (g, w) in enumerate(zip(g_list, w_list)):
            assert same_bits(g, w), f"{what}: {name}[{i}]: {int((g != w).sum())} of {g.numel()} differ"
    f, c = rows
    wf, wc = want_rows
    assert f.shape == wf.shape and c.shape == wc.shape, what
    assert f.dtype == torch.float64 and c.dtype == torch.long, what
    assert torch.equal(c, wc), f"{what}: counts\n{c}\n{wc}"
    dtype = lists[0][0].dtype if lists[0] else torch.float32
    torch.testing.assert_close(f, wf, rtol=CPU_RTOL[dtype], atol=0, equal_nan=True, msg=what + " (CPU op's rows)")
    if f.shape[0]:  # the sums of the weight and (where written) of the update, in float64 from their terms
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        columns = [1]
        own = [[float((w.double() ** 2).sum())] for w in lists[0]]
        if options.get("write", True) and not skipped(options):
            columns = [0, 1]
            own = [[float(((a.to(acc) - w.to(acc)).double() ** 2).sum()), *o] for a, w, o in zip(got[0], lists[0], own)]
        torch.testing.assert_close(f[:, columns], torch.tensor(own, dtype=torch.float64), rtol=OWN_RTOL[dtype], atol=0,
                                   equal_nan=True, msg=what + " (float64 sums of its terms)")
    return got, rows


def skipped(options):
    flag = options.get("skip")
    return flag is not None and bool(flag.double().reshape(()) != 0)


def changed(before, after):
    return sum(int((b != a).sum()) for b, a in zip(before, after))


def assert_moved(before, after, what):
    """The step changed weights (most of them in 32 and 64 bits; in 16, where the update is above
    half an ulp of the weight) and its moments: there was something to compare."""
    params = before[0]
    total = sum(p.numel() for p in params)
    wide = params[0].element_size() >= 4
    assert changed(params, after[0]) > (0.3 * total if wide else 0), what
    for name, b, a in zip(("moment1", "moment2"), before[2:], after[2:]):
        present = sum(t.numel() for t in b)  # (in 16 bits v * beta2 may round back to v)
        if present:
            assert changed(b, a) > (0.3 * present if name == "moment1" else 0), f"{what}: {name}"


# ---- The grid


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_step_grid(emu, dtype, config):
    params = grid_params(dtype)
    state = state_of(config, params, dtype)
    coefs, rule = coefs_of(config, len(params))
    lists = [params, *state]
    assert sum(p.data_ptr() % 16 != 0 for p in params) == 2  # the misaligned views
    got, (f, c) = assert_same_step(emu, lists, coefs, rule, config, stats=True)
    assert_moved(lists, got, config)
    assert c[:, 4].tolist() == [p.numel() for p in params]
    assert bool((f[[p.numel() >= 999 for p in params], 0] > 0).all())  # the large tensors moved
    if CONFIGS[config][0] == "sgd" and CONFIGS[config][1].get("momentum"):
        assert int((f[:, 2] > 0).sum()) == sum(p.numel() > 0 for p in params)  # the buffer's sums
    if config == "adam_eps_dominated":
        assert c[:, 3].sum() > 1000
    # the step without statistics writes the same
    got_plain, (f0, c0) = assert_same_step(emu, lists, coefs, rule, config + " (no stats)")
    assert f0.shape == (0, 4) and c0.shape == (0, 5)
    for a, b in zip(got, got_plain):
        assert all(same_bits(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("config", ["sgd_nesterov_wd_maximize", "sgd_momentum_first", "sgd", "adamw_amsgrad",
                                    "adam_first", "adam_l2_maximize"])
def test_step_nonfinite(emu, dtype, config):
    params = [plant(p, i) if p.numel() > 8 else p for i, p in enumerate(grid_params(dtype, seed=5))]
    state = state_of(config, params, dtype, seed=5, plant_values=True)
    coefs, rule = coefs_of(config, len(params))
    _, (f, c) = assert_same_step(emu, [params, *state], coefs, rule, config, stats=True)
    assert c[:, 0].sum() > 10 and c[:, 1].sum() > 10
    if CONFIGS[config][3]:
        assert c[:, 2].sum() > 10
    assert f[:, 0].isnan().sum() > 3


# The options of the op, each run with its statistics rows and without.
OPTIONS = {
    "scale": dict(grad_scale=torch.tensor(0.37)),
    "scale_float64_one": dict(grad_scale=torch.tensor([[1.0]], dtype=torch.float64)),
    "scale_bf16": dict(grad_scale=torch.tensor(1 / 1024, dtype=torch.bfloat16)),
    "not_skipped": dict(skip=torch.tensor(0.0)),
    "coefs": dict(update_coefs="mixed"),
    "scale_coefs": dict(grad_scale=torch.tensor(3.5, dtype=torch.float64), update_coefs="mixed"),
    "write_false": dict(write=False),
    "write_false_scale_coefs": dict(write=False, grad_scale=torch.tensor(0.25), update_coefs="mixed"),
    "skipped": dict(skip=torch.tensor(1)),
    "skipped_nan": dict(skip=torch.tensor(math.nan)),
    "skipped_bool": dict(skip=torch.tensor([True]), update_coefs="mixed"),
    "scale_per_tensor": dict(grad_scale="per tensor"),
    "scale_per_tensor_coefs": dict(grad_scale="per tensor", update_coefs="mixed"),
}


def per_tensor_scales(n):
    """One gradient scale per tensor, 0.25 to 1.5, every fourth 1."""
    scales = 0.25 + torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 1.25
    scales[::4] = 1.0
    return scales


def mixed_coefs(n):
    coefs = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5
    coefs[1::4] = 1.0
    coefs[2 % n] = math.nan
    coefs[3 % n] = 0.0
    coefs[4 % n] = 0.5
    return coefs


@pytest.mark.parametrize("stats", [True, False], ids=["stats", "no_stats"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("config", ["sgd_nesterov_wd_maximize", "sgd_momentum_first", "sgd", "adam", "adamw_amsgrad"])
def test_step_options(emu, config, option, stats):
    dtype = torch.bfloat16 if "adam" in config else torch.float32
    params = grid_params(dtype, seed=11)
    state = state_of(config, params, dtype, seed=11)
    coefs, rule = coefs_of(config, len(params))
    options = dict(OPTIONS[option], stats=stats)
    if options.get("update_coefs") == "mixed":
        options["update_coefs"] = mixed_coefs(len(params))
    if options.get("grad_scale") == "per tensor":
        options["grad_scale"] = per_tensor_scales(len(params))
    got, (f, c) = assert_same_step(emu, [params, *state], coefs, rule, f"{config}, {option}", **options)
    if option.startswith(("skipped", "write_false")):
        for lst, before in zip(got, [params, *state]):
            assert all(same_bits(a, b) for a, b in zip(lst, before))
    else:
        assert_moved([params, *state], got, option)
    assert f.shape[0] == (len(params) if stats else 0)
    if stats:  # rows of the step, taken or not (the large tensors' coefficients are 0.25 to 1.2)
        assert bool((f[[p.numel() >= 999 for p in params], 0] > 0).all())
        assert torch.equal(c[:, 4], torch.tensor([p.numel() for p in params]))


@pytest.mark.parametrize("config", ["sgd_momentum", "adamw_amsgrad"])
def test_skipped_step_touches_no_memory(emu, dtype, config):
    """A nonzero skip flag, read on the device, without statistics: the kernels return before any
    access to the tensors, which lie on pages made unreadable while the op runs."""
    sizes = [1, 7, CHUNK + 1, 3 * CHUNK + 5, 1000]
    guarded = [cuda_emu.GuardedTensors(dtype, sizes, misalign=m) for m in (1, 0, 0, 0, 0)]
    lists = [list(g.tensors) for g in guarded]
    for t in lists[3] + lists[4]:
        t.abs_()
    present = CONFIGS[config][3]
    for k, name in ((2, "m"), (3, "v"), (4, "x")):
        if name not in present:
            lists[k] = [torch.empty(0, dtype=dtype)] * len(sizes)
    coefs, rule = coefs_of(config, len(sizes))
    before = [[t.clone() for t in lst] for lst in lists]
    with guarded[0].unreadable(), guarded[1].unreadable(), guarded[2].unreadable(), guarded[3].unreadable(), \
            guarded[4].unreadable():
        f, c = emu.multi_tensor_optim_step_(*lists, coefs, rule, 0, skip=torch.tensor(2.0))
    assert f.shape == (0, 4)
    for lst, b in zip(lists, before):
        assert all(same_bits(x, y) for x, y in zip(lst, b))
    # the same call unskipped does read and write them
    emu.multi_tensor_optim_step_(*lists, coefs, rule, 0, skip=torch.tensor(0.0))
    assert changed(before[0], lists[0]) > 0


@pytest.mark.parametrize("config", ["sgd_dampening_wd", "sgd_momentum_first", "adamw_amsgrad"])
def test_step_misaligned_lists(emu, dtype, config):
    # Each list misaligned on its own: the aligned path needs every list read or written aligned.
    params = [randn((n,), dtype, seed=n) for n in (CHUNK + 9, 4 * 8 + 3, 1000)]
    state = state_of(config, params, dtype)
    coefs, rule = coefs_of(config, len(params))
    for shifted in range(5):
        lists = [params, *state]
        lists[shifted] = misaligned_like(lists[shifted])
        assert_same_step(emu, lists, coefs, rule, f"{config}, list {shifted} misaligned", stats=True,
                         update_coefs=torch.tensor([0.5, 1.0, 0.75], dtype=torch.float64))


@pytest.mark.parametrize("count_of", ["small+1", "large+5"])
@pytest.mark.parametrize("config", ["sgd_momentum", "adamw_amsgrad"])
def test_step_several_launch_tables(emu, config, count_of):
    small, large = emu.list_table_sizes()
    count = {"small+1": small + 1, "large+5": 2 * large + 5}[count_of]
    sizes = [(1 + i % 9, 1 + i % 5) if i % 11 else (0, 3) for i in range(count)]
    sizes[5] = (3, CHUNK + 1)  # several chunks in the middle of a table
    params = [randn(s, torch.float32, seed=i) for i, s in enumerate(sizes)]
    state = state_of(config, params, torch.float32)
    coefs, rule = coefs_of(config, count)
    got, (f, c) = assert_same_step(emu, [params, *state], coefs, rule, f"{config}, {count} tensors", stats=True,
                                   update_coefs=mixed_coefs(count), grad_scale=torch.tensor(0.5))
    assert c[:, 4].tolist() == [p.numel() for p in params]


def test_step_empty_call_and_empty_tensors(emu):
    f, c = emu.multi_tensor_optim_step_([], [], [], [], [], torch.empty(0, NUM_STEP_COEFS, dtype=torch.float64),
                                        RULE_ADAM, 0, stats=True)
    assert f.shape == (0, 4) and c.shape == (0, 5)
    params = [torch.empty(0, 3), torch.empty(0)]
    empty = [torch.empty(0), torch.empty(0)]
    for config in ("adam", "sgd_momentum"):
        coefs, rule = coefs_of(config, 2)
        _, (f, c) = assert_same_step(emu, [params, [p.clone() for p in params], empty, empty, empty], coefs, rule,
                                     config, stats=True, skip=torch.tensor(0.0))
        assert torch.equal(f, torch.zeros(2, 4, dtype=torch.float64))
        assert torch.equal(c, torch.zeros(2, 5, dtype=torch.long))


def test_step_argument_checks(emu):
    """The emulated CUDA glue makes the checks of every backend (csrc/common/engine.h): the same
    message as the reference for each bad argument; and it takes no torch scalar tails."""
    params = [torch.randn(4, 5), torch.randn(3)]
    grads = [torch.randn(4, 5), torch.randn(3)]
    state = [[torch.randn(4, 5), torch.randn(3)] for _ in range(2)]
    empty = [torch.empty(0), torch.empty(0)]
    coefs, rule = coefs_of("adam", 2)
    good = (params, grads, *state, empty, coefs, rule)
    cases = {
        "Adam without moment2": ((params, grads, state[0], empty, empty, coefs, rule), {}),
        "coefs columns": ((params, grads, *state, empty, coefs[:, :7].contiguous(), rule), {}),
        "rule": ((params, grads, *state, empty, coefs, 3), {}),
        "grads shape": ((params, [grads[0], torch.randn(4)], *state, empty, coefs, rule), {}),
        "grad_scale elements": (good, dict(grad_scale=torch.ones(2))),
        "grad_scale dtype": (good, dict(grad_scale=torch.tensor(2))),
        "grad_scale length": (good, dict(grad_scale=torch.ones(3, dtype=torch.float64))),
        "skip elements": (good, dict(skip=torch.zeros(3))),
        "update_coefs dtype": (good, dict(update_coefs=torch.ones(2))),
        "update_coefs length": (good, dict(update_coefs=torch.ones(3, dtype=torch.float64))),
    }
    op = "multi_tensor_optim_step_"
    for case, (args, kwargs) in cases.items():
        with pytest.raises(RuntimeError) as want:
            step_reference.multi_tensor_optim_step_(*args[:7], 0, **kwargs)
        with pytest.raises(RuntimeError) as got:
            emu.multi_tensor_optim_step_(*args, 0, **kwargs)
        message = str(want.value).split(f"{op}: ", 1)[1]
        assert f"gradfuse_emu.{op}: {message}" in str(got.value), (case, str(got.value))
    with pytest.raises(RuntimeError, match="torch_threads must be 0"):
        emu.multi_tensor_optim_step_(*good, 4)


# ---- Reruns


def test_reverse_schedule_runs_blocks_and_threads_from_the_last():
    """What test_step_grid_in_reverse_schedule relies on: with one worker, the threads of a grid
    start in thread order, block after block, and in the opposite order under
    CUDA_EMU_SCHEDULE=reverse."""
    script = ("import sys, torch; sys.path.insert(0, 'tests'); import cuda_emu; "
              "print(cuda_emu.load().selftest('arrival_order').tolist())")
    orders = []
    for schedule in ("forward", "reverse"):
        env = dict(os.environ, CUDA_EMU_THREADS="1", CUDA_EMU_SCHEDULE=schedule)
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              cwd=cuda_emu.ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        orders.append(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))
    assert orders[0] == list(range(3 * 64))
    assert orders[1] == list(range(3 * 64))[::-1]



@pytest.mark.skipif(RERUN, reason="this is a rerun")
def test_step_grid_with_fma_contraction():
    """The grid again with the emulated backend built with -mfma -ffp-contract=fast (nvcc's
    default contraction): the weights and state still the CPU kernels' bits."""
    rerun_with_fma(__file__, "test_step_grid or test_step_options")


@pytest.mark.skipif(RERUN, reason="this is a rerun")
def test_step_grid_in_reverse_schedule():
    """The grid again with the blocks of each launch and the threads of each block run from the
    last down: the same bits, the same rows."""
    rerun_reversed(__file__, "test_step_grid or test_step_several_launch_tables or test_step_nonfinite")


@pytest.mark.skipif(RERUN, reason="this is a rerun")
def test_step_grid_under_sanitizers():
    """This file again with the emulated backend built with -fsanitize=address,undefined."""
    rerun_under_sanitizers(__file__, timeout=2400)
