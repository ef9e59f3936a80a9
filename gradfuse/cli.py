"""Command line: ``python -m gradfuse {demo,plot,explain,info}`` (also the ``gradfuse`` script).

Layer: the top, beside the demo. Imports any of gradfuse.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# What ``gradfuse --help`` shows users (the module docstring above is for contributors).
DESCRIPTION = """Fused gradient statistics, clipping and monitoring for PyTorch, from the command line:
run the demo (a small training run with the monitor on, a planted spike and NaN caught), draw the
gradient flow of a GradMonitor JSONL log, explain a flight-recorder dump (which quantity and which
layers left their band first before a spike), or show what the extension was built for against what
is running. `gradfuse COMMAND --help` describes a command's options."""


def main(argv=None) -> int:
    """Runs the command line on ``argv`` (default: ``sys.argv[1:]``) and returns the exit status."""
    parser = argparse.ArgumentParser(prog="gradfuse", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on built-in data with the monitor on")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--out", default="runs/demo", help="folder for run.jsonl and gradflow.png")
    d.add_argument("--tiny", action="store_true", help="tiny sizes (for tests)")
    p = sub.add_parser("plot", help="draw gradient flow from a GradMonitor JSONL log (and, for "
                                    "activations=True logs, <output>_activations.png; for "
                                    "update_ratios logs, <output>_updates.png)")
    p.add_argument("jsonl")
    p.add_argument("-o", "--output", default=None,
                   help="the picture (default gradflow.png), or with --animate the animation "
                        "(default gradflow.gif; .mp4 needs ffmpeg on PATH)")
    p.add_argument("--animate", action="store_true",
                   help="an animation of the per-layer gradient norms, a frame per logged step "
                        "(at most --max-frames), anomalous steps in red")
    p.add_argument("--fps", type=int, default=5, help="frames per second of --animate (default 5)")
    p.add_argument("--max-frames", type=int, default=200,
                   help="--animate thins longer logs to about this many frames, keeping anomalies")
    e = sub.add_parser("explain", help="explain a flight-recorder dump: which quantity left its band first "
                                       "(update norm, gradient norm, loss, activation RMS), in which layers, "
                                       "how many steps before the trigger, and what followed",
                       description="Explains a flight-recorder dump (a .gfdump file the monitor writes on an "
                                   "anomaly or on demand): which quantity left its band (mean +- sigma std of "
                                   "the steps before) first, in which layers, how many steps before the "
                                   "trigger, the order in which the others followed, and the module of the "
                                   "first non-finite value when it was traced.")
    e.add_argument("dump", help="the dump file (e.g. gradfuse_dumps/step1200-spike.gfdump)")
    e.add_argument("--plot", metavar="OUT.png", default=None,
                   help="also draw the per-layer traces around the trigger with their bands into OUT.png")
    e.add_argument("--json", action="store_true", help="print the diagnosis as JSON instead of text")
    e.add_argument("--lookback", type=int, default=16,
                   help="recorded steps up to the trigger in which departures are looked for (default 16)")
    i = sub.add_parser("info", help="what gradfuse._C was built for vs what is running, the backends "
                                    "in use, and what to do when they differ")
    i.add_argument("--json", action="store_true", help="only the build info and backends, as JSON")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from gradfuse.demo.demo import run
        run(steps=args.steps, out_dir=args.out, tiny=args.tiny)
    elif args.command == "plot" and args.animate:
        from gradfuse.viz.animation import animate_gradflow
        try:
            print(animate_gradflow(args.jsonl, args.output or "gradflow.gif", fps=args.fps,
                                   max_frames=args.max_frames))
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.command == "plot":
        if args.output is None:
            args.output = "gradflow.png"
        from gradfuse.monitor.sinks import read_jsonl
        from gradfuse.viz import activations as pa  # GradMonitor(activations=True) logs
        from gradfuse.viz import updates as pu
        from gradfuse.viz.gradflow import plot_gradflow
        print(plot_gradflow(args.jsonl, args.output))
        records = read_jsonl(args.jsonl)
        if pa.has_activations(records):
            print(pa.plot_activations(args.jsonl, pa.activations_path(args.output)))
        if pu.has_updates(records):  # GradMonitor(update_ratios=...) logs
            print(pu.plot_updates(args.jsonl, pu.updates_path(args.output)))
    elif args.command == "explain":
        return explain_dump(args.dump, plot=args.plot, as_json=args.json, lookback=args.lookback)
    elif args.command == "info":
        return print_info(as_json=args.json)
    return 0


def explain_dump(path: str, plot: str | None = None, as_json: bool = False, lookback: int = 16) -> int:
    """Prints the diagnosis of a flight-recorder dump (text, or JSON with ``as_json``) and draws
    it into ``plot``; exit status 2 with a message when ``path`` is not a readable dump."""
    from gradfuse.monitor.flight_dump import load_dump
    from gradfuse.viz.explain import explain, plot_dump
    try:
        dump = load_dump(path)
        diagnosis = explain(dump, lookback=lookback)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as e:  # other bytes than a dump's can fail the reader so
        print(f"error: {path}: not a gradfuse flight-recorder dump ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    diagnosis.path = path
    print(json.dumps(diagnosis.to_dict(), indent=2) if as_json else diagnosis.text())
    if plot:  # the picture's path; on stderr under --json, so that stdout stays one JSON document
        print(plot_dump(dump, plot, lookback=lookback), file=sys.stderr if as_json else sys.stdout)
    return 0


def _extension_python_tag() -> str | None:
    """The interpreter the loaded gradfuse._C was built for, from its file name (cpython-311...)."""
    import re

    from gradfuse.ops import library
    ext = library.extension
    m = ext is not None and re.search(r"\.(\w+?)-(\d)(\d+)", Path(ext.__file__).name)
    return f"{m.group(1)} {m.group(2)}.{m.group(3)}" if m else None


def print_info(as_json: bool = False) -> int:
    """Built for vs running, side by side; exit status 1 when they differ in a way that matters."""
    import platform

    import torch

    import gradfuse
    from gradfuse.ops import library
    info = gradfuse.build_info()
    info["backends"] = {"cpu": gradfuse.backend("cpu")}
    if torch.cuda.is_available():
        info["backends"]["cuda"] = gradfuse.backend("cuda")
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    gpus = [f"{torch.cuda.get_device_name(i)} ({'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    loaded = info["extension_loaded"]
    rows = [
        ("", "built for", "running"),
        ("torch", info["torch_version"] if loaded else "-", torch.__version__),
        ("CUDA", (info["cuda_version"] or "no CUDA kernels") if loaded else "-", torch.version.cuda or "no CUDA"),
        ("GPU archs", (info["cuda_archs"] or "-") if loaded else "-", ", ".join(gpus) or "no GPU visible"),
        ("Python", _extension_python_tag() or "-", platform.python_version()),
    ]
    print(f"gradfuse {gradfuse.__version__} at {Path(gradfuse.__file__).parent}")
    for name, built, running in rows:
        print(f"  {name:<10} {built:<28} {running}")
    print("  backends   " + ", ".join(f"{d}: {b}" for d, b in info["backends"].items())
          + (f" (CPU kernels: {info['cpu_capability']}, best here: {info['best_cpu_capability']})" if loaded else ""))
    problems = library.mismatches()
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if not problems:
        print("OK: the build serves every device here.")
    print("build info (JSON, for bug reports): " + json.dumps(info))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
