"""How much of a cell search the refinement skips: the cell-streams a table never looks up.

    python benchmarks/bench_refine.py RUN_DIR TABLE [--streams 14] [--refine-on serving|final]

``eval export --refine-streams N`` tries values cell by cell, each a capacity search per
stream. A table that differs from the current one only in a cell the current one never
reads on a stream runs every probe there as it does (the simulator is deterministic), so
the search measures a cell only on the streams that read it. This prints, for ``TABLE``
on the refinement's streams of ``RUN_DIR``'s serving scenario (``--refine-on serving``,
the export's default) or of it and its variants (``final``), the share of (cell, stream)
pairs measured, and what a sweep trying one value per cell would take over every pair
and over those alone, at the time one recording search per stream took here.
"""

from __future__ import annotations

import argparse
import time

from envs.scenario import Scenario
from envs.seeds import TABLE_REFINE_SEEDS
from eval.export.refine import cells_looked_up
from eval.parallel import make_executor
from eval.scenarios import final_scenarios
from policies.learned import load_run
from policies.table import BudgetTable


def _warm(i: int) -> int:
    return i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("table")
    ap.add_argument("--streams", type=int, default=14)
    ap.add_argument("--refine-on", choices=["serving", "final"], default="serving")
    ap.add_argument("--requests", type=int, default=600)
    args = ap.parse_args()
    serving = Scenario(**load_run(args.run_dir).config["scenario"])
    scenarios = list(final_scenarios(serving).values()) if args.refine_on == "final" else [serving]
    table = BudgetTable.load(args.table)
    executor = make_executor(None)
    executor.map(_warm, [(i,) for i in range(4)])  # start the workers before the clock
    t0 = time.perf_counter()
    seen, _ = cells_looked_up(table, scenarios, args.streams, args.requests, TABLE_REFINE_SEEDS,
                              executor)
    seconds = time.perf_counter() - t0
    cells, pairs = len(table.action.cells), sum(len(s) for s in seen)
    every = cells * len(seen)
    print(f"{args.table}: {cells} cells, {len(seen)} streams "
          f"({args.refine_on}); read: {pairs:,} of {every:,} cell-streams ({pairs / every:.0%}), "
          f"{len(set.union(*seen))} cells on at least one stream")
    print(f"one table's search on every stream: {seconds:.1f} s; a sweep trying one value per cell: "
          f"{seconds * cells:.0f} s over every cell-stream, {seconds * pairs / len(seen):.0f} s over "
          f"those read")


if __name__ == "__main__":
    main()
