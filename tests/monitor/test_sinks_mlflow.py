"""MLflowSink against a real local MLflow store (sqlite in tmp_path, no server), read back with
MlflowClient: metric history per key and step, params, tags, artifacts."""
import math

import pytest
import torch
from torch import nn

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("matplotlib")
from helpers import ListSink  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from gradfuse import GradMonitor, MLflowSink  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    exp = client.create_experiment("gradfuse", artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, client, exp


def test_metrics_params_tags_and_figures(store):
    uri, client, exp = store
    run = client.create_run(exp)
    run_id = run.info.run_id
    model = make_model()
    keep = ListSink()
    records = keep.records

    mon = GradMonitor(model, max_norm=1e-3, every=2, explode_threshold=1e6,
                      sinks=[MLflowSink(run_id, tracking_uri=uri, images_every=2), keep])
    for i in range(6):
        model.zero_grad()
        loss = model(torch.randn(3, 4)).square().mean()
        (loss * (1e9 if i == 3 else 1.0)).backward()  # step 3 explodes: skipped, logged as an event
        mon.step()
    mon.close()
    steps = sorted({r["step"] for r in records})
    assert steps == [0, 2, 3, 4, 5]

    history = client.get_metric_history(run_id, "grad/total_norm")
    assert sorted(m.step for m in history) == steps
    by_step = {m.step: m.value for m in history}
    for r in records:
        assert math.isclose(by_step[r["step"]], r["total_norm"], rel_tol=1e-12)
    for layer in records[0]["layers"]:
        h = client.get_metric_history(run_id, f"grad_l2/{layer}")
        assert sorted(m.step for m in h) == steps
    clipped = client.get_metric_history(run_id, "grad/clipped_steps")
    assert max(m.value for m in clipped) == records[-1]["counters"]["clipped_steps"] > 0

    data = client.get_run(run_id).data
    assert data.params["gradfuse.max_norm"] == "0.001"
    assert data.params["gradfuse.every"] == "2"
    assert data.params["gradfuse.explode_threshold"] == "1000000.0"
    assert data.tags["gradfuse.start_step"] == "0"
    assert data.tags["gradfuse.last_anomaly"] == "explode"
    assert data.tags["gradfuse.last_anomaly_step"] == "3"
    assert "explode" in data.tags["gradfuse.last_anomaly_message"]
    assert data.tags["gradfuse.anomalies.explode"] == "1"

    # pictures at the 2nd and 4th logged step (2, 4) and on close for the step after them (5)
    arts = sorted(a.path for a in client.list_artifacts(run_id, "gradfuse"))
    assert arts == [f"gradfuse/grad_gradflow_step{s:08d}.png" for s in (2, 4, 5)]
    local = client.download_artifacts(run_id, arts[0])
    with open(local, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_active_run_and_keys_mlflow_refuses(store):
    uri, client, exp = store
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as active:
        sink = MLflowSink()
        assert sink.run_id == active.info.run_id
        sink.write({"step": 7, "total_norm": 2.0, "nonfinite": False, "skipped": False, "clip_coef": None,
                    "anomalies": [], "message": "", "layers": {"(root)": {"l2": 1.5, "zero_fraction": 0.0,
                                                                          "nan_count": 0, "inf_count": 0}}})
    h = client.get_metric_history(active.info.run_id, "grad_l2/_root_")
    assert [(m.step, m.value) for m in h] == [(7, 1.5)]


def test_no_active_run_is_an_error_at_construction(store):
    mlflow.set_tracking_uri(store[0])
    assert mlflow.active_run() is None
    with pytest.raises(ValueError, match="start_run"):
        MLflowSink()


def test_a_tracker_raising_inside_write_is_counted_not_raised(store, monkeypatch):
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id
    sink = MLflowSink(run_id, tracking_uri=uri)

    def down(*a, **k):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(sink.client, "log_batch", down)
    model = make_model()
    mon = GradMonitor(model, every=1, sinks=[sink])
    with pytest.warns(RuntimeWarning, match="failed to start"):
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            assert not mon.step().skip
    health = mon.sink_health()[0]
    assert mon.dropped_records == 3 and health["written"] == 0
    assert "ConnectionError" in health["last_error"]
