"""Table lookups per second (the runtime an engine vendors).

    python benchmarks/bench_table.py [--table tables/h100-sxm__llama-3-8b.json]
"""

from __future__ import annotations

import argparse
import random
import time

from policies.table import BudgetTable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="tables/h100-sxm__llama-3-8b.json")
    ap.add_argument("--lookups", type=int, default=500_000)
    args = ap.parse_args()
    table = BudgetTable.load(args.table)
    rng = random.Random(0)
    rows = [[rng.randint(0, 256), rng.randint(0, 64), rng.randint(0, 200_000), rng.random()]
            for _ in range(1000)]
    t0 = time.perf_counter()
    for i in range(args.lookups):
        table.lookup_values(rows[i % 1000])
    lv = time.perf_counter() - t0
    named = [dict(zip(table.features, r)) for r in rows]
    t0 = time.perf_counter()
    for i in range(args.lookups // 5):
        table.lookup(**named[i % 1000])
    ln = time.perf_counter() - t0
    print(f"{table.cells} cells, {len(table.features)} features: lookup_values "
          f"{args.lookups / lv:,.0f}/s ({lv / args.lookups * 1e6:.2f} us each); lookup(**named) "
          f"{args.lookups / 5 / ln:,.0f}/s ({ln / (args.lookups / 5) * 1e6:.2f} us each)")


if __name__ == "__main__":
    main()
