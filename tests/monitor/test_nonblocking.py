"""The monitor that never blocks (``GradMonitor(blocking=False)``), checked on the CPU with the
sync guard counting reads of the step's tensors apart from reads of their host copies
(tests/sync_guard.py): a run with planted anomalies reads nothing of the step, skips on the
device, and gives the blocking monitor's records, warnings and dumps, one step later.

The fast clip of ``gradfuse.watch`` reads its 0-d coefficient where it lives on the CPU
(csrc/watch.cpp; on CUDA it reads nothing), so the guarded runs take the functional path, as
tests/core/test_no_sync.py does."""
import json
import math
import warnings

import pytest
import torch
from sync_guard import SyncGuard, as_on_an_accelerator
from torch import nn

import gradfuse
import gradfuse.optim
from gradfuse import FlightRecorder, GradMonitor, JsonlSink, load_dump

STEPS = 200
NAN_AT, EXPLODE_AT, SPIKE_AT = 60, 110, 160


class TinyTransformer(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (4, 9), generator=g) for _ in range(STEPS)]


def plant(model, step):
    """A NaN, an explosion (above explode_threshold) and a gradient spike (below it)."""
    grads = [p.grad for p in model.parameters()]
    if step == NAN_AT:
        grads[3].view(-1)[0] = math.nan
    elif step == EXPLODE_AT:
        torch._foreach_mul_(grads, 1e5)
    elif step == SPIKE_AT:
        torch._foreach_mul_(grads, 60.0)


def run(tmp_path, blocking: bool, optimizer_kind="gradfuse", guard=None, forward_nan=False, record_updates=False,
        **options):
    """``forward_nan``: the step's NaN enters in the forward (the head's input), not in a gradient;
    ``update_ratios="opt"``: those of the run's optimizer."""
    torch.manual_seed(0)
    model = TinyTransformer()
    if optimizer_kind == "gradfuse":
        opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if options.get("update_ratios") == "opt":
        options["update_ratios"] = opt
    log = tmp_path / f"run-{blocking}.jsonl"
    recorder = FlightRecorder(steps=16, window=32, warmup=20, dump_dir=tmp_path / f"dumps-{blocking}",
                              record_updates=record_updates)
    settings = dict(max_norm=1.0, every=10, on_nonfinite="skip", explode_threshold=1e3, on_explode="skip",
                    recorder=recorder, on_spike="dump", sinks=[JsonlSink(log)],
                    optimizer=opt if not blocking or options.get("fused_step") else None)
    monitor = GradMonitor(model, blocking=blocking, **{**settings, **options})
    reports, losses = [], []
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard if guard is not None else _nothing():
            for step, x in enumerate(data):
                nan_hook = (model.head.register_forward_pre_hook(lambda _m, args: (args[0] * math.nan,))
                            if forward_nan and step == NAN_AT else None)
                loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                if nan_hook is not None:
                    nan_hook.remove()
                loss.backward()
                plant(model, step)
                report = monitor.step(loss=loss.detach())
                if blocking and not report.skip:
                    opt.step()
                elif not blocking:
                    opt.step()  # the skip is applied on the device
                opt.zero_grad()
                reports.append(report)
                losses.append(loss.detach())
        monitor.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    messages = [str(w.message) for w in caught if "gradfuse step" in str(w.message)]
    return model, opt, monitor, reports, records, messages, recorder


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_blocking_read_and_the_blocking_monitors_results(tmp_path):
    guard = SyncGuard(allowed=None, host_copies=True)
    _, opt_b, mon_b, rep_b, rec_b, msg_b, recorder_b = run(tmp_path, blocking=True)
    model_n, opt_n, mon_n, rep_n, rec_n, msg_n, recorder_n = run(tmp_path, blocking=False, guard=guard)

    # nothing of the step was read; the host copies were, and gradfuse's ops ran under the guard
    assert guard.reads == []
    assert len(guard.copy_reads) >= STEPS and guard.saw_gradfuse_op()

    # the planted anomalies fired, and the same steps were skipped (on the device) or dumped
    skipped = [r.step for r in rep_b if r.skip]
    assert skipped == [NAN_AT, EXPLODE_AT]
    assert [r.step for r in rep_n if r.skip] == skipped
    assert all(r.settled for r in rep_n)
    assert [r.anomalies for r in rep_n] == [r.anomalies for r in rep_b]
    assert "spike" in rep_b[SPIKE_AT].anomalies and rep_b[SPIKE_AT].dump is not None

    # weights and optimizer state: bit for bit those of the run that did not take the steps
    for (_, a), (_, b) in zip(sorted(mon_b.source.named_parameters()), sorted(model_n.named_parameters())):
        assert torch.equal(a, b)
    sb, sn = opt_b.state_dict()["state"], opt_n.state_dict()["state"]
    assert len(sb) == len(sn) > 0
    for k in sb:
        assert all(torch.equal(sb[k][key], sn[k][key]) for key in sb[k])
    assert float(sb[0]["step"]) == STEPS - len(skipped)

    # the same records, in step order, and the same warnings and counters
    assert len(rec_b) > STEPS // 10 and [r["step"] for r in rec_n] == sorted(r["step"] for r in rec_n)
    assert_same_records(rec_b, rec_n)
    assert msg_b == msg_n and len(msg_b) >= 2
    assert mon_b.counters() == mon_n.counters() and mon_n.counters()["skipped_steps"] == 2

    assert_same_dumps(rep_b, rep_n)


