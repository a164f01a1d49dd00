"""Export a trained policy as a lookup table that an engine reads in microseconds.

    python -m eval export RUN_DIR --out tables/NAME.json [--csv tables/NAME.csv]

1. Visited states: the trained model drives the simulator on the run's scenario at
   loads across its training range; every decision's engine-readable features
   (running decodes, waiting requests, waiting prefill tokens, KV usage) and the
   model's budget are recorded.
2. Buckets: each feature's edges are quantiles of the values visited, so cells sit
   where the policy actually spends its time.
3. Cells: the budget the model chose most often in that cell. Cells never visited take
   the budget of the nearest visited cell (fewest bucket steps away, ties to the
   more visited one) and are flagged ``visited: 0``.
4. Fidelity, on arrivals the table was not built from: agreement between table and
   model on visited states, and the goodput / p99 TTFT / p99 ITL of ``model:`` and
   ``table:`` on the same arrivals. A table losing more than 3% of the model's goodput
   says so loudly.
5. Provenance: the scenario's hardware, model shape and SLO, which the runtime compares
   with what it serves (``python -m policies.table check``, the vLLM schedulers, eval).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.cli import parse
from envs.errors import ConfigError, integer, show
from envs.files import check_distinct, check_output
from envs.workload import check_num_requests
from envs.scenario import Scenario
from envs.seeds import TABLE_BUILD_SEEDS, TABLE_FIDELITY_SEEDS
from eval.harness import evaluation_workloads, run_policies, run_policy
from policies.table import (KIND, SCHEMA_VERSION, BudgetTable, hardware_provenance,
                            model_provenance, write_atomic)
from policies.table_policy import FEATURE_GETTERS

FEATURES = ("running_decodes", "waiting_requests", "waiting_prefill_tokens", "kv_usage")
LOUD_GOODPUT_LOSS = 0.03
MAX_BUCKETS = 32
"""Buckets per feature: 32 over four features is a million cells (a few MB of JSON)."""
MAX_RUNS = 1000


@dataclass(frozen=True)
class ExportArgs:
    """Export a train.py run's policy as a bucketed lookup table."""

    run_dir: str = ""
    """The train.py run directory (also accepted as the first positional argument)."""
    out: str = "tables/policy.json"
    """Where to write the table (JSON, written atomically)."""
    csv: str | None = None
    """Also write the table as CSV for people and spreadsheets."""
    buckets: int = 6
    """Buckets per feature (fewer when a feature takes fewer distinct values)."""
    build_runs: int = 4
    """Simulated streams whose decisions the table is built from (loads across training's range)."""
    build_requests: int = 600
    """Requests per build stream."""
    fidelity_runs: int = 2
    """Held-out streams for the fidelity report."""
    fidelity_requests: int = 1000
    """Requests per fidelity stream."""


class Recorder:
    """Wraps a policy and records every decision: the table's features and the budget."""

    def __init__(self, policy):
        self.policy, self.name, self.kind = policy, policy.name, policy.kind
        self.getters = [FEATURE_GETTERS[f] for f in FEATURES]
        self.feats: list[list[float]] = []
        self.budgets: list[int] = []

    def reset(self) -> None:
        self.policy.reset()

    def __call__(self, state) -> int:
        b = self.policy(state)
        self.feats.append([g(state) for g in self.getters])
        self.budgets.append(b)
        return b


def collect(policy, scenario: Scenario, workloads) -> tuple[np.ndarray, np.ndarray]:
    """(features, budgets) of every decision the policy makes on these arrivals."""
    rec = Recorder(policy)
    run_policy(scenario, rec, workloads)
    return (np.asarray(rec.feats, dtype=np.float64).reshape(-1, len(FEATURES)),
            np.asarray(rec.budgets))


def quantile_edges(values: np.ndarray, buckets: int) -> list[float]:
    qs = np.linspace(0, 1, buckets + 1)[1:-1]
    edges = np.unique(np.quantile(values, qs)) if len(values) else np.zeros(0)
    # An edge at the minimum would leave the lowest bucket empty.
    return [float(e) for e in edges if len(values) and e > values.min()]


