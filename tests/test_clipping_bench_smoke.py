"""benchmarks/clipping_bench.py on tiny shapes, untimed in effect (one round): keeps it running."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
