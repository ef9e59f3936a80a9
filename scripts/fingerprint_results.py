#!/usr/bin/env python3
"""The results of this checkout's gradfuse as one SHA-256 digest per result set.

To compare two checkouts bit for bit after a change that must not change a result (a
restructuring):

    .venv/bin/python scripts/fingerprint_results.py > after.txt   # in each checkout, then
    diff before.txt after.txt

The result sets, all on the CPU, from fixed seeds: the statistics rows for every dtype and several
norm orders (under both CPU capabilities where the build has AVX2), the moments op, exponent
histograms and headroom, the optimizer-update statistics and the update clip (SGD and Adam / AdamW
configurations, every dtype, both CPU capabilities), clipping by total norm, per parameter, per
layer, by value and AGC,
``clip_grad_norm_``, the AMP unscale, activation capture (forward and backward, with histograms),
and five monitored steps with clipping, the noise scale, update ratios, histograms and
activations (the records as the JSONL sink writes them). ``GradStats.to_dict()`` and ``table()``
are hashed with the rows.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradfuse  # noqa: E402
from gradfuse.ops import layout, library  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().cpu().contiguous().reshape(-1)
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(json.dumps(part, sort_keys=True, default=repr).encode())
    return h.hexdigest()[:16]


def stats_digest(s) -> str:
    return digest(s.floats, s.counts, s.total_norm, s.clip_coef if s.clip_coef is not None else "none",
                  s.to_dict(), s.table())


def model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.LayerNorm(128),
                      nn.Linear(128, 10)).to(dtype)
    return m


def backward(m: nn.Module, seed: int, dtype=torch.float32, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g).to(dtype)
    m.zero_grad()
    (m(x).float().square().mean() * scale).backward()


def tensors(dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 7, 15, 16, 17, 1000, 65535, 65536, 65537, 3 * 65536 + 5]
    out = [(torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype) for n in sizes]
    out[4][3] = float("nan")
    out[6][::7] = 0
    out[7][5] = float("inf")
    big = torch.randn(2 * 65536 + 11, generator=g, dtype=torch.float64).to(dtype)
    return out + [big[1:], big[3:65536 + 20]]


# The update ops' configurations: (name, rule, lr, weight_decay, beta1, beta2, eps, step, flags, state
# present). SGD reads beta1 as momentum, beta2 as dampening.
UPDATE_CONFIGS = [
    ("sgd_wd", layout.RULE_SGD, 0.05, 1e-2, 0.0, 0.0, 0.0, 0.0, 0, False),
    ("momentum_dampening_maximize", layout.RULE_SGD, 0.02, 1e-2, 0.9, 0.3, 0.0, 0.0, layout.FLAG_MAXIMIZE, True),
    ("momentum_first_step", layout.RULE_SGD, 0.1, 1e-2, 0.9, 0.1, 0.0, 0.0, 0, False),
    ("nesterov_wd", layout.RULE_SGD, 0.1, 1e-2, 0.9, 0.0, 0.0, 0.0, layout.FLAG_NESTEROV, True),
    ("adam_first_step", layout.RULE_ADAM, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1, 0, False),
    ("amsgrad_l2_maximize", layout.RULE_ADAM, 1e-3, 1e-2, 0.9, 0.999, 1e-8, 100,
     layout.FLAG_AMSGRAD | layout.FLAG_MAXIMIZE, True),
    ("adamw", layout.RULE_ADAM, 1e-3, 1e-2, 0.9, 0.999, 1e-8, 5, layout.FLAG_DECOUPLED, True),
]


def update_inputs(config, dtype, seed: int):
    """params, grads, moment1, moment2, moment2_max, hyper, rule of one call of the update ops: sizes
    around the chunk, an empty tensor, zeros (eps-dominated elements), and NaN / Inf in the last
    tensor only (a non-finite element makes its tensor's sums NaN or Inf)."""
    _, rule, lr, wd, b1, b2, eps, step, flags, state = config
    g = torch.Generator().manual_seed(seed)
    sizes = [7, 0, 65536 + 3, 2 * 65536 + 17, 33, 65536 + 40]

    def draw(n, scale, positive=False):
        x = torch.rand(n, generator=g, dtype=torch.float64) if positive else torch.randn(
            n, generator=g, dtype=torch.float64)
        return (x * scale).to(dtype)

    params, grads, m1, m2, m2max = [], [], [], [], []
    absent = torch.empty(0, dtype=dtype)
    for n in sizes:
        w, gr, m, v = draw(n, 1.0), draw(n, 0.5), draw(n, 0.1), draw(n, 0.01, positive=True)
        vmax = (v.double() + draw(n, 0.001, positive=True).double()).to(dtype)
        for x in (gr, m, v, vmax):
            x[::5] = 0
        params.append(w)
        grads.append(gr)
        m1.append(m if state and (rule == layout.RULE_ADAM or b1 != 0) else absent)
        m2.append(v if state and rule == layout.RULE_ADAM else absent)
        m2max.append(vmax if state and rule == layout.RULE_ADAM and flags & layout.FLAG_AMSGRAD else absent)
    params[-1][[3, 65536 + 1]] = math.inf
    params[-1][11] = math.nan
    grads[-1][[10, 65536 + 30]] = math.nan
    grads[-1][20] = -math.inf
    hyper = torch.tensor([[lr, wd, b1, b2, eps, step, flags]] * len(sizes), dtype=torch.float64)
    return params, grads, m1, m2, m2max, hyper, rule


def update_results(cap, dtype) -> dict[str, str]:
    """The update statistics, and the weights the update clip leaves (coefficients below 1, at 1
    and NaN), for every configuration."""
    out = {}
    for k, config in enumerate(UPDATE_CONFIGS):
        params, grads, m1, m2, m2max, hyper, rule = update_inputs(config, dtype, 100 + k)
        out[f"update_stats/{cap}/{dtype}/{config[0]}"] = digest(
            *gradfuse.ops.multi_tensor_update_stats(params, grads, m1, m2, m2max, hyper, rule))
        coefs = torch.tensor([1.0, 0.25, 0.3, 0.01, math.nan, 0.5], dtype=torch.float64)
        gradfuse.ops.multi_tensor_update_clip_(params, grads, m1, m2, m2max, hyper, coefs, rule)
        out[f"update_clip/{cap}/{dtype}/{config[0]}"] = digest(*params)
    return out


def results() -> dict[str, str]:
    out = {}
    capabilities = ["default", "avx2"] if gradfuse.build_info().get("best_cpu_capability") == "avx2" else [None]
    for cap in capabilities:
        if cap is not None and library.extension is not None:
            library.extension.set_cpu_capability(cap)
        for dtype in DTYPES:
            ts = tensors(dtype, 1)
            for p in (2.0, 1.0, math.inf, 0.0, 3.0, 0.5, -1.0, -math.inf):
                out[f"tensor_stats/{cap}/{dtype}/{p}"] = stats_digest(gradfuse.tensor_stats(ts, norm_type=p))
            out[f"histogram/{cap}/{dtype}"] = digest(gradfuse.stats(ts, histogram=True).exponent_histogram)
            out[f"moments/{cap}/{dtype}"] = digest(*gradfuse.ops.multi_tensor_moments([t for t in ts if t.numel()]))
            out[f"unit_stats/{cap}/{dtype}"] = digest(*gradfuse.ops.multi_tensor_unit_stats(
                [t[:(t.numel() // 5) * 5] for t in ts], [5 if t.numel() >= 5 else 0 for t in ts]))
            out.update(update_results(cap, dtype))
        if cap is not None and library.extension is not None:
            library.extension.set_cpu_capability(capabilities[-1])
    for dtype in (torch.float32, torch.bfloat16):
        m = model(0, dtype)
        backward(m, 1, dtype)
        s = gradfuse.stats(m, histogram=True)
        out[f"stats_model/{dtype}"] = stats_digest(s)
        out[f"headroom/{dtype}"] = digest(s.headroom_dict())
        for kind, call in [("clip_", lambda mm: gradfuse.clip_(mm, 0.05)),
                           ("per_param", lambda mm: gradfuse.clip_(mm, 0.02, per="param")),
                           ("per_layer", lambda mm: gradfuse.clip_(mm, 0.02, per="layer")),
                           ("value", lambda mm: gradfuse.clip_(mm, None, value=1e-3))]:
            mm = copy.deepcopy(m)
            for a, b in zip(mm.parameters(), m.parameters()):
                a.grad = b.grad.clone()
            r = call(mm)
            out[f"{kind}/{dtype}"] = digest(stats_digest(r), *[p.grad for p in mm.parameters()])
        mm = copy.deepcopy(m)
        for a, b in zip(mm.parameters(), m.parameters()):
            a.grad = b.grad.clone()
        gradfuse.adaptive_clip_grad_(mm.parameters(), clip_factor=0.01)
        out[f"agc/{dtype}"] = digest(*[p.grad for p in mm.parameters()])
        mm = copy.deepcopy(m)
        for a, b in zip(mm.parameters(), m.parameters()):
            a.grad = b.grad.clone()
        total = gradfuse.clip_grad_norm_(mm.parameters(), 0.05)
        out[f"clip_grad_norm_/{dtype}"] = digest(total, *[p.grad for p in mm.parameters()])
    # AMP unscale
    m = model(2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(3)
    opt.zero_grad()
    scaler.scale(m(torch.randn(32, 64, generator=g)).square().mean()).backward()
    s = gradfuse.unscale_clip_(opt, scaler, 0.1)
    out["amp"] = digest(stats_digest(s), *[p.grad for p in m.parameters()])
    # activations
    m = model(4)
    with gradfuse.capture_activations(m, histogram=True) as cap:
        m(torch.randn(32, 64, generator=torch.Generator().manual_seed(5))).square().mean().backward()
    for side in ("forward", "backward"):
        a = getattr(cap, side)
        out[f"activations/{side}"] = digest(a.floats, a.counts, a.to_dict(), a.table(), a.layers(),
                                            a.layer_exponents(), a.std, a.rms, a.dead_units)
    # the monitor
    m = model(6)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        mon = gradfuse.GradMonitor(m, max_norm=0.05, every=1, histogram=True, noise_scale=True,
                                   update_ratios=opt, activations=True,
                                   sinks=[gradfuse.JsonlSink(path)])
        for step in range(5):
            backward(m, 10 + step)
            report = mon.step()
            if not report.skip:
                opt.step()
        mon.close()
        records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r.pop("time", None)
    out["monitor"] = digest(records, *[p.detach() for p in m.parameters()])
    return out


def main() -> int:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    for key, value in results().items():
        print(f"{key} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
