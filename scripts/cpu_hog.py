"""Keeps one CPU core busy until it is killed: load beside a test run (``make e2e-repeat
LOAD=1``).

It spins at niceness 19, the lowest priority, unless told otherwise: the tests get what a busy
machine leaves them, and the hog does not take the machine from everyone else on it.
``python scripts/cpu_hog.py [--nice N]``; more cores' worth is more of them.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description="Keeps one CPU core busy until killed.")
    parser.add_argument("--nice", type=int, default=19, help="its niceness (0 to 19)")
    args = parser.parse_args()
    os.nice(args.nice)
    while True:
        pass


if __name__ == "__main__":
    main()
