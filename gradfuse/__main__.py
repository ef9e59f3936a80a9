"""Command line: ``python -m gradfuse {demo,plot,info}``."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gradfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on built-in data with the monitor on")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--out", default="runs/demo", help="folder for run.jsonl and gradflow.png")
    d.add_argument("--tiny", action="store_true", help="tiny sizes (for tests)")
    p = sub.add_parser("plot", help="draw gradient flow from a GradMonitor JSONL log")
    p.add_argument("jsonl")
    p.add_argument("-o", "--output", default="gradflow.png")
    sub.add_parser("info", help="what gradfuse._C was built against, and the backends in use")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from gradfuse.demo import run
        run(steps=args.steps, out_dir=args.out, tiny=args.tiny)
    elif args.command == "plot":
        from gradfuse.plot import plot_gradflow
        print(plot_gradflow(args.jsonl, args.output))
    elif args.command == "info":
        import torch

        import gradfuse
        info = gradfuse.build_info()
        info["backends"] = {"cpu": gradfuse.backend("cpu")}
        if torch.cuda.is_available():
            info["backends"]["cuda"] = gradfuse.backend("cuda")
        print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
