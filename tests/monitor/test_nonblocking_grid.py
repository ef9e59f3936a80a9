"""Every option of the monitor, alone and all together, in each mode: ``blocking=False`` and
``blocking=False, fused_step=True`` against ``blocking=True`` (with the same ``fused_step``: riding
the step, ``p.grad`` keeps the unclipped gradient in both), on the small transformer of
test_nonblocking.py with its planted NaN, explosion and spike. Each cell that runs reads none of
the step's tensors (the sync guard, host copies counted apart; the activation hooks on the path
an accelerator takes) and gives the blocking monitor's weights, optimizer state, records,
warnings, counters and dumps; each refused cell is refused by name."""
import warnings

import pytest
import torch
from sync_guard import SyncGuard, as_on_an_accelerator
from test_nonblocking import EXPLODE_AT, NAN_AT, assert_same_dumps, assert_same_records, run

import gradfuse

OPTIONS = {
    "clip and skip": {},
    "per layer": dict(per="layer"),
    "per param": dict(per="param"),
    "clip_value": dict(max_norm=None, clip_value=0.05),
    "agc": dict(max_norm=None, agc=0.05),
    "ZClip": dict(max_norm="zclip"),
    "schedule": dict(max_norm="schedule"),
    "histogram": dict(histogram=True),
    "activations": dict(activations=True, trace_nonfinite=True, forward_nan=True),
    "noise_scale": dict(noise_scale=True),
    "update_ratios": dict(update_ratios="opt", update_every=3),
    "max_update_rms": dict(max_update_rms=4e-4, update_ratios="opt"),
    "recorded updates": dict(update_ratios="opt", record_updates=True),
    "all": dict(per="layer", histogram=True, activations=True, trace_nonfinite=True, forward_nan=True,
                noise_scale=True, update_ratios="opt", update_every=3, max_update_rms=4e-4, record_updates=True),
    "all that rides": dict(histogram=True, activations=True, trace_nonfinite=True, forward_nan=True,
                           noise_scale=True, update_ratios="opt", update_every=3, max_update_rms=4e-4,
                           record_updates=True),
}
# Riding the step takes one coefficient per tensor, applied by the step as it reads the tensor.
FUSED_REFUSED = {"clip_value": "change each element, not a tensor's scale",
                 "agc": "change each element, not a tensor's scale"}


def options_of(name: str) -> dict:
    options = dict(OPTIONS[name])
    if options.get("max_norm") == "zclip":
        options["max_norm"] = gradfuse.ZClip(warmup_steps=10)
    elif options.get("max_norm") == "schedule":
        options["max_norm"] = lambda step: 1.0 if step < 100 else 0.5
    return options


@pytest.mark.parametrize("fused", [False, True], ids=["blocking=False", "fused_step"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_never_waits_and_gives_the_blocking_monitors_results(tmp_path, name, fused):
    mode = dict(fused_step=True) if fused else {}
    if fused and name in FUSED_REFUSED:
        with pytest.raises(ValueError, match=FUSED_REFUSED[name]):
            run(tmp_path, blocking=False, **options_of(name), **mode)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each run's warnings are collected and compared below
        model_b, opt_b, mon_b, rep_b, rec_b, msg_b, _ = run(tmp_path, blocking=True, **options_of(name), **mode)
        guard = SyncGuard(allowed=None, host_copies=True)
        with as_on_an_accelerator():
            model_n, opt_n, mon_n, rep_n, rec_n, msg_n, _ = run(tmp_path, blocking=False, guard=guard,
                                                                **options_of(name), **mode)
    assert guard.reads == [] and guard.saw_gradfuse_op()
    assert [r.step for r in rep_b if r.skip] == [r.step for r in rep_n if r.skip] == [NAN_AT, EXPLODE_AT]
    for a, b in zip(model_b.parameters(), model_n.parameters(), strict=True):
        assert torch.equal(a, b)
    sb, sn = opt_b.state_dict()["state"], opt_n.state_dict()["state"]
    assert len(sb) == len(sn) > 0 and all(torch.equal(sb[k][key], sn[k][key]) for k in sb for key in sb[k])
    assert msg_b == msg_n and len(msg_b) >= 2
    assert mon_b.counters() == mon_n.counters()
    assert_same_records(rec_b, rec_n, histogram="histogram" in OPTIONS[name], fused_step=fused)
    assert_same_dumps(rep_b, rep_n)
