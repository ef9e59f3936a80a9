"""The corner probe that decides "no dead unit" on the CPU without the per-unit pass
(gradfuse.activations.dead_units._probe_alive): exact against the full pass, and taken where it should be."""
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.activations import dead_units
from gradfuse.activations.dead_units import _probe_alive, _unit_activity


def truth(t, dim):
    return int(_unit_activity(t, dim).eq(0).sum())


@pytest.mark.parametrize("shape,dim", [((16, 8, 8, 8), 1), ((16, 8, 4, 4), 1), ((64, 48), 1),
                                       ((2, 64, 48), 2), ((1, 64, 48), 2), ((8, 5, 3), 1), ((4, 2), 1)])
def test_probe_says_alive_only_when_no_unit_is_dead(shape, dim):
    gen = torch.Generator().manual_seed(0)
    relu = torch.randn(shape, generator=gen).relu()
    dropout = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.1)
    one_dead = torch.randn(shape, generator=gen).relu()
    one_dead.select(dim, 3 % shape[dim]).zero_()
    # a unit zero in the corner the probe reads and alive only in the last example / position
    late = torch.randn(shape, generator=gen)
    late.select(dim, 1).zero_()
    late[(-1,) * dim + (1,)] = 2.0  # the last row (example, position) only
    nan_only = one_dead.clone()
    nan_only[(-1,) * dim + (3 % shape[dim],)] = math.nan  # NaN is not zero: alive
    taken = 0
    for t in (relu, dropout, one_dead, late, nan_only, torch.zeros(shape)):
        alive = _probe_alive(t, dim)
        assert not alive or truth(t, dim) == 0, (t, dim)
        taken += alive
    assert not _probe_alive(one_dead, dim) and not _probe_alive(late, dim)
    # where the batch has enough rows the probe decides the plain ReLU and dropout outputs
    rows = math.prod(shape[:dim])
    if rows >= 4 and -(-64 // min(math.prod(shape[dim + 1:]), 64)) <= rows // 4:
        assert _probe_alive(relu, dim) and _probe_alive(dropout, dim)
        assert taken >= 2


def test_probe_refuses_what_it_cannot_read_cheaply():
    t = torch.randn(16, 8, 4, 4).relu()
    assert not _probe_alive(t.transpose(0, 1), 0)  # unit dimension first: no rows before it
    assert not _probe_alive(t.permute(0, 2, 3, 1), 3) or truth(t.permute(0, 2, 3, 1), 3) == 0
    assert not _probe_alive(torch.randn(8).relu(), 0)
    assert not _probe_alive(torch.randn(3, 5).relu(), 1)  # 3 rows: the full pass is as cheap


def test_capture_takes_the_probe_and_still_counts_a_partly_dead_layer(monkeypatch):
    """A CNN whose ReLU outputs have half their elements zero: the probe replaces the per-unit
    pass on every row but the one with dead channels, which the full pass counts exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    with torch.no_grad():
        model[2].bias[:3] = -1e3  # channels 0-2 of the second ReLU: dead
    passes = []
    real = dead_units._unit_activity

    def counted(t, dim):
        passes.append(tuple(t.shape))
        return real(t, dim)
    monkeypatch.setattr(dead_units, "_unit_activity", counted)
    x = torch.randn(16, 3, 8, 8)
    with gradfuse.capture_activations(model) as cap:
        model(x).logsumexp(1).sum().backward()
    d = cap.forward.to_dict()["params"]
    assert d["3"]["dead_units"] == 3 and d["3"]["units"] == 8
    assert d["1"]["dead_units"] == 0 and d["1"]["zero_fraction"] > 0.2  # ReLU zeros, no dead unit
    b = cap.backward.to_dict()["params"]
    assert b["2"]["dead_units"] == 3  # no gradient reaches the dead channels' pre-activations
    full = [s for s in passes if s == (16, 8, 8, 8)]
    assert 1 <= len(full) <= 4, passes  # the dead layer's rows only; the others were probed
    monkeypatch.setattr(dead_units, "_probe_alive", lambda t, dim: False)
    with gradfuse.capture_activations(model) as ref:
        model(x).logsumexp(1).sum().backward()
    for side in ("forward", "backward"):
        got = getattr(cap, side).to_dict()["params"]
        want = getattr(ref, side).to_dict()["params"]
        assert {k: v["dead_units"] for k, v in got.items()} == {k: v["dead_units"] for k, v in want.items()}


def test_benchmark_and_profile_scripts_run(capsys):
    """The scripts behind RESULTS.md's activation-capture numbers run (tiny models, one round; no timing
    is checked here)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import activations_bench
    import activations_profile
    threads = torch.get_num_threads()
    try:
        assert activations_bench.main(["--smoke", "--models", "resnet", "--rounds", "1"]) == 0
        assert activations_profile.main(["--smoke", "--models", "resnet", "--rounds", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "(a) capture_activations, every module" in out and "floor: one t.sum()" in out
    assert "stats op 2x4x32x32" in out and "dead units: corner probes" in out and "trace sums" in out
