"""PrometheusSink's clip metrics, and the Grafana dashboard shipped in the package: every metric
its PromQL queries name is one the sink exposes (scraped from its registry)."""
import json
import re

import pytest
import torch
from torch import nn

prom = pytest.importorskip("prometheus_client")

from gradfuse import GradMonitor, PrometheusSink  # noqa: E402
from gradfuse.sinks import grafana_dashboard_path  # noqa: E402


def scrape(registry) -> dict:
    """Sample name (+ labels) -> value, as a Prometheus server would read them."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def run_monitor(registry, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mon = GradMonitor(model, max_norm=1e-3, every=2, explode_threshold=1e6, sinks=[PrometheusSink(registry)])
    for i in range(steps):
        model.zero_grad()
        (model(torch.randn(3, 4)).square().mean() * (1e9 if i == 1 else 1.0)).backward()
        mon.step()
    mon.close()
    return mon


def test_clip_events_exported():
    registry = prom.CollectorRegistry()
    mon = run_monitor(registry)
    got = scrape(registry)
    assert got[("gradfuse_steps_total", ())] == 4
    assert got[("gradfuse_clipped_steps_total", ())] == mon.clipped_steps == 3  # step 1 was skipped
    assert got[("gradfuse_clipped", ())] == 1.0
    assert got[("gradfuse_max_norm", ())] == 1e-3
    assert 0 < got[("gradfuse_clip_coef", ())] < 1
    assert got[("gradfuse_anomalies_total", (("kind", "explode"),))] == 1


def test_optimizer_statistics_and_update_clipping_exported():
    registry = prom.CollectorRegistry()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mon = GradMonitor(model, every=1, update_ratios=opt, max_update_rms=1e-3, sinks=[PrometheusSink(registry)])
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        mon.step()
        opt.step()
    got = scrape(registry)
    assert got[("gradfuse_update_clipped_steps_total", ())] == 2
    for layer in ("0", "2"):
        assert 0 < got[("gradfuse_layer_update_rms", (("layer", layer),))] <= 1e-3 * (1 + 1e-9)
        assert got[("gradfuse_layer_moment2_rms", (("layer", layer),))] > 0
        assert got[("gradfuse_layer_update_nonfinite", (("layer", layer),))] == 0


def promql_metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: identifiers that are not functions, aggregation
    keywords, label names in by/without (...), or inside {...} / [...]."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("("):  # a function or an aggregation
            continue
        if m.group() in {"by", "without", "and", "or", "unless", "bool", "offset"}:
            continue
        names.add(m.group())
    return names


def test_dashboard_queries_name_only_exposed_metrics():
    with open(grafana_dashboard_path()) as f:
        dash = json.load(f)
    registry = prom.CollectorRegistry()
    run_monitor(registry)
    exposed = {name for name, _labels in scrape(registry)}
    text = prom.generate_latest(registry).decode()
    assert exposed == {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    queried, kinds = set(), {}
    for panel in dash["panels"]:
        kinds[panel["title"]] = panel["type"]
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names, target["expr"]
            queried |= names
    assert queried <= exposed, queried - exposed
    assert {"gradfuse_total_norm", "gradfuse_clipped_steps_total", "gradfuse_layer_l2",
            "gradfuse_anomalies_total"} <= queried
    assert kinds["Gradient L2 norm per layer"] == "heatmap"
    assert promql_metric_names("sum by (layer) (increase(gradfuse_x_total[5m]))") == {"gradfuse_x_total"}


def test_dashboard_is_package_data():
    # MANIFEST.in carries it into the sdist (and so, as package data, into the wheel)
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    manifest = (root / "MANIFEST.in").read_text()
    dashboard = Path(grafana_dashboard_path())
    assert dashboard.is_file()
    assert f"include {dashboard.relative_to(root).as_posix()}" in manifest


def test_a_registry_raising_inside_write_is_counted_not_raised():
    registry = prom.CollectorRegistry()
    sink = PrometheusSink(registry)

    class Broken:
        def set(self, value):
            raise RuntimeError("pushgateway gone")

    sink.total_norm = Broken()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    mon = GradMonitor(model, every=1, sinks=[sink])
    with pytest.warns(RuntimeWarning, match="failed to write"):
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            assert not mon.step().skip
    assert mon.dropped_records == 3
