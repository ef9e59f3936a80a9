"""Update-to-weight ratios (gradfuse.update_ratio): per layer |w_after - w_before| / |w_before|
from the monitor, against the parameters copied in the test around the real optimizer.step()."""
import inspect
import math

import pytest
import torch
from torch import nn

import gradfuse
from gradfuse.dynamics.update_plan import plan_updates, unavailable_reason
from gradfuse.ops.layout import UPDATE_SUMSQ
from gradfuse.sinks import metrics


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                       weight_decay=1e-2, maximize=True),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, betas=(0.8, 0.9)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_decoupled": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
}
# torch 2.6 (the floor) has no Adam(decoupled_weight_decay=...): it came with AdamW's refactor
# into a subclass of Adam (torch 2.7). Only that case is skipped there; AdamW runs everywhere.
ADAM_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


def reference_ratios(before, after, names):
    """Per layer (as GradStats.layers groups), in float64 from the copied fp32 parameters."""
    from gradfuse.core.grad_stats import layer_of
    u2, w2 = {}, {}
    for name in names:
        key = layer_of(name)
        u2[key] = u2.get(key, 0.0) + float((after[name].double() - before[name].double()).square().sum())
        w2[key] = w2.get(key, 0.0) + float(before[name].double().square().sum())
    return {k: math.sqrt(u2[k]) / math.sqrt(w2[k]) for k in u2}, {k: math.sqrt(w2[k]) for k in w2}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_ratios_equal_copied_parameters(kind):
    if kind == "adam_decoupled" and not ADAM_HAS_DECOUPLED:
        pytest.skip(f"torch {torch.__version__}: Adam has no decoupled_weight_decay (torch < 2.7)")
    if kind.startswith("adamw"):  # torch < 2.7: AdamW is not an Adam; gradfuse must still know it
        assert unavailable_reason(OPTIMIZERS[kind]([nn.Parameter(torch.ones(1))])) is None
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    mon = gradfuse.GradMonitor(model, every=1, max_norm=0.5, update_ratios=opt, sinks=[])
    logged = []
    mon.sinks.append(type("Keep", (), {"write": lambda self, r: logged.append(r)})())
    x, y = torch.randn(64, 12), torch.randn(64, 3)
    compared = 0
    for step in range(6):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 3:
            model.head.bias.grad = None  # a parameter the step leaves alone: update 0
        mon.step()  # clips first: the update is that of the clipped gradients
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        ratios, norms = reference_ratios(before, after, before)
        record = logged[-1]
        assert record["step"] == step
        assert set(record["update_ratio"]) == set(ratios) == {"layers.0", "layers.1", "head"}
        for layer, want in ratios.items():
            # Something moved: 1e-4 .. 1 of the weights; float32 rounding of w + u is at most
            # 2^-24 |w| per element, i.e. 6e-8 / ratio relative to the update norm.
            assert 1e-4 < want < 1.0, (layer, want)
            assert record["update_ratio"][layer] == pytest.approx(want, rel=2e-5, abs=0), (kind, step, layer)
            assert record["weight_norm"][layer] == pytest.approx(norms[layer], rel=1e-6)  # fp32 chunk sums
            compared += 1
        m = metrics(record)
        assert m["update_ratio/head"] == record["update_ratio"]["head"]
        assert m["weight_norm/layers.0"] == record["weight_norm"]["layers.0"]
    assert compared == 18
    assert mon.dynamics.update_ratios.passes == 6  # one fused update pass per logging step


def test_planned_update_per_parameter_close():
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 12)).square().mean().backward()
        rows = plan_updates([opt])
        planned = {id(p): u2 for p, u2 in zip(rows.params, rows.floats[:, UPDATE_SUMSQ].tolist())}
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        for p, b in zip(model.parameters(), before):
            u2 = float((p.detach().double() - b.double()).square().sum())
            assert u2 > 1e-10  # a real update
            assert planned[id(p)] == pytest.approx(u2, rel=1e-5)


def test_only_logging_steps_pay_and_skipped_steps_have_ratio_zero():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    logged = []
    sink = type("Keep", (), {"write": lambda self, r: logged.append(r)})()
    mon = gradfuse.GradMonitor(model, every=3, update_ratios=opt, sinks=[sink])
    for step in range(7):
        opt.zero_grad()
        model(torch.randn(4, 12)).sum().backward()
        if step == 6:
            model.head.weight.grad[0, 0] = math.nan
            with pytest.warns(RuntimeWarning, match="skipped"):
                assert mon.step().skip
        else:
            mon.step()
            opt.step()
    assert mon.dynamics.update_ratios.passes == 3  # steps 0, 3 and 6 (skipped: the weights, update 0)
    assert [r["step"] for r in logged] == [0, 3, 6]
    assert all(v == 0.0 for v in logged[-1]["update_ratio"].values())
    assert all(v > 0 for v in logged[-1]["weight_norm"].values())


