"""Table lookups per second (the runtime an engine vendors).

    python benchmarks/bench_table.py [--table tables/h100-sxm__llama-3-8b.json]

``budget(state)`` is what an engine calls before each pass (a dict of the quantities the
table needs); ``lookup_values`` is the export's path (feature values in order). For a
time-fraction table, also what the speed correction adds per step: the price of the
step's shape (64 decodes and a chunk) and one ``StepScale.observe``; and what
``CHUNKPILOT_RECORD_STEPS`` adds per step (a row of that shape, its share of the writes).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from policies.step_record import StepRecorder
from policies.table import BudgetTable
from policies.table.correction import StepScale, shape_price


def per_call_us(fn, args: list, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(args[i % len(args)])
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="tables/h100-sxm__llama-3-8b.json")
    ap.add_argument("--lookups", type=int, default=500_000)
    args = ap.parse_args()
    table = BudgetTable.load(args.table)
    rng = random.Random(0)
    ranges = {"running_decodes": 256, "waiting_requests": 64, "waiting_prefill_tokens": 200_000,
              "decode_context_tokens": 2_000_000, "head_prefilled_tokens": 16_384,
              "head_remaining_tokens": 16_384, "itl_slow_tokens": 400, "itl_decode_tokens": 50_000}
    states = [{n: (rng.randint(0, ranges[n]) if n in ranges else rng.random())
               for n in table.needs} for _ in range(1000)]
    value = getattr(table.action, "value", lambda n, s: s[n])  # derived features, e.g. the slack
    rows = [[value(n, s) for n in table.features] for s in states]
    budget_us = per_call_us(table.budget, states, args.lookups)
    values_us = per_call_us(table.lookup_values, rows, args.lookups)
    print(f"{table.cells} cells, {len(table.features)} features ({table.action.kind}): "
          f"budget(state) {budget_us:.2f} us ({1e6 / budget_us:,.0f}/s); lookup_values "
          f"{values_us:.2f} us ({1e6 / values_us:,.0f}/s)")
    shapes = [[(1, rng.randint(100, 4000), True)] * 64
              + [(rng.randint(1, 2048), rng.randint(0, 8000), False)] for _ in range(1000)]
    with tempfile.TemporaryDirectory() as tmp:
        rec = StepRecorder(os.path.join(tmp, "steps.csv"), max_steps=10**9)
        record_us = per_call_us(lambda shape: rec.add(shape, 0.0123), shapes, args.lookups // 10)
        rec.flush()
        size = os.path.getsize(rec.path) / rec.recorded
    print(f"step record per step (64 decodes, 1 chunk): {record_us:.2f} us, {size:.0f} bytes")
    cost = getattr(table.action, "cost", None)
    if cost is not None:
        speed = StepScale()
        price_us = per_call_us(lambda shape: shape_price(cost, shape), shapes, args.lookups // 10)
        observe_us = per_call_us(lambda r: speed.observe(1.0, r), [rng.uniform(0.5, 2) for _ in range(1000)],
                                 args.lookups)
        print(f"speed correction per step: shape_price (64 decodes, 1 chunk) {price_us:.2f} us; "
              f"StepScale.observe {observe_us:.2f} us")


if __name__ == "__main__":
    main()
