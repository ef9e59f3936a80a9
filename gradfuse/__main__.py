"""``python -m gradfuse``: the command line of ``gradfuse.cli``."""
import sys

from gradfuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
