"""Stage 6, select: which candidate table ships.

In: the model and the candidate tables (the rounds', the refined one, the rules'), the
serving scenario. Out: the index of the table that keeps most of the model's capacity
under the SLO and goodput at each final scenario's own load (the mean of the two shares),
on streams of their own, and the figures behind the choice; then the kept table's data
with its provenance saying where it came from.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from envs.scenario import Scenario
from envs.seeds import TABLE_SELECT_SEEDS
from eval.capacity import capacity_sweep
from eval.export.args import ExportArgs
from eval.export.carry import carries, judged_scenarios, table_policy
from eval.export.record import policy_for
from eval.harness import run_policy
from eval.parallel import make_executor, progress_bar
from policies.table import BudgetTable


def _goodput_task(scenario: Scenario, policy, workload) -> float:
    return float(run_policy(scenario, policy, [workload]).runs[0]["goodput"])


def goodput_runs(model, tables: list[BudgetTable], scenarios: dict, streams: int, seed_base: int,
                 num_requests: int, workers, label: str) -> np.ndarray:
    """Goodput of the model and of each table at each scenario's own load, on ``streams``
    streams from ``seed_base``: an array indexed (scenario, stream, policy), the model
    first. A table that carries serves each scenario re-priced for it."""
    carry = carries(model)
    tasks = []
    for sc in scenarios.values():
        pols = [policy_for(model, sc)] + [table_policy(t, sc, carry) for t in tables]
        for w in sc.streams(streams, seed_base, num_requests):
            tasks += [(sc, p, w) for p in pols]
    with progress_bar(len(tasks), label) as bar:
        found = np.asarray(make_executor(workers).map(_goodput_task, tasks, bar), dtype=float)
    return found.reshape(len(scenarios), -1, 1 + len(tables))


class CapacityRuns(NamedTuple):
    """Capacities of the model and of each table, each array indexed (scenario, stream,
    policy), the model first."""

    rps: np.ndarray
    """Requests per second under the SLO."""
    factors: np.ndarray
    """The same as multiples of each scenario's load."""


def capacity_runs(model, tables: list[BudgetTable], scenarios: dict, streams: int, seed_base: int,
                  num_requests: int, workers, label: str) -> CapacityRuns:
    """Capacity under the SLO of the model and of each table on each scenario, on ``streams``
    streams from ``seed_base``. A table that carries serves each scenario re-priced for it."""
    carry = carries(model)
    pairs = [(sc, p) for sc in scenarios.values()
             for p in [policy_for(model, sc)] + [table_policy(t, sc, carry) for t in tables]]
    with progress_bar(len(pairs) * streams, label) as bar:
        found = capacity_sweep(pairs, streams, num_requests, executor=make_executor(workers),
                               progress=bar, seed_base=seed_base)
    shape = (len(scenarios), 1 + len(tables), streams)
    per = [np.asarray([getattr(r, key) for r in found], dtype=float).reshape(shape).transpose(0, 2, 1)
           for key in ("per_stream", "factors")]
    return CapacityRuns(*per)


MIN_MODEL_GOODPUT = 0.1
"""Goodput of the model at or below which a stream does not judge the rounds: where it serves a
few requests in a hundred, a table's share is a matter of which few it serves (a table
can "keep" more than all of the model's goodput there while losing capacity)."""


def kept_share(found: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """Each table's figure over the model's, per (scenario, stream) where the model's is
    above ``floor``: rows of streams, a column per table. A table with no figure scores 0."""
    rows = found.reshape(-1, found.shape[-1])
    rows = rows[np.isfinite(rows[:, 0]) & (rows[:, 0] > floor)]
    return np.nan_to_num(rows[:, 1:], nan=0.0) / rows[:, :1]


def select_round(model, tables: list[BudgetTable], serving: Scenario, args: ExportArgs) -> dict:
    """The DAgger round whose table to keep: the one that keeps most of its model's
    capacity under the SLO and goodput at the final scenarios' own loads (the mean of the
    two shares), on ``args.select_streams`` streams per scenario of their own (synthetic streams
    seeded apart from the fidelity's; a trace's window is cut into that many parts, and
    its fidelity replays the same requests). Streams where the model serves no request
    (capacity) or at most ``MIN_MODEL_GOODPUT`` (goodput) are left out. The earliest round
    wins an exact tie; rounds within about 1% of each other on 9 streams are told apart
    by noise, and any of them serves. Both measures are needed: goodput at a load far
    below capacity cannot tell rounds apart, and a table can keep its model's capacity and
    lose past it (docs/learning.md has runs of each). Returns the choice and the figures
    behind it."""
    if len(tables) == 1:
        return {"chosen": 0}
    scenarios = judged_scenarios(model, serving)
    goodput = kept_share(goodput_runs(model, tables, scenarios, args.select_streams, TABLE_SELECT_SEEDS,
                                      args.fidelity_requests, args.workers, "choosing a round: goodput"),
                         MIN_MODEL_GOODPUT)
    capacity = kept_share(capacity_runs(model, tables, scenarios, args.select_streams, TABLE_SELECT_SEEDS,
                                        args.fidelity_requests, args.workers, "choosing a round: capacity").rps)
    if not len(goodput) and not len(capacity):
        return {"chosen": 0, "streams": 0}
    shares = {key: m.mean(axis=0) for key, m in (("capacity_kept", capacity), ("goodput_kept", goodput))
              if len(m)}
    score = np.mean(list(shares.values()), axis=0)
    return {"chosen": int(np.argmax(score)), "streams": int(len(capacity) or len(goodput)),
            "goodput_streams": int(len(goodput)), "seed_base": TABLE_SELECT_SEEDS,
            **{k: [float(v) for v in m] for k, m in shares.items()}}


def kept_table(rounds: list, rules: list[tuple[str, BudgetTable]],
               candidates: tuple[list[str], list[str]], selection: dict, args: ExportArgs,
               prov: dict) -> tuple[dict, list[str], int]:
    """The chosen candidate's table data, with its provenance saying what it is (a round's
    table built from the model, or a rule's: a rule that kept more of the model than every
    table built from it ships as the rule it is), its features, and how many decisions
    built it (0 for a rule's)."""
    chosen = selection["chosen"]
    if chosen < len(rounds):
        kept = rounds[chosen]
        data, names, built = kept.table.to_dict(), kept.features, len(kept.build[1])
        if 0 < chosen <= args.dagger_rounds:
            # A new dict: every round's table shares the run's provenance.
            data["provenance"] = {**data["provenance"], "rule": data["provenance"]["rule"] + (
                f"; cells also from the states the tables of the first {chosen} DAgger round(s) "
                "led to, labelled by the model")}
    else:
        _, table = rules[chosen - len(rounds)]
        data, names, built = table.to_dict(), list(table.features), 0
        run = {k: v for k, v in prov.items() if k != "observation_normalisation"}
        if "deployments" in run:  # a table that carries: a rule's carries to any deployment
            run["deployments"] = data["provenance"]["deployments"]
        data["provenance"] = {**run, "rule_spec": data["provenance"].get("rule_spec"),
                              "rule": f"{data['provenance']['rule']}: it kept more of the model's "
                              "capacity and goodput than the tables built from the model"}
    labels, kinds = candidates
    data["provenance"] = {**data["provenance"], "dagger": {
        "rounds": args.dagger_rounds, "candidates": labels, "candidate_kinds": kinds, **selection}}
    return data, names, built
