"""TensorBoardSink: exponent histograms (of gradients, activations and activation gradients) and
pictures, read back from the event files with TensorBoard's own reader (EventAccumulator, every
histogram and image kept)."""
import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")
from helpers import ListSink
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from gradfuse import GradMonitor, TensorBoardSink  # noqa: E402
from gradfuse.monitor.figures import gradflow_figure  # noqa: E402
from gradfuse.sinks import exponent_buckets  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(mon, model, steps):
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        mon.step()
    mon.close()


def read_events(logdir):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.HISTOGRAMS: 0, event_accumulator.IMAGES: 0,
                                    event_accumulator.SCALARS: 0})
    acc.Reload()
    return acc


def test_exponent_buckets_on_the_log2_axis():
    # bin e+151 holds floor(log2|x|) == e; bin 1 (zeros) and the inf / nan bins are left out
    entry = {"first_bin": 1, "counts": [5] + [0] * (151 - 3 - 2) + [0, 2, 3]}  # bins 1 .. 151
    edges, counts = exponent_buckets(entry)
    assert counts == [2, 3] and edges == [-2, -1, 0]
    assert exponent_buckets({"first_bin": 280, "counts": [1, 1, 1]}) is None  # only inf / nan


def test_histograms_and_images_in_the_event_files(tmp_path):
    model = make_model()
    writer = SummaryWriter(str(tmp_path))
    keep = ListSink()
    records = keep.records

    mon = GradMonitor(model, max_norm=1e-3, every=2, histogram=True,
                      sinks=[TensorBoardSink(writer, images_every=2), keep])
    train(mon, model, 8)  # logs steps 0, 2, 4, 6 and on close step 7
    writer.close()
    logged = [r["step"] for r in records]
    assert logged == [0, 2, 4, 6, 7]
    acc = read_events(tmp_path)
    tags = acc.Tags()
    layers = list(records[0]["exponents"])
    assert sorted(tags["histograms"]) == sorted(f"grad_exponent/{layer}" for layer in layers)
    for layer in layers:
        events = acc.Histograms(f"grad_exponent/{layer}")
        assert [e.step for e in events] == logged
        for e, r in zip(events, records):
            edges, counts = exponent_buckets(r["exponents"][layer])
            h = e.histogram_value
            assert list(h.bucket_limit) == edges[1:]            # upper edges, in log2 units
            assert list(h.bucket) == counts
            assert h.num == sum(counts) and h.min == edges[0] and h.max == edges[-1]
            # the histogram holds every finite non-zero element of the layer
            numel = sum(p["numel"] for n, p in r["params"].items() if n.startswith(layer))
            zeros = round(r["layers"][layer]["zero_fraction"] * numel)
            assert h.num == numel - zeros
    # pictures every 2nd logged step (steps 2, 6) and once more on close (step 7)
    assert sorted(tags["images"]) == ["grad/exponents", "grad/gradflow"]
    for tag in ("grad/gradflow", "grad/exponents"):
        images = acc.Images(tag)
        assert [i.step for i in images] == [2, 6, 7]
        assert all(i.encoded_image_string.startswith(b"\x89PNG") and i.width > 100 for i in images)
    # the scalars on every logged step, beside the pictures
    assert [s.step for s in acc.Scalars("grad/total_norm")] == logged


def test_activation_exponent_histograms_in_the_event_files(tmp_path):
    model = make_model()
    writer = SummaryWriter(str(tmp_path))
    keep = ListSink()
    records = keep.records

    mon = GradMonitor(model, every=2, histogram=True, activations=True,
                      sinks=[TensorBoardSink(writer), keep])
    train(mon, model, 6)  # logs steps 0, 2, 4 (hooks armed for them) and on close step 5 (none)
    writer.close()
    logged = [r["step"] for r in records]
    assert logged == [0, 2, 4, 5]
    with_act = [r for r in records if "act_exponents" in r]
    assert [r["step"] for r in with_act] == [0, 2, 4]
    # elements per layer: a batch of 3 through Linear(4, 8), ReLU, Linear(8, 2); the model's
    # own output is the last Linear's
    numel = {"0": 3 * 8, "1": 3 * 8, "2": 3 * 2, "(root)": 3 * 2}
    acc = read_events(tmp_path)
    tags = acc.Tags()["histograms"]
    for key, prefix, stats in (("act_exponents", "activation_exponent", "act"),
                               ("act_grad_exponents", "activation_grad_exponent", "act_grad")):
        assert sorted(t for t in tags if t.startswith(prefix + "/")) == sorted(f"{prefix}/{layer}" for layer in numel)
        for layer, n in numel.items():
            events = acc.Histograms(f"{prefix}/{layer}")
            assert [e.step for e in events] == [0, 2, 4]
            for e, r in zip(events, with_act):
                agg = r[stats][layer]
                assert agg["numel"] == n
                edges, counts = exponent_buckets(r[key][layer])
                h = e.histogram_value
                assert list(h.bucket_limit) == edges[1:] and list(h.bucket) == counts
                assert h.min == edges[0] and h.max == edges[-1]
                # every finite non-zero element the layer's outputs (or their gradients) held
                assert 0 < h.num == sum(counts) == n - agg["zero_count"] - agg["nan_count"] - agg["inf_count"]
    assert any(r["act"]["1"]["zero_count"] for r in with_act)  # the ReLU's zeros are left out
    # the gradient histograms beside them, on every logged step
    assert [e.step for e in acc.Histograms("grad_exponent/0")] == logged
    assert sorted(t for t in tags if t.startswith("grad_exponent/")) == ["grad_exponent/0", "grad_exponent/2"]


def test_plain_sink_as_before_and_a_figure_fn(tmp_path):
    model = make_model()
    writer = SummaryWriter(str(tmp_path))
    seen = []

    def figure_fn(records):
        seen.append([r["step"] for r in records])
        assert all("params" not in r for r in records)  # the window keeps no per-parameter rows
        return gradflow_figure(records)

    mon = GradMonitor(model, every=1, sinks=[TensorBoardSink(writer), TensorBoardSink(
        SummaryWriter(str(tmp_path / "pics")), histograms=False, images_every=3, figure_fn=figure_fn, window=2)])
    train(mon, model, 6)
    writer.close()
    acc = read_events(tmp_path)
    assert acc.Tags()["histograms"] == [] and acc.Tags()["images"] == []  # histogram=False: none
    assert len(acc.Scalars("grad/total_norm")) == 6
    assert seen == [[1, 2], [4, 5]]  # the last `window` records, every 3rd logged step
    pics = read_events(tmp_path / "pics")
    assert [i.step for i in pics.Images("grad/gradflow")] == [2, 5]


def test_a_writer_that_raises_is_counted_not_raised(tmp_path):
    class Broken:
        def add_scalar(self, *a, **k):
            raise OSError("disk gone")

    model = make_model()
    mon = GradMonitor(model, every=1, sinks=[TensorBoardSink(Broken(), images_every=1)])
    with pytest.warns(RuntimeWarning, match="failed to write"):
        train(mon, model, 3)
    assert mon.dropped_records == 3
