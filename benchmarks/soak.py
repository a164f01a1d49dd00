"""Invariants at soak depth: the at-scale hypothesis tests of tests/test_invariants.py with
the "soak" profile (10,000 random workloads each instead of CI's 1,000 derandomised ones).

    python benchmarks/soak.py [--profile soak|ci]

Prints the workloads run, the time, and pytest's verdict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_invariants.py::test_invariants_at_scale",
         "tests/test_invariants.py::test_values_across_int64_are_refused_in_one_line_or_served"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="soak", choices=["soak", "ci"])
    args = ap.parse_args()
    env = dict(os.environ, CHUNKPILOT_INVARIANTS=args.profile)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--hypothesis-show-statistics", *TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    dt = time.perf_counter() - t0
    examples = [line.strip() for line in out.stdout.splitlines() if "passing examples" in line]
    print(f"profile {args.profile}: {len(TESTS)} tests in {dt:.0f} s")
    for test, line in zip(TESTS, examples):
        print(f"  {test.split('::')[1]}: {line}")
    print(out.stdout.strip().splitlines()[-1])
    sys.exit(out.returncode)


if __name__ == "__main__":
    main()
