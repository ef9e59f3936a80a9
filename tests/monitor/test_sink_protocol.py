"""The ``Sink`` protocol: every shipped sink satisfies it, a class with only ``write`` does too and
the monitor uses it, the optional methods are called as the protocol says (``last_step`` and
``on_start`` once at the first step, ``write`` per record, ``close`` once at the end), and
``gradfuse.Sink``, ``gradfuse.sinks.Sink`` and ``gradfuse.monitor.sinks.Sink`` are one class."""
import warnings

import pytest
import torch
from torch import nn

import gradfuse
import gradfuse.monitor.sinks
from gradfuse import GradMonitor, Sink


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(mon, model, steps):
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        mon.step()


class OnlyWrite:
    def __init__(self):
        self.steps = []

    def write(self, record):
        self.steps.append(record["step"])


class FakeLogger:
    def log(self, metrics, step):
        pass


class FakeWriter:
    def add_scalar(self, *args, **kwargs):
        pass

    def flush(self):
        pass


def shipped_sinks(tmp_path) -> dict:
    """One of every sink gradfuse ships that is made without a tracker's server or run (all but
    ``MLflowSink``; ``PrometheusSink`` when prometheus_client is installed)."""
    sinks = {
        "JsonlSink": gradfuse.JsonlSink(tmp_path / "run.jsonl"),
        "LoggingSink": gradfuse.LoggingSink(),
        "MetricsSink": gradfuse.MetricsSink(FakeLogger()),
        "TensorBoardSink": gradfuse.TensorBoardSink(FakeWriter()),
        "WandbSink": gradfuse.WandbSink(FakeLogger()),
    }
    try:
        import prometheus_client
    except ImportError:
        pass
    else:
        sinks["PrometheusSink"] = gradfuse.PrometheusSink(prometheus_client.CollectorRegistry())
    return sinks


def test_one_protocol_under_every_public_path():
    assert gradfuse.Sink is gradfuse.sinks.Sink is gradfuse.monitor.sinks.Sink
    assert "Sink" in gradfuse.__all__ and "Sink" in gradfuse.sinks.__all__


def test_every_shipped_sink_is_a_sink(tmp_path):
    sinks = shipped_sinks(tmp_path)
    for name, sink in sinks.items():
        assert isinstance(sink, Sink), name
    sinks["JsonlSink"].close()
    shipped = {n for n in gradfuse.sinks.__all__ if n.endswith("Sink") and n != "Sink"}
    assert shipped - set(sinks) <= {"PrometheusSink", "MLflowSink"}
    for name in shipped:  # every class, made above or not; none inherits from the protocol
        cls = getattr(gradfuse.sinks, name)
        assert issubclass(cls, Sink) and Sink not in cls.__mro__, name


def test_the_integrations_sink_is_a_sink():
    pytest.importorskip("lightning")
    from gradfuse.integrations.lightning import LightningLoggerSink
    assert issubclass(LightningLoggerSink, Sink)


def test_a_class_with_only_write_is_a_sink_and_the_monitor_uses_it():
    sink = OnlyWrite()
    assert isinstance(sink, Sink)
    model = make_model()
    mon = GradMonitor(model, every=2, sinks=[sink])
    train(mon, model, 5)
    mon.close()  # no close() on the sink: nothing to call, nothing raised
    assert sink.steps == [0, 2, 4]
    assert mon.sink_health()[0]["written"] == 3 and mon.dropped_records == 0


def test_objects_without_write_are_not_sinks():
    assert not isinstance(object(), Sink)
    assert not isinstance(FakeLogger(), Sink)


def test_the_optional_methods_are_called_as_documented():
    calls = []

    class Full:
        def last_step(self):
            calls.append("last_step")
            return None

        def on_start(self, config):
            calls.append(("on_start", config["start_step"], config["every"]))

        def write(self, record):
            calls.append(("write", record["step"]))

        def close(self):
            calls.append("close")

    model = make_model()
    mon = GradMonitor(model, every=2, start_step=10, sinks=[Full()])
    train(mon, model, 4)  # steps 10 .. 13: 10 and 12 logged
    mon.close()           # logs the last step, 13, then closes the sinks
    assert calls == ["last_step", ("on_start", 10, 2), ("write", 10), ("write", 12), ("write", 13), "close"]


def test_a_failing_on_start_and_close_count_as_failures_not_drops():
    class Fragile(OnlyWrite):
        def on_start(self, config):
            raise RuntimeError("tracker down")

        def close(self):
            raise OSError("already closed")

    sink = Fragile()
    model = make_model()
    mon = GradMonitor(model, every=1, sinks=[sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(mon, model, 3)
        mon.close()
    assert sink.steps == [0, 1, 2]  # the records went through
    health = mon.sink_health()[0]
    assert health["dropped"] == 0 and mon.dropped_records == 0
    assert health["last_error"] == "OSError: already closed"
    assert len([w for w in caught if "Fragile failed" in str(w.message)]) == 1  # once per sink
