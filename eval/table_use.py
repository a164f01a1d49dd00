"""What a table does where the choice matters: its streams replayed at its own capacity,
every pass it decides recorded (the cell's value, the tokens it became, the running
decodes) and pooled into shares per cell value and per 2^(1/4) token-budget bin, and the
budget against the running decodes (``eval.usage.action_histogram``). The export
measures its tables so; ``eval capacity`` and the suite, every table they evaluate.
"""

from __future__ import annotations

import numpy as np

from envs.scenario import Scenario
from envs.seeds import CAPACITY_SEEDS
from eval.capacity import probe_stream
from eval.parallel import make_executor
from eval.usage import ActionTrace, action_histogram, budget_label, used_text
from policies.table import BudgetTable
from policies.table_policy import TablePolicy


class TableTrace(ActionTrace):
    """A table driving the simulator, recording each pass it decides (decodes running: with
    none the budget is the cap whatever the cell holds): the cell's value (a fraction of
    the ITL target, or a token budget), the tokens it became and the running decodes."""

    def __init__(self, table: BudgetTable | TablePolicy):
        policy = table if isinstance(table, TablePolicy) else TablePolicy(table)
        super().__init__(policy)
        self.cells = policy.table.action.cells

    def __call__(self, state) -> int:
        b = self.policy(state)
        if state.running_decodes:
            self.record(self.used(float(self.cells[self.policy.cell(state)])), b,
                        state.running_decodes)
        return b

    def used(self, cell: float) -> float:
        """A cell's fraction as served: no more than the table's cap or the policy's."""
        action, cap_s = self.policy.table.action, self.policy.max_pass_s
        top = action.max_fraction
        if cap_s is not None and hasattr(action, "itl_s"):
            top = cap_s / action.itl_s if top is None else min(top, cap_s / action.itl_s)
        return cell if top is None else min(cell, top)


def _trace_task(scenario: Scenario, table: BudgetTable | TablePolicy, workload) -> tuple[list, list, list]:
    trace = TableTrace(table)
    scenario.simulator(workload).run(trace)
    return trace.values, trace.budgets, trace.decodes


def use_tasks(table: BudgetTable | TablePolicy, scenarios, factors, num_requests: int,
              seed_base: int) -> list:
    """One trace task per stream with a capacity: each scenario's stream ``i`` (drawn from
    ``seed_base`` as its capacity search drew it) at ``factors[scenario][i]`` times the
    scenario's load; 0, no capacity, is left out. A table policy is traced as it was
    evaluated (a table for other hardware converts with its stored cost model)."""
    tasks = []
    for sc, row in zip(scenarios, factors):
        for i, f in enumerate(row):
            if f > 0:
                at, workload = probe_stream(sc, i, len(row), num_requests, float(f), seed_base=seed_base)
                tasks.append((at, table, workload))
    return tasks


def pooled_use(table: BudgetTable, found: list) -> dict:
    """The traces of :func:`use_tasks`, pooled (``streams`` 0 where none had a capacity)."""
    values = [v for vs, _, _ in found for v in vs]
    budgets = [b for _, bs, _ in found for b in bs]
    decodes = [d for _, _, ds in found for d in ds]
    hist = action_histogram(values, sorted(set(table.action.cells)), budgets, decodes,
                            time_fractions=table.action.kind == "time_fraction")
    return {"streams": len(found), "action": table.action.kind, **hist}


def table_use(table: BudgetTable, scenarios: dict, factors: np.ndarray, num_requests: int,
              seed_base: int, workers=None, served: list[TablePolicy] | None = None) -> dict:
    """What the table does at its own capacity on each scenario's streams (``factors``: per
    scenario and stream, as a multiple of the scenario's load), every pass it decides
    pooled. At one SLO a fraction of the ITL target still becomes a different budget with
    each pass's decodes. ``served``: the table as it serves each scenario (a table that
    carries, re-priced for each), if not the table itself."""
    per = served or [table] * len(scenarios)
    tasks = [t for sc, p, row in zip(scenarios.values(), per, factors)
             for t in use_tasks(p, [sc], [row], num_requests, seed_base)]
    return pooled_use(table, make_executor(workers).map(_trace_task, tasks) if tasks else [])


def tables_use(studies, policies, num_requests: int, executor, progress=None) -> list[dict]:
    """For each capacity study and its policies, what each table among them does at its own
    capacity on the study's streams (table name -> :func:`pooled_use`), every trace one
    fan-out."""
    jobs = [(k, p, use_tasks(p, [st.scenario], [st.policies[p.name].factors], num_requests,
                             CAPACITY_SEEDS))
            for k, (st, ps) in enumerate(zip(studies, policies)) for p in ps if p.kind == "table"]
    tasks = [t for _, _, ts in jobs for t in ts]
    found = executor.map(_trace_task, tasks, progress) if tasks else []
    out: list[dict] = [{} for _ in studies]
    start = 0
    for k, p, ts in jobs:
        out[k][p.name] = pooled_use(p.table, found[start:start + len(ts)])
        start += len(ts)
    return out


def use_line(use: dict, kind: str, streams: str = "held-out streams") -> str:
    """What the table did at its capacity on ``streams``, in one line."""
    if not use["streams"]:
        return f"no capacity under the SLO on any of the {streams}: nothing to show"
    n = use["used_5pct"]
    what = (("fraction" if n == 1 else "fractions") + " of the ITL target" if kind == "time_fraction"
            else "budget" if n == 1 else "budgets")
    line = (f"at its capacity on {use['streams']} {streams} ({use['passes']:,} passes it "
            f"decided): {n} {what} each in at least 5% of them ({used_text(use['shares'])})")
    if "budget_shares" in use:
        groups = ", ".join(f"{r['decodes']}: {r['median_budget']:,.0f}" for r in use["by_decodes"])
        line += (f"; token budgets in bins of 2^(1/4): {use['budgets_5pct']} bins each in at least "
                 f"5% ({used_text(use['budget_shares'], budget_label)}); median budget by running "
                 f"decodes {groups}")
    return line