def scenario_provenance(scenario: Scenario) -> dict:
    """The hardware, model and SLO a table is built for, as the runtime checks them."""
    return {"hardware": hardware_provenance(scenario.hardware_profile()),
            "model": model_provenance(scenario.model_profile()),
            "slo": {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s}}


def build_table(feats: np.ndarray, budgets: np.ndarray, buckets: int,
                provenance: dict) -> BudgetTable:
    edges = [quantile_edges(feats[:, j], buckets) for j in range(len(FEATURES))]
    skeleton = BudgetTable({"schema_version": SCHEMA_VERSION, "kind": KIND,
                            "action": {"kind": "tokens"},
                            "features": [{"name": n, "edges": e} for n, e in zip(FEATURES, edges)],
                            "budgets": [1] * int(np.prod([len(e) + 1 for e in edges])),
                            "default_budget": 1, "provenance": provenance})
    cells = np.array([skeleton.cell(row) for row in feats], dtype=np.int64)
    table = np.zeros(skeleton.cells, dtype=np.int64)
    counts = np.bincount(cells, minlength=skeleton.cells)
    for c in np.flatnonzero(counts):
        vals, n = np.unique(budgets[cells == c], return_counts=True)
        table[c] = int(vals[np.argmax(n)])  # the budget chosen most often there
    # Unvisited cells: nearest visited cell in bucket steps (ties: the more visited one).
    shape = [len(e) + 1 for e in edges]
    coords = np.array(np.unravel_index(np.arange(skeleton.cells), shape)).T
    seen = np.flatnonzero(counts)
    for c in np.flatnonzero(counts == 0):
        dist = np.abs(coords[seen] - coords[c]).sum(axis=1)
        near = seen[dist == dist.min()]
        table[c] = table[near[np.argmax(counts[near])]]
    data = skeleton.to_dict()
    data["budgets"] = [int(b) for b in table]
    data["visited"] = [int(v > 0) for v in counts]
    values, n = np.unique(budgets, return_counts=True)
    data["default_budget"] = int(values[np.argmax(n)])
    return BudgetTable(data)


def parse_args(argv: list[str]) -> ExportArgs:
    """RUN_DIR may come first, as a positional argument."""
    positional = [a for a in argv[:1] if not a.startswith("-")]
    args = parse(ExportArgs, argv[len(positional):], prog="python -m eval export RUN_DIR")
    if positional:
        args = ExportArgs(**{**args.__dict__, "run_dir": positional[0]})
    if not args.run_dir:
        raise ConfigError("run_dir: missing; usage: python -m eval export RUN_DIR --out PATH")
    integer("buckets", args.buckets, 1, MAX_BUCKETS, f"{MAX_BUCKETS}^4 cells is a million")
    for f in ("build_runs", "fidelity_runs"):
        integer(f, getattr(args, f), 1, MAX_RUNS)
    for f in ("build_requests", "fidelity_requests"):
        check_num_requests(f, getattr(args, f))
    # The outputs before the run: an export is minutes of simulation.
    check_output("out", args.out)
    if args.csv is not None:
        check_output("csv", args.csv)
    check_distinct(out=args.out, csv=args.csv)
    run = Path(args.run_dir)
    if not run.is_dir() or not (run / "config.json").is_file():
        what = "does not exist" if not run.exists() else (
            "is not a folder" if not run.is_dir() else "holds no config.json")
        raise ConfigError(f"run_dir: {show(args.run_dir, 200)} {what}; must be a train.py run directory")
    return args


def export_workloads(scenario: Scenario, train_args: dict, args: ExportArgs):
    """(streams to build the table from, at loads across training's range; held-out streams)."""
    if scenario.trace:
        return (evaluation_workloads(scenario, 1, eval_span=(0.0, 0.8)),
                evaluation_workloads(scenario, 1))
    lo, hi = train_args.get("rate_low", 1.0), train_args.get("rate_high", 1.0)
    factors = np.linspace(lo, hi, args.build_runs)
    build = [scenario.with_fields(rate=scenario.rate * f, num_requests=args.build_requests)
             .workload(TABLE_BUILD_SEEDS + i) for i, f in enumerate(factors)]
    held = [scenario.with_fields(num_requests=args.fidelity_requests)
            .workload(TABLE_FIDELITY_SEEDS + i) for i in range(args.fidelity_runs)]
    return build, held


