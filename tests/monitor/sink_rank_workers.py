"""One rank of tests/monitor/test_sink_ranks.py: a GradMonitor with a JSONL sink and a
PrometheusSink per rank, under a 2-process gloo group."""
import torch
from gloo_checks import run_checks
from torch import nn

import gradfuse


def train(rank, out_dir, name, **kw):
    prom = __import__("prometheus_client")
    registry = prom.CollectorRegistry()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mon = gradfuse.GradMonitor(model, max_norm=1e-3, every=1, sinks=[
        gradfuse.JsonlSink(f"{out_dir}/{name}.rank{rank}.jsonl"), gradfuse.PrometheusSink(registry=registry)], **kw)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        mon.step()
    mon.close()
    with open(f"{out_dir}/{name}.rank{rank}.prom", "wb") as f:
        f.write(prom.generate_latest(registry))


def worker(rank, world, init_file, result_dir):
    run_checks(rank, world, init_file, result_dir, [
        ("default", lambda r, w: train(r, result_dir, "default")),
        ("all", lambda r, w: train(r, result_dir, "all", sink_ranks="all")),
        ("rank1", lambda r, w: train(r, result_dir, "rank1", sink_ranks=1)),
    ])
