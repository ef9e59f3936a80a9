"""gradfuse against clip_grad_norm_, the hook/loop approach, the best plain-PyTorch statistics,
and the memory system (read and copy of the same number of bytes), per workload and dtype.

Run: pytest benchmarks --benchmark-only --benchmark-json=bench.json  (then summarize.py)
"""
import torch
from conftest import sync
from methods import METHODS, grad_bytes


def _timed(benchmark, device, fn, rounds=None, setup=None):
    def run():
        fn()
        sync(device)
    if setup is None:
        benchmark.pedantic(run, rounds=rounds or 7, warmup_rounds=1, iterations=1)
    else:
        def prepare():
            setup()
            sync(device)
        benchmark.pedantic(run, setup=prepare, rounds=rounds or 7, warmup_rounds=1)


def _rounds(named, method):
    # The per-parameter Python loops are slow on big sets: fewer rounds keep the run short.
    heavy = method in ("hook_loop", "torch_clip_loop") and len(named) > 1000
    if heavy or grad_bytes(named) > 2**32:
        return 3
    on_gpu = named[0][1].grad.is_cuda
    if on_gpu and grad_bytes(named) < 2**30:
        return 50  # GPU timings are short and noisy
    return 25 if grad_bytes(named) < 2**24 else 7  # so are those of small sets on the CPU


def test_method(benchmark, named_grads, workload, dtype_name, method, device):
    factory, traffic, what = METHODS[method]
    n_bytes = grad_bytes(named_grads)
    benchmark.group = f"{workload}-{dtype_name}"
    benchmark.extra_info.update(workload=workload, dtype=dtype_name, method=method,
                                bytes=n_bytes * traffic, grad_bytes=n_bytes, tensors=len(named_grads),
                                device=str(device), what=what)
    if method == "gradfuse_clip_clipping":
        import gradfuse
        grads = [p.grad for _, p in named_grads]
        max_norm = 0.5 * float(gradfuse.stats(named_grads).total_norm)
        # Each round clips to max_norm; the untimed setup doubles the gradients back, so every
        # timed call needs clipping (coefficient 0.5) and values never drift towards denormals.
        gradfuse.clip_(named_grads, max_norm)
        _timed(benchmark, device, lambda: gradfuse.clip_(named_grads, max_norm),
               rounds=_rounds(named_grads, method), setup=lambda: torch._foreach_mul_(grads, 2.0))
        return
    _timed(benchmark, device, factory(named_grads), rounds=_rounds(named_grads, method))