def assert_same_dumps(rep_b, rep_n):
    """The same dumps: the ring as each anomalous step left it, and the same trigger."""
    assert any(r.dump is not None for r in rep_b)
    for rb, rn in zip(rep_b, rep_n, strict=True):
        assert (rb.dump is None) == (rn.dump is None)
        if rb.dump is not None:
            db, dn = load_dump(rb.dump), load_dump(rn.dump)
            hb, hn = ({k: v for k, v in d.header.items() if k != "created"} for d in (db, dn))
            assert json.dumps(hb, sort_keys=True) == json.dumps(hn, sort_keys=True)  # trigger, bands, step
            assert set(db.arrays) == set(dn.arrays) and len(db.arrays["steps"]) > 1
            for key in db.arrays:
                assert torch.equal(db.arrays[key].nan_to_num(7.0), dn.arrays[key].nan_to_num(7.0)), key


def assert_same_records(rec_b, rec_n, histogram=False, fused_step=False):
    """The blocking and the non-blocking run's records are the same, in step order (dump paths by
    their file name). With ``histogram``: a logging step's gradient exponents are taken at the
    step, so the record close() writes has none under blocking=False (a skipped step's are of
    its unclipped gradients in both modes).
    With ``fused_step`` the update statistics of a step skipped on the device are the step's own
    rows, whose weight norms are within float32 rounding of the separate pass that
    ``blocking=True`` takes for a step it does not take."""
    skipped = {NAN_AT, EXPLODE_AT}
    assert [r["step"] for r in rec_b] == [r["step"] for r in rec_n] and skipped < {r["step"] for r in rec_b}
    for a, b in zip(rec_b, rec_n, strict=True):
        for r in (a, b):
            r["dump"] = r["dump"].rsplit("/", 1)[-1] if "dump" in r else None
        taken = a["step"] % 10 == 0  # logging steps: taken at the step
        if histogram and not taken:  # the record close() writes, or an anomaly's off the logging steps
            assert "exponents" not in b and "exponents" in a, a["step"]
            a.pop("exponents"), a.pop("headroom")
        elif histogram:
            assert "exponents" in b and sum(sum(e["counts"]) for e in a["exponents"].values()) > 0
        if fused_step and a["step"] in skipped and "weight_norm" in a:
            wa, wb = a.pop("weight_norm"), b.pop("weight_norm")
            assert wa.keys() == wb.keys() and all(wa[k] == pytest.approx(wb[k], rel=1e-6) for k in wa)
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN as NaN


