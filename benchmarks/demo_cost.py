"""What the demo's training run costs now against an earlier version of gradfuse/demo.py (by
default the one before the exponent heatmap and the noise scale were added: 2 accumulated
micro-batches per step, histogram=True, noise_scale): both run in this process against the same
gradfuse, alternately, without the timing table (timing=False), and the medians of wall and CPU
time (all threads) are compared.

    .venv/bin/python benchmarks/demo_cost.py [--rev 99858b3] [--steps 200] [--rounds 3] [--threads N]

On a loaded machine use --threads 1: with 2 threads each of the demo's small ops waits at an
OpenMP barrier for a descheduled thread, and that wait, not the work, is then what is timed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_demo(rev: str | None):
    """gradfuse.demo as in the working tree (rev None) or as of commit ``rev``."""
    if rev is None:
        import gradfuse.demo
        return gradfuse.demo
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:gradfuse/demo.py"],
                            capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"demo_{rev}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"demo_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="99858b3", help="the earlier demo's commit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    demos = {f"demo.py at {args.rev}": load_demo(args.rev), "demo.py now": load_demo(None)}
    times = {name: [] for name in demos}
    for r in range(args.rounds):
        for name, demo in (demos.items() if r % 2 == 0 else reversed(demos.items())):
            with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
                wall, cpu = time.perf_counter(), time.process_time()
                demo.run(steps=args.steps, out_dir=out, timing=False)
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"demo training run, {args.steps} steps, timing=False (pictures included), "
          f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds; medians:")
    base = None
    for name, ts in times.items():
        wall = statistics.median(t[0] for t in ts)
        cpu = statistics.median(t[1] for t in ts)
        base = base or (wall, cpu)
        print(f"  {name:<24} wall {wall:6.1f} s ({wall / base[0]:.2f}x)   CPU {cpu:6.1f} s ({cpu / base[1]:.2f}x)"
              f"   [runs: {', '.join(f'{t[0]:.1f}' for t in ts)} s wall]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