def test_other_optimizers_say_not_available():
    model = Net()
    opt = torch.optim.RMSprop(model.parameters())
    logged = []
    sink = type("Keep", (), {"write": lambda self, r: logged.append(r)})()
    with pytest.warns(RuntimeWarning, match="not available for RMSprop"):
        mon = gradfuse.GradMonitor(model, every=1, update_ratios=opt, sinks=[sink])
    model(torch.randn(4, 12)).sum().backward()
    mon.step()
    assert "update_ratio" not in logged[0]
    assert "SGD, Adam, AdamW" in logged[0]["update_ratio_unavailable"]
    assert not any(k.startswith("update_ratio/") for k in metrics(logged[0]))
    with pytest.raises(ValueError, match="needs the optimizer"):
        gradfuse.GradMonitor(model, update_ratios=True)


@pytest.mark.parametrize("every_step", [False, True])
def test_record_carries_the_optimizer_statistics_per_layer(every_step):
    from gradfuse.core.grad_stats import layer_of
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.05, amsgrad=True)
    logged = []
    sink = type("Keep", (), {"write": lambda self, r: logged.append(r)})()
    mon = gradfuse.GradMonitor(model, every=2, update_ratios=opt, sinks=[sink],
                               update_every=1 if every_step else None)
    x, y = torch.randn(64, 12), torch.randn(64, 3)
    for step in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        report = mon.step()
        assert (report.updates is not None) == (every_step or step % 2 == 0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    record = logged[-1]
    assert record["step"] == 2
    groups = {}
    for n, p in model.named_parameters():
        groups.setdefault(layer_of(n), []).append((n, p))
    for layer, members in groups.items():
        numel = sum(p.numel() for _, p in members)
        u2 = sum(float((p.detach().double() - before[n].double()).square().sum()) for n, p in members)
        m2 = sum(float(opt.state[p]["exp_avg"].double().square().sum()) for _, p in members)
        t = float(opt.state[members[0][1]]["step"])
        roots = [opt.state[p]["max_exp_avg_sq"].double().sqrt() / math.sqrt(1 - 0.999 ** t) for _, p in members]
        r2 = sum(float(r.square().sum()) for r in roots)
        dominated = sum(int((r < 0.05).sum()) for r in roots)
        assert record["update_norm"][layer] == pytest.approx(math.sqrt(u2), rel=1e-5)
        assert record["update_rms"][layer] == pytest.approx(math.sqrt(u2 / numel), rel=1e-5)
        assert record["moment1_rms"][layer] == pytest.approx(math.sqrt(m2 / numel), rel=1e-5)
        assert record["moment2_rms"][layer] == pytest.approx(math.sqrt(r2 / numel), rel=1e-5)
        assert record["eps_dominated"][layer] == pytest.approx(dominated / numel, abs=1.5 / numel)
        assert record["update_nonfinite"][layer] == record["moment_nonfinite"][layer] == 0
        assert record["weight_nonfinite"][layer] == 0
    assert sum(record["eps_dominated"].values()) > 0  # eps = 0.05 dominates some elements
    m = metrics(record)
    for key in ("update_ratio", "weight_norm", "update_norm", "update_rms", "moment1_rms", "moment2_rms",
                "eps_dominated", "update_nonfinite", "moment_nonfinite", "weight_nonfinite"):
        assert m[f"{key}/head"] == record[key]["head"]
    assert mon.config()["update_every"] == (1 if every_step else None)


def test_sgd_without_momentum_has_no_moments_in_the_record():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    sink = type("Keep", (), {"write": lambda self, r: logged.append(r)})()
    mon = gradfuse.GradMonitor(model, every=1, update_ratios=opt, sinks=[sink])
    model(torch.randn(4, 12)).sum().backward()
    mon.step()
    r = logged[0]
    assert r["moment1_rms"] == r["moment2_rms"] == r["eps_dominated"] == {}
    assert set(r["update_rms"]) == {"layers.0", "layers.1", "head"}
    with pytest.raises(ValueError, match="update_every"):
        gradfuse.GradMonitor(model, update_every=1)
    with pytest.raises(ValueError, match="update_every"):
        gradfuse.GradMonitor(model, update_ratios=opt, update_every=0)