def test_histograms_never_wait_and_give_the_blocking_records(tmp_path):
    guard = SyncGuard(allowed=None, host_copies=True)
    rec_b = run(tmp_path, blocking=True, histogram=True)[4]
    rec_n = run(tmp_path, blocking=False, guard=guard, histogram=True)[4]
    assert guard.reads == [] and guard.saw_gradfuse_op()
    assert_same_records(rec_b, rec_n, histogram=True)


def test_activations_and_the_nan_trace_never_wait_and_give_the_blocking_records(tmp_path):
    guard = SyncGuard(allowed=None, host_copies=True)
    options = dict(activations=True, trace_nonfinite=True, histogram=True, forward_nan=True)
    _, _, mon_b, rep_b, rec_b, msg_b, _ = run(tmp_path, blocking=True, **options)
    with as_on_an_accelerator():  # the hooks' CPU shortcuts read CPU values, which waits for nothing
        _, _, mon_n, rep_n, rec_n, msg_n, _ = run(tmp_path, blocking=False, guard=guard, **options)
    assert guard.reads == [] and guard.saw_gradfuse_op()
    # the NaN traced to the module whose output held it first, named a step later
    assert rep_b[NAN_AT].first_nonfinite == rep_n[NAN_AT].first_nonfinite == ("forward", "head")
    assert msg_b == msg_n and "head" in msg_n[0]
    logged = [r for r in rec_b if "act" in r]
    assert len(logged) >= STEPS // 10 and all(r["act"] and r["act_grad"] and r["act_exponents"] for r in logged)
    assert_same_records(rec_b, rec_n, histogram=True)
    assert mon_b.counters() == mon_n.counters()


def test_the_noise_scale_never_waits_and_gives_the_blocking_estimates(tmp_path):
    def train(blocking, guard=None):
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-3)
        log = tmp_path / f"noise-{blocking}.jsonl"
        monitor = GradMonitor(model, max_norm=1.0, every=1, explode_threshold=1e3, on_explode="skip",
                              noise_scale=gradfuse.NoiseScale(batch_size=2, accumulation_steps=2),
                              sinks=[JsonlSink(log)], optimizer=None if blocking else opt, blocking=blocking)
        with warnings.catch_warnings(), guard if guard is not None else _nothing():
            warnings.simplefilter("ignore")
            for step, x in enumerate(batches()[:30]):
                for half in (x[:2], x[2:]):  # two micro-batches: the pair of norms
                    logits = model(half[:, :-1]).flatten(0, 1)
                    (nn.functional.cross_entropy(logits, half[:, 1:].flatten()) / 2).backward()
                    monitor.micro_step()
                if step == 12:  # an explosion: skipped, so its (finite) pair is not averaged in
                    torch._foreach_mul_([p.grad for p in model.parameters()], 1e5)
                report = monitor.step()
                if not (blocking and report.skip):
                    opt.step()
                opt.zero_grad()
        monitor.close()
        return monitor, [json.loads(line) for line in log.read_text().splitlines()]

    mon_b, rec_b = train(True)
    guard = SyncGuard(allowed=None, host_copies=True)
    mon_n, rec_n = train(False, guard)
    assert guard.reads == [] and guard.saw_gradfuse_op()
    assert mon_b.skipped_steps == mon_n.skipped_steps == 1
    assert mon_b.noise_scale.updates == mon_n.noise_scale.updates == 29
    estimates = [r["noise_scale"] for r in rec_b]
    assert estimates == [r["noise_scale"] for r in rec_n] and len(estimates) == 30
    assert estimates[12] == estimates[11] != estimates[13] and all(math.isfinite(e["G2"]) for e in estimates)
    for a, b in zip(rec_b, rec_n, strict=True):
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_update_statistics_never_wait_and_give_the_blocking_records(tmp_path):
    guard = SyncGuard(allowed=None, host_copies=True)
    options = dict(update_ratios="opt", update_every=3, record_updates=True)
    _, _, mon_b, rep_b, rec_b, _, _ = run(tmp_path, blocking=True, **options)
    _, _, mon_n, rep_n, rec_n, _, _ = run(tmp_path, blocking=False, guard=guard, **options)
    assert guard.reads == [] and guard.saw_gradfuse_op()
    assert [r.step for r in rep_n if r.updates is not None] == [r.step for r in rep_b if r.updates is not None]
    assert len([r for r in rep_n if r.updates is not None]) > STEPS // 3
    by_step = {r["step"]: r for r in rec_b}
    assert all(by_step[s]["update_norm"] for s in (50, NAN_AT, EXPLODE_AT))
    for skipped in (NAN_AT, EXPLODE_AT):  # nothing applied: no update, no moments
        assert set(by_step[skipped]["update_norm"].values()) == {0.0} and by_step[skipped]["moment1_rms"] == {}
    assert min(by_step[50]["update_norm"].values()) > 0 and by_step[50]["moment1_rms"]
    assert_same_records(rec_b, rec_n)
    assert mon_b.counters() == mon_n.counters()
    assert_same_dumps(rep_b, rep_n)  # the flight recorder's update columns too
    ring = load_dump(rep_n[NAN_AT].dump).arrays  # update norms recorded; none for the skipped step
    assert ring["steps"][-1] == NAN_AT and ring["scalars"][:-1, 2].isfinite().all() and ring["scalars"][-1, 2].isnan()


