"""gradfuse.optim's step against torch's own, bit for bit: every variant of SGD, Adam and AdamW,
float32 / bfloat16 / float16 / float64, several steps from no state, tensors of odd sizes and
sizes that torch splits across threads; weights and state compared bit for bit after every step."""
import pytest
import torch

import gradfuse.optim

SIZES = [(1,), (7,), (33,), (5, 201), (70001,), (3, 65536 + 17)]

CONFIGS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    ("SGD", dict(lr=0.01, weight_decay=0.1, maximize=True)),
    ("Adam", dict(lr=1e-3)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)),
    ("Adam", dict(lr=1e-3, amsgrad=True, maximize=True)),
    ("Adam", dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    ("AdamW", dict(lr=1e-3)),
    ("AdamW", dict(lr=3e-3, weight_decay=0.05, amsgrad=True)),
    ("AdamW", dict(lr=torch.tensor(2e-3), weight_decay=0.1)),
    ("SGD", dict(lr=torch.tensor(0.03), momentum=0.9)),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SIZES]


def _grads(params, step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(dtype) for p in params]


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, where a NaN equals any NaN: torch's own loops differ in the NaN bits they
    make (its vector `maximum` gives an all-ones NaN, its scalar one the canonical quiet NaN), so
    only NaN-ness is compared there (torch.equal says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype not in _BITS:
        return torch.equal(a, b)
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    bits = _BITS[a.dtype]
    return torch.equal(a.contiguous().view(bits)[~nan_a], b.contiguous().view(bits)[~nan_b])


def _state_tensors(opt, params):
    out = []
    for p in params:
        for k, v in sorted(opt.state[p].items()):
            out.append((k, v))
    return out


def _run(name, kwargs, dtype, steps=3, threads=None):
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ref = [p.clone().requires_grad_() for p in _params(dtype)]
    ours = [p.clone().requires_grad_() for p in _params(dtype)]
    torch_opt = getattr(torch.optim, name)(ref, **{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                   for k, v in kwargs.items()})
    fused_opt = getattr(gradfuse.optim, name)(ours, **kw)
    for step in range(steps):
        for ps in (ref, ours):
            for p, g in zip(ps, _grads(ps, step, dtype)):
                p.grad = g
        before = [p.detach().clone() for p in ref]
        torch_opt.step()
        fused_opt.step()
        moved = sum(int((p.detach() != b).sum()) for p, b in zip(ref, before))
        # the step changed weights (in 16 bits, those whose ulp is small enough)
        assert moved > 0.05 * sum(p.numel() for p in ref)
        for i, (a, b) in enumerate(zip(ref, ours)):
            assert same_bits(a.detach(), b.detach()), (step, i, (a.detach() != b.detach()).sum().item())
        sa, sb = _state_tensors(torch_opt, ref), _state_tensors(fused_opt, ours)
        assert [k for k, _ in sa] == [k for k, _ in sb]
        for (k, a), (_, b) in zip(sa, sb):
            assert same_bits(a, b), (step, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name, kwargs", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_step_is_torchs_bit_for_bit(name, kwargs, dtype):
    _run(name, kwargs, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_sgd_follows_torchs_thread_split(threads, dtype):
    """A 16-bit `add` with alpha rounds differently in torch's scalar tails, which move with its
    thread count; the step follows them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _run("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02), dtype, steps=2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name, kwargs", [CONFIGS[3], CONFIGS[10]], ids=["SGD-nesterov", "AdamW-amsgrad"])
def test_both_cpu_kernel_builds(name, kwargs, dtype, cpu_capability):
    _run(name, kwargs, dtype, steps=2)


def _wide(shape, gen, dtype):
    """Values whose magnitudes span 2^-60 to 2^60, a few of them 0, inf and NaN."""
    exps = torch.randint(-60, 61, shape, generator=gen).to(torch.float64)
    signs = torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1
    x = signs * (1 + torch.rand(shape, generator=gen, dtype=torch.float64)) * torch.exp2(exps)
    flat = x.view(-1)
    flat[:: 97] = 0.0
    flat[5:: 389] = float("inf")
    flat[11:: 433] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.95), (0.9, 1 - 1e-9)], ids=["default", "short", "long"])
def test_adam_roots_across_the_exponent_range(dtype, betas):
    """Adam's root sqrt(v') / sqrt(1 - beta2^t) for v' across the float range, zeros, inf and NaN
    included: the vector loop's quotient (by the reciprocal, corrected) and its bfloat16 roundings
    are torch's division and roundings bit for bit."""
    gen = torch.Generator().manual_seed(3)
    ref = [_wide((4099,), gen, dtype).requires_grad_()]
    ours = [ref[0].detach().clone().requires_grad_()]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, betas=betas, weight_decay=0.1)
    fused_opt = gradfuse.optim.AdamW(ours, lr=1e-3, betas=betas, weight_decay=0.1)
    for _ in range(3):
        g = _wide((4099,), gen, dtype)
        ref[0].grad, ours[0].grad = g, g.clone()
        torch_opt.step()
        fused_opt.step()
        v = torch_opt.state[ref[0]]["exp_avg_sq"]
        finite = v[v.isfinite() & (v > 0)].to(torch.float64)
        assert finite.numel() > 3000 and finite.max() / finite.min() > 2.0 ** 150  # the range was there
        assert same_bits(ref[0].detach(), ours[0].detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(torch_opt.state[ref[0]][key], fused_opt.state[ours[0]][key]), key
