"""Sweep speed: the evaluation suite on a subset of scenarios in this process
(``--workers 1``) and fanned out on a local Ray instance (``--workers 2``), with the
reports compared for identity.

    python benchmarks/bench_sweep.py [--scenarios mixed-high,kv-pressure,a100-mixed,laptop] [--seeds 3]

Target: with 2 workers on a 2-core machine, at most 60% of
the in-process time, and identical results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(workers: int, out: Path, scenarios: str, seeds: int, policies: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eval", "suite", "--scenarios", scenarios, "--seeds",
                    str(seeds), "--policies", policies, "--workers", str(workers), "--out",
                    str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="mixed-high,kv-pressure,a100-mixed,laptop")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policies", default="vllm-default,queue-depth,time-budget,time-budget-kv")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, Path(tmp) / "one", args.scenarios, args.seeds, args.policies)
        two = run(2, Path(tmp) / "two", args.scenarios, args.seeds, args.policies)
        a = json.loads((Path(tmp) / "one" / "suite.json").read_text())
        b = json.loads((Path(tmp) / "two" / "suite.json").read_text())
    print(f"suite on {args.scenarios} ({args.seeds} streams): {one:.1f} s with 1 worker, "
          f"{two:.1f} s with 2 Ray workers ({two / one:.0%}); results identical: {a == b}")


if __name__ == "__main__":
    main()