def test_update_clipping_never_waits_and_gives_the_blocking_weights(tmp_path):
    guard = SyncGuard(allowed=None, host_copies=True)
    options = dict(max_update_rms=4e-4, update_ratios="opt", update_every=4)
    model_b, opt_b, mon_b, rep_b, rec_b, _, _ = run(tmp_path, blocking=True, **options)
    model_n, opt_n, mon_n, rep_n, rec_n, _, _ = run(tmp_path, blocking=False, guard=guard, **options)
    assert guard.reads == [] and guard.saw_gradfuse_op()
    counts = mon_n.counters()
    assert counts == mon_b.counters() and 0 < counts["update_clipped_steps"] < STEPS - 2
    assert counts["update_clipped_params"] > counts["update_clipped_steps"]
    # the skipped steps rescaled nothing (the explosion's clipped update would have been): the weights
    # are those of the blocking run, bit for bit
    for a, b in zip(model_b.parameters(), model_n.parameters(), strict=True):
        assert torch.equal(a, b)
    by_step = {r["step"]: r for r in rec_n}
    assert "update_clipped" not in by_step[NAN_AT] and "update_clipped" not in by_step[EXPLODE_AT]
    assert sum(r.get("update_clipped", 0) for r in rec_n) > 0
    assert_same_records(rec_b, rec_n)


