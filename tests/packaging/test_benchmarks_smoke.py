"""Every benchmark runs on tiny sizes (untimed) so the suite cannot rot: the pytest benchmarks,
the summary from a tiny run's JSON, and the stand-alone scripts (host cost, histogram, clipping,
ZClip regimes, the update op, full health)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(*args):
    cmd = [sys.executable, "-m", "pytest", "benchmarks", "--bench-size", "smoke", "-q",
           "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_benchmark_runs_untimed():
    out = run_bench("--benchmark-disable")
    assert " passed" in out and "failed" not in out


def test_summary_table_and_chart(tmp_path):
    js = tmp_path / "bench.json"
    run_bench("--benchmark-only", f"--benchmark-json={js}", "--bench-workloads", "many_small,tiny",
              "--bench-dtypes", "float32", "--benchmark-warmup=off")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    png = tmp_path / "chart.png"
    md_path = tmp_path / "table.md"
    assert summarize.main([str(js), "-o", str(md_path), "--png", str(png)]) == 0
    md = md_path.read_text()
    assert "**many_small, float32** (200 tensors" in md and "**tiny, float32** (200 tensors" in md
    for name in ("gradfuse_stats", "gradfuse_clip_clipping", "torch_clip_foreach", "hook_loop",
                 "torch_foreach_stats", "memory_read", "memory_copy", "gradfuse_watch_stats",
                 "gradfuse_watch_clip", "gradfuse_monitor_step", "stats_op", "moments_op"):
        assert f"| {name} |" in md
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_host_cost_script(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import host_cost
    finally:
        sys.path.pop(0)
    assert host_cost.main(["--count", "50", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for call in ("clip_grad_norm_(foreach=True)", "watch(named).clip_()", "GradMonitor.step() (module)",
                 "gradfuse.clip_(module)"):
        assert f"| {call} |" in out


def test_hist_bench_script(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import hist_bench
    finally:
        sys.path.pop(0)
    assert hist_bench.main(["--small", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| histogram (multi_tensor_exponent_histogram" in out and "gpt2_small bfloat16" in out
    if hist_bench.has_avx512_loop():  # both counting loops of the AVX2 kernels are timed
        assert "AVX-512 loop) |" in out and "| histogram, AVX2 loop |" in out


def test_clipping_bench_smoke():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "clipping_bench.py"),
                           "--smoke", "--workloads", "gpt2_small,resnet50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("clip_per_layer", "clip_per_param", "gradfuse_value_stats", "gradfuse_agc",
                 "timm_agc", "gradfuse_zclip", "zclip_step"):
        assert f"| {name} |" in proc.stdout, proc.stdout
    assert proc.stdout.count("**") == 8  # 2 workloads x 2 dtypes, one table each


def test_zclip_regimes_smoke():
    """benchmarks/zclip_regimes.py on tiny shapes (one round): every regime runs, and each
    implementation clipped exactly where its regime says it does."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "zclip_regimes.py"),
                           "--smoke", "--workloads", "resnet50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expect = {"warmup": "no / no", "warmup_max_norm": "no / no", "warmup_max_norm_clip": "yes / yes",
              "no_spike": "no / no", "spike": "yes / yes", "max_norm": "yes / yes"}
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| regime")}
    assert set(expect) <= set(rows), proc.stdout
    for regime, clipped in expect.items():
        assert rows[regime].rstrip().endswith(f"| {clipped} |"), rows[regime]


def test_update_op_bench_smoke():
    """benchmarks/update_op.py on tiny tensors (one round, not a timing): every rule and dtype."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "update_op.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rule in ("adam", "adam amsgrad", "sgd momentum"):
        for dtype in ("float32", "bfloat16", "float16"):
            assert f"| {rule} | {dtype} |" in proc.stdout, proc.stdout


def test_optim_step_bench_smoke():
    """benchmarks/optim_step.py on tiny shapes (one round, not a timing): every variant and dtype."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "optim_step.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for dtype in ("float32", "bfloat16"):
        for variant in ("torch foreach", "torch fused=True", "gradfuse.optim.AdamW", "copy of the same bytes"):
            assert f"| {dtype} | {variant} |" in proc.stdout, proc.stdout


def test_full_health_bench_smoke():
    """benchmarks/full_health.py on a one-layer GPT-2 (one step, not a timing): the four variants
    and their peak memory in fresh processes."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "full_health.py"), "--steps", "1",
                           "--layers", "1", "--width", "32", "--seq", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("torch clip", "monitor (clip)", "full health", "full health, gradfuse.optim"):
        assert f"| {name} | " in proc.stdout, proc.stdout


def test_never_waits_bench_smoke():
    """benchmarks/never_waits.py on a one-layer transformer (one step, not a timing): every
    variant, and gradfuse's host reads per step: one for the default monitor's decision, none
    with everything on and never waiting."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "never_waits.py"), "--steps", "1",
                           "--layers", "1", "--width", "32", "--seq", "8", "--batch", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[-1]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["torch clip"] == "0.0" and rows["monitor (default)"] == "1.0", rows
    assert rows["everything, never waiting"] == "0.0", rows
