"""Communication of one step's total norm / clip on FSDP2-sharded GPT-2-small gradients (148
DTensor gradients, Shard(0) over 2 gloo ranks on CPU): collectives and bytes per call, for
gradfuse and torch.nn.utils. Counts, not times: these do not depend on the machine's load.

    python benchmarks/fsdp2_comm.py [--world 2] [--layers 12]

Functional collectives (c10d_functional.all_reduce, what torch's FSDP2 clip test counts) are
counted by CommDebugMode (their sizes by a dispatch mode, where it sees them); torch.distributed
.all_reduce calls by a wrapper. Bytes: the all-reduced tensors' sizes, per rank.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gradfuse


class _Functional(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().endswith("c10d_functional::all_reduce"):
            self.log.append(("functional", args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


def _measure(fn):
    log = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        log.append(("c10d", tensor.numel() * tensor.element_size()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    from torch.distributed.tensor.debug import CommDebugMode
    try:
        with CommDebugMode() as comm_mode, _Functional(log):
            fn()
    finally:
        dist.all_reduce = real
    return log, comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]


def _worker(rank, world, init_file, layers, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import gradfuse
    from gradfuse.demo import workloads as wl
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    params = []
    for _name, shape in wl.gpt2_small(layers=layers):
        local = torch.empty(shape).chunk(world, dim=0)[rank] if shape[0] >= world else torch.empty(0)
        grad = torch.randn(local.shape, generator=g)
        p = nn.Parameter(DTensor.from_local(torch.zeros(local.shape), mesh, [Shard(0)],
                                            run_check=False, shape=torch.Size(shape),
                                            stride=torch.empty(shape).stride()))
        p.grad = DTensor.from_local(grad, mesh, [Shard(0)], run_check=False,
                                    shape=torch.Size(shape), stride=torch.empty(shape).stride())
        params.append(p)
    monitor = gradfuse.GradMonitor(params, max_norm=math.inf, every=0, on_nonfinite="skip")
    cases = {
        "torch.nn.utils.clip_grad_norm_": lambda: nn.utils.clip_grad_norm_(params, 1e9, foreach=True),
        "gradfuse.clip_grad_norm_": lambda: gradfuse.clip_grad_norm_(params, 1e9),
        "gradfuse.get_total_norm": lambda: gradfuse.get_total_norm([p.grad for p in params]),
        "GradMonitor.step() (quiet step, nonfinite policy, clip)": lambda: monitor.step(),
        "gradfuse.clip_ (per-parameter rows)": lambda: gradfuse.clip_(params, 1e9),
        "gradfuse.stats (per-parameter rows)": lambda: gradfuse.stats(params),
    }
    rows = []
    for name, fn in cases.items():
        fn()  # warm
        log, functional = _measure(fn)
        c10d = [b for k, b in log if k == "c10d"]
        seen = [b for k, b in log if k == "functional"]
        size = f"{sum(c10d) + sum(seen)}" if len(seen) == functional else "one scalar each"
        rows.append(f"| {name} | {functional} | {len(c10d)} | {size} |")
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(rows) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows")
        mp.spawn(_worker, args=(args.world, os.path.join(d, "init"), args.layers, out),
                 nprocs=args.world, join=True)
        print(f"GPT-2-small shapes ({args.layers} layers), Shard(0) over {args.world} gloo ranks, "
              f"torch {torch.__version__}\n")
        print("| call | c10d_functional.all_reduce (CommDebugMode) | torch.distributed.all_reduce | bytes per rank |\n"
              "|---|---:|---:|---:|")
        print(open(out).read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
