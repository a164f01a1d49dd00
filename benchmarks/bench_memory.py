"""Peak memory of `python -m envs.simulate` on synthetic requests: the default scenario at 4
requests/s, budget 2,048, each size in a fresh process.

    python benchmarks/bench_memory.py [--sizes 10000,100000,1000000]

Prints peak RSS (MB) and wall time per size, with exact records and with --summary-only,
and the bytes a finished request costs (the growth of peak RSS per request).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import contextlib, io, json, resource, sys, time\n"
    "from envs.simulate import main\n"
    "buf = io.StringIO(); t0 = time.perf_counter()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    main(sys.argv[1:] + ['--json'])\n"
    "s = json.loads(buf.getvalue())\n"
    "print(json.dumps({'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,\n"
    "                  'wall_s': time.perf_counter() - t0, 'passes': s['passes'],\n"
    "                  'itl_p99_s': s['itl_p99_s'], 'ttft_p99_s': s['ttft_p99_s']}))\n"
)


def measure(n: int, summary_only: bool) -> dict:
    argv = ["--num-requests", str(n)] + (["--summary-only"] if summary_only else [])
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    sizes = [int(s) for s in ap.parse_args().sizes.split(",")]
    print(f"{'requests':>10} {'mode':>13} {'peak RSS':>10} {'wall':>8} {'passes':>12} {'ITL p99':>10}")
    for mode in (False, True):
        rows = []
        for n in sizes:
            r = measure(n, mode)
            rows.append((n, r))
            print(f"{n:>10,} {'summary-only' if mode else 'exact':>13} {r['rss_mb']:>8.0f} MB "
                  f"{r['wall_s']:>6.1f} s {r['passes']:>12,} {r['itl_p99_s'] * 1e3:>7.3f} ms")
        if len(rows) > 1:
            (n0, a), (n1, b) = rows[0], rows[-1]
            print(f"{'':>10} {'':>13} {(b['rss_mb'] - a['rss_mb']) * 2**20 / (n1 - n0):>8.0f} B a request "
                  f"from {n0:,} to {n1:,}")


if __name__ == "__main__":
    main()
