"""Stage 7, fidelity: what the kept table keeps of its model, on arrivals it was not built from.

In: the model, the table, the serving scenario, the held-out decisions. Out: the table's
``fidelity`` record: agreement on held-out decisions; capacity under the SLO of model and
table on the final scenarios (paired, with intervals); what the table does at its own
capacity (``eval.table_use``); the table against its flat twin (what its dependence on
state is worth); goodput of both at each scenario's own load.
"""

from __future__ import annotations

import numpy as np

from envs.scenario import Scenario
from envs.seeds import CAPACITY_SEEDS, TABLE_FIDELITY_SEEDS
from eval.capacity import capacity_sweep
from eval.export.args import ExportArgs
from eval.export.cells import agreement
from eval.export.features import features_of
from eval.export.carry import carries, judged_scenarios, table_policy
from eval.export.select import capacity_runs, goodput_runs
from eval.harness import Verdict, paired_verdict
from eval.parallel import make_executor, progress_bar
from eval.table_use import table_use
from policies.table import BudgetTable


LOUD_CAPACITY_LOSS = 0.01
"""A capacity loss against the model above this share gets a WARNING in the report."""
LOUD_GOODPUT_LOSS = 0.05
"""The same for goodput at the serving load (noisier per stream than capacity)."""


def fidelity(model, table: BudgetTable, serving: Scenario,
             args: ExportArgs) -> tuple[dict, dict, dict]:
    """(capacity of the model and of the table on the run's held-out final scenarios, what
    the table does at its own capacity on each of their streams (:func:`table_use`), the
    table against its flat twin there (:func:`flat_check`))."""
    if not args.fidelity_seeds:
        return {}, {}, {}
    scenarios = judged_scenarios(model, serving)
    found = capacity_runs(model, [table], scenarios, args.fidelity_seeds, CAPACITY_SEEDS,
                          args.fidelity_requests, args.workers, "fidelity")
    out = {}
    for name, runs in zip(scenarios, found.rps):
        m, t = runs[:, 0], runs[:, 1]
        v = paired_verdict(t, m)
        out[name] = {"model_capacity_rps": float(m.mean()), "table_capacity_rps": float(t.mean()),
                     "loss": -v.rel, "loss_ci95": v.half, "verdict": v.kind,
                     "model_per_stream": [float(x) for x in m], "table_per_stream": [float(x) for x in t]}
    carry = carries(model)
    use = table_use(table, scenarios, found.factors[:, :, 1], args.fidelity_requests, CAPACITY_SEEDS,
                    args.workers, [table_policy(table, sc, carry) for sc in scenarios.values()])
    return out, use, flat_check(table, scenarios, use, found.rps[:, :, 1], args, carry)


def flat_check(table: BudgetTable, scenarios: dict, use: dict, rps: np.ndarray,
               args: ExportArgs, carry: bool = False) -> dict:
    """What a time-fraction table's cells are worth: its capacity (``rps``, per scenario and
    stream) against itself with the fraction it takes most at its capacity (``use``) in
    every cell, on the same streams, paired ({} for a token table, one whose cells hold one
    fraction, or one that decided no pass). A table that ties its flat twin everywhere
    serves no better than the one-line rule the twin is."""
    if table.action.kind != "time_fraction" or len(set(table.action.cells)) < 2 or not use.get("passes"):
        return {}
    fraction = float(max(use["shares"], key=use["shares"].get))
    twin = table.flattened(fraction)
    pairs = [(sc, table_policy(twin, sc, carry, name="flat")) for sc in scenarios.values()]
    streams = rps.shape[1]
    with progress_bar(len(pairs) * streams, "flat twin") as bar:
        found = capacity_sweep(pairs, streams, args.fidelity_requests,
                               executor=make_executor(args.workers), progress=bar,
                               seed_base=CAPACITY_SEEDS)
    out = {"fraction": fraction, "scenarios": {}}
    for name, row, r in zip(scenarios, rps, found):
        v = paired_verdict(row, r.per_stream)
        out["scenarios"][name] = {"table_capacity_rps": float(np.mean(row)),
                                  "flat_capacity_rps": r.capacity, "gain": v.rel,
                                  "gain_ci95": v.half, "verdict": v.kind,
                                  "table_per_stream": [float(x) for x in row],
                                  "flat_per_stream": list(r.per_stream)}
    return out


def flat_verdict(g: dict) -> Verdict:
    """One scenario's record of :func:`flat_check` as a verdict of the table against its
    flat twin (judged again from the per-stream figures where the record keeps them)."""
    if "table_per_stream" in g:
        return paired_verdict(g["table_per_stream"], g["flat_per_stream"])
    return Verdict(g["verdict"], g["gain"], g["gain_ci95"])


def load_fidelity(model, table: BudgetTable, serving: Scenario, args: ExportArgs) -> dict:
    """Goodput of the model and of the table at each final scenario's own load (the run's
    serving rate, beyond capacity on the slower parts), on the fidelity's number of
    streams (synthetic ones seeded apart from the build's; a trace's window cut into
    parts). Capacity only asks where the SLO still holds; a table can match its model
    there and still fall apart past it, where a closed loop visits states the model never
    led to (docs/learning.md has a table that did). Streams
    where either goodput is undefined (nothing finished) are left out; with fewer than two
    left there is no verdict."""
    if not args.fidelity_seeds:
        return {}
    scenarios = judged_scenarios(model, serving)
    found = goodput_runs(model, [table], scenarios, args.fidelity_seeds, TABLE_FIDELITY_SEEDS,
                         args.fidelity_requests, args.workers, "fidelity at load")
    out = {}
    for (name, sc), pairs in zip(scenarios.items(), found):
        pairs = pairs[np.isfinite(pairs).all(axis=1)]
        m, t = pairs[:, 0], pairs[:, 1]
        load = {"trace_speed": sc.rate_scale} if sc.trace else {"rate_rps": sc.rate}
        row = {**load, "streams": int(len(m)),
               "model_goodput": float(m.mean()) if len(m) else None,
               "table_goodput": float(t.mean()) if len(t) else None,
               "model_per_stream": [float(x) for x in m], "table_per_stream": [float(x) for x in t]}
        if len(m) >= 2 and m.mean() > 0:
            v = paired_verdict(t, m)
            row.update(loss=-v.rel, loss_ci95=v.half, verdict=v.kind)
        else:
            row.update(loss=None, loss_ci95=None, verdict="not judged")
        out[name] = row
    return out


def fidelity_record(model, table: BudgetTable, serving: Scenario, args: ExportArgs, held: tuple,
                    names: list[str], action: dict | None, built: int) -> dict:
    """The table's ``fidelity`` block: every figure of this stage, on held-out arrivals."""
    capacity, use, flat = fidelity(model, table, serving, args)
    rule_check = table.fidelity.get("rule_check")
    return {"held_out_decisions": int(len(held[1])), "build_decisions": built,
            "agreement": agreement(table, features_of(names, held[0], action), held[1]),
            "capacity": capacity, "at_capacity": use, "against_flat": flat,
            "goodput": load_fidelity(model, table, serving, args),
            **({"rule_check": rule_check} if rule_check else {})}