def test_the_report_is_settled_at_the_next_step(tmp_path):
    model = nn.Linear(4, 3)
    opt = gradfuse.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, on_nonfinite="skip", optimizer=opt, blocking=False, every=0)
    model(torch.randn(2, 4)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    before = model.weight.detach().clone()
    report = monitor.step()
    assert not report.settled and not report.skip and report.anomalies == []
    opt.step()
    assert torch.equal(model.weight, before)  # skipped on the device
    with pytest.warns(RuntimeWarning, match="gradfuse step 0: optimizer step skipped"):
        monitor.flush()
    assert report.settled and report.skip and report.anomalies == ["nonfinite"] and "weight" in report.message
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 1
    monitor.close()  # the optimizer steps on without the monitor's hooks
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 0


def test_raise_at_the_next_step_naming_it():
    model = nn.Linear(4, 3)
    opt = gradfuse.optim.Adam(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, on_nonfinite="raise", optimizer=opt, blocking=False, every=0)
    model(torch.randn(2, 4)).sum().backward()
    model.bias.grad[1] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    monitor.step()
    opt.step()  # not taken: raise skips on the device too
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(gradfuse.GradientAnomaly, match="step 0: non-finite gradients in 1 parameter.*bias"):
        monitor.step()
    assert opt.state_dict()["state"] == {}  # the skipped first step made no state


@pytest.mark.parametrize("clip", [dict(max_norm=0.1), dict(max_norm=0.1, per="layer"),
                                  dict(max_norm=gradfuse.ZClip(warmup_steps=1, max_grad_norm=0.1))],
                         ids=["total", "per_layer", "zclip"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_skipped_step_is_left_unclipped(clip, blocking):
    """The NaN's coefficient would spread the NaN to every gradient (what a sharded optimizer
    keeps across steps for a parameter that gets no gradient next); a skipped step is left as
    the backward made it, in both modes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = gradfuse.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, on_nonfinite="skip", optimizer=None if blocking else opt, blocking=blocking,
                          every=0, **clip)
    model(torch.randn(5, 4)).square().sum().backward()
    model[0].bias.grad[0] = math.nan
    grads = [p.grad.clone() for p in model.parameters()]
    assert min(float(g.nan_to_num().norm()) for g in grads) > 0.1  # the clip would scale each one
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        monitor.step()
        monitor.flush()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    assert int(sum(p.grad.isnan().sum() for p in model.parameters())) == 1
    monitor.close()


def test_torch_fused_adamw_takes_the_skip_as_found_inf():
    def train(blocking):
        torch.manual_seed(0)
        model = nn.Linear(6, 5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        monitor = GradMonitor(model, explode_threshold=50.0, optimizer=None if blocking else opt,
                              blocking=blocking, every=0)
        g = torch.Generator().manual_seed(3)
        for step in range(6):
            model(torch.randn(4, 6, generator=g)).square().sum().mul(1000.0 if step == 2 else 1.0).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = monitor.step()
            if not (blocking and report.skip):
                opt.step()
            assert "found_inf" not in opt.__dict__
            opt.zero_grad()
        monitor.close()
        return model, opt, monitor

    mb, ob, monb = train(True)
    mn, on, monn = train(False)
    assert monb.skipped_steps == monn.skipped_steps == 1
    for a, b in zip(mb.parameters(), mn.parameters()):
        assert torch.equal(a, b)
    for k, state in ob.state_dict()["state"].items():
        assert all(torch.equal(v, on.state_dict()["state"][k][key]) for key, v in state.items())
    assert float(ob.state_dict()["state"][0]["step"]) == 5


def test_an_optimizer_without_a_device_skip_blocks_and_says_so():
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())  # foreach: takes no found_inf
    assert gradfuse.monitor.device_skip.device_skip_kind(opt) is None
    with pytest.warns(RuntimeWarning, match="blocks as with blocking=True.*gradfuse.optim"):
        monitor = GradMonitor(model, optimizer=opt, blocking=False)
    model(torch.randn(2, 4)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="skipped"):
        report = monitor.step()
    assert report.settled and report.skip  # decided at once, as with blocking=True
    # policies that neither skip nor raise need no device skip: no warning, no block
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = GradMonitor(model, on_nonfinite="warn", blocking=False)
    assert not quiet.step().settled


def test_attach_hands_the_skip_to_the_optimizers_step():
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = gradfuse.optim.AdamW(model.parameters(), lr=1e-2)
    handle = gradfuse.attach(opt, model, max_norm=1.0, blocking=False)
    weights = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            model(torch.randn(3, 5)).sum().backward()
            if step == 2:
                model.bias.grad[0] = math.nan
            opt.step()  # the monitor runs first; the skip is applied inside this step
            opt.zero_grad()
            weights.append(model.weight.detach().clone())
        handle.detach()
    assert torch.equal(weights[1], weights[2]) and not torch.equal(weights[2], weights[3])
    assert handle.monitor.counters()["skipped_steps"] == 1
    assert any("gradfuse step 2: optimizer step skipped" in str(w.message) for w in caught)
    assert float(opt.state_dict()["state"][0]["step"]) == 3
