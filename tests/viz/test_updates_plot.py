"""The optimizer-update picture of ``python -m gradfuse plot``: drawn beside the gradient flow
from a log of ``GradMonitor(update_ratios=...)``, one heatmap per statistic the log holds."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.monitor.sinks import read_jsonl

pytest.importorskip("matplotlib")


def _log(tmp_path, optimizer_cls, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = optimizer_cls(model.parameters(), **kwargs)
    path = tmp_path / "run.jsonl"
    mon = gradfuse.GradMonitor(model, max_norm=1.0, every=1, update_ratios=opt, sinks=[gradfuse.JsonlSink(path)])
    for _ in range(6):
        model(torch.randn(32, 8)).square().mean().backward()
        mon.step()
        opt.step()
        opt.zero_grad()
    mon.close()
    return path


@pytest.mark.parametrize("optimizer_cls, kwargs", [(torch.optim.AdamW, {"lr": 1e-2}),
                                                   (torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9})])
def test_plot_draws_updates_beside_the_gradient_flow(tmp_path, optimizer_cls, kwargs):
    from gradfuse.__main__ import main
    from gradfuse.viz.updates import update_figure, updates_path

    path = _log(tmp_path, optimizer_cls, **kwargs)
    records = read_jsonl(path)
    assert all(r["update_ratio"] and min(r["update_ratio"].values()) > 0 for r in records)  # something to draw
    out = tmp_path / "flow.png"
    assert main(["plot", str(path), "-o", str(out)]) == 0
    picture = tmp_path / "flow_updates.png"
    assert updates_path(out) == str(picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    fig = update_figure(records)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert any(t.startswith("update-to-weight ratio") for t in titles)
    assert any(t.startswith("RMS of the update") for t in titles)
    adam = optimizer_cls is torch.optim.AdamW  # the second-moment panels only where the log has them
    assert any(t.startswith("Adam: RMS of the bias-corrected root") for t in titles) == adam
    layers = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert layers == list(records[0]["update_ratio"])


def test_plot_updates_refuses_a_log_without_them(tmp_path):
    from gradfuse.viz.updates import plot_updates

    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 0, "total_norm": 1.0}\n')
    with pytest.raises(ValueError, match="no update records"):
        plot_updates(path, tmp_path / "u.png")