def fidelity(model, table: BudgetTable, scenario: Scenario, held) -> dict:
    """Agreement on states from held-out arrivals, then both policies end to end."""
    from policies.table_policy import TablePolicy

    held_feats, held_budgets = collect(model, scenario, held)
    table_budgets = np.array([table.lookup_values(row) for row in held_feats])
    agree = float(np.mean(table_budgets == held_budgets)) if len(held_budgets) else math.nan
    within2 = float(np.mean(np.abs(np.log2(table_budgets / held_budgets)) <= 1)) if len(
        held_budgets) else math.nan
    res = run_policies(scenario, [model, TablePolicy(table, name="table")], held)
    m, t = res[model.name].summary(), res["table"].summary()
    loss = (m["goodput"] - t["goodput"]) / m["goodput"] if m["goodput"] > 0 else 0.0
    return {
        "held_out_states": int(len(held_budgets)), "agreement": agree, "agreement_within_2x": within2,
        "model_goodput": m["goodput"], "table_goodput": t["goodput"], "goodput_loss": loss,
        "model_ttft_p99_s": m["ttft_p99_s"], "table_ttft_p99_s": t["ttft_p99_s"],
        "model_itl_p99_s": m["itl_p99_s"], "table_itl_p99_s": t["itl_p99_s"],
        "streams": len(held), "visited_cells": int(sum(table.visited)), "cells": table.cells,
    }


def provenance(scenario: Scenario, config: dict, run_dir: str) -> dict:
    targs = config["args"]
    return {
        **scenario_provenance(scenario),
        "workload": targs.get("trace") or targs.get("workload"), "run_dir": str(run_dir),
        "algo": targs.get("algo"), "commit": config.get("commit"),
        "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rule": "cell = the model's most frequent budget among visited states; unvisited cells "
                "= nearest visited cell",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from agents.runs import load_run

    model = load_run(args.run_dir)
    config = model.config
    scenario = Scenario(**config["scenario"])
    build, held = export_workloads(scenario, config["args"], args)
    t0 = time.perf_counter()
    feats, budgets = collect(model, scenario, build)
    table = build_table(feats, budgets, args.buckets, scenario_provenance(scenario))
    fid = fidelity(model, table, scenario, held)
    fid["build_states"] = int(len(budgets))
    data = table.to_dict()
    data["fidelity"] = fid
    data["provenance"] = provenance(scenario, config, args.run_dir)
    final = BudgetTable(data, args.out)
    final.save(args.out)
    if args.csv:
        write_atomic(args.csv, final.to_csv())
    print(f"table: {args.out} ({final.cells} cells, {fid['visited_cells']} visited, budgets "
          f"{min(final.budgets)}-{final.max_budget}; built from {len(budgets)} decisions in "
          f"{time.perf_counter() - t0:.0f} s)")
    print(f"fidelity on {len(held)} held-out streams: table = model on {fid['agreement']:.1%} of states "
          f"({fid['agreement_within_2x']:.1%} within 2x); goodput model {fid['model_goodput']:.3f} vs "
          f"table {fid['table_goodput']:.3f} ({-fid['goodput_loss']:+.1%}); p99 TTFT "
          f"{fid['model_ttft_p99_s']:.2f} vs {fid['table_ttft_p99_s']:.2f} s; p99 ITL "
          f"{fid['model_itl_p99_s'] * 1e3:.1f} vs {fid['table_itl_p99_s'] * 1e3:.1f} ms")
    if fid["goodput_loss"] > LOUD_GOODPUT_LOSS:
        print(f"WARNING: the table loses {fid['goodput_loss']:.1%} of the model's goodput (more than "
              f"{LOUD_GOODPUT_LOSS:.0%}); use more buckets or serve the model", file=sys.stderr)
    print(f"serve it in vLLM with --max-num-batched-tokens {final.max_budget} (the table's largest "
          "budget); see README")
    return 0
