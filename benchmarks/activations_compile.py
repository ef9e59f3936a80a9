"""What happens when the monitor watches the activations of a module that runs through a
``torch.compile`` wrapper it was not told about (``cmodel = torch.compile(model)``, the monitor
gets ``model``): counts dynamo's graphs and recompilations over sampled and unsampled steps.
(A compiled module handed to the monitor itself is refused; see README, "Activations").

    python benchmarks/activations_compile.py [--steps 8]

Slow on a shared CPU (the first compile takes minutes); not part of the test suite.
"""
from __future__ import annotations

import argparse
import time

from torch import nn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    import torch._dynamo
    from torch._dynamo.utils import counters

    import gradfuse
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradfuse.GradMonitor(model, every=2, activations=True)
    start = time.perf_counter()
    for step in range(args.steps):
        compiled(torch.randn(5, 8)).sum().backward()
        report = mon.step()
        rows = len(report.activations.forward) if report.activations is not None else 0
        print(f"step {step}: sampled={report.activations is not None} rows={rows} "
              f"graphs={counters['stats'].get('unique_graphs', 0)} "
              f"recompiles={sum(counters['recompiles'].values()) if 'recompiles' in counters else 0} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        opt.step()
        opt.zero_grad()
    print("graph breaks:", sum(counters["graph_break"].values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
