"""Stage 3, cells: a table from decisions over chosen features: its buckets and their values.

In: each feature's values per decision (and its edges, or they are found here: where the
model's choice changes along it, then quantiles), the model's action values, the
table's action (``time_action``: the cost model and ITL target it stores, or token
budgets) and provenance (what it is built for: hardware, model, SLO, and the run).
Out: a ``BudgetTable`` whose cells hold the action most often taken there (unvisited
cells the nearest visited one's), its fallback budget, and how closely it agrees with
the model on decisions (agreement, log error).
"""

from __future__ import annotations

import math
import time

import numpy as np

from envs.actions import BUDGET_CAP
from envs.scenario import Scenario
from eval.export.args import ExportArgs
from policies.table import KIND, SCHEMA_VERSION, BudgetTable, hardware_provenance, model_provenance


def quantile_edges(values: np.ndarray, buckets: int) -> list[float]:
    qs = np.linspace(0, 1, buckets + 1)[1:-1]
    edges = np.unique(np.quantile(values, qs)) if len(values) else np.zeros(0)
    # An edge at the minimum would leave the lowest bucket empty.
    return [float(e) for e in edges if len(values) and e > values.min()]


def feature_edges(values: np.ndarray, actions: np.ndarray, buckets: int, fine: int = 64) -> list[float]:
    """Edges where the policy's choice changes along this feature, then quantiles: the
    feature is cut into ``fine`` quantile slices, and an edge is kept wherever the most
    frequent action changes between neighbouring slices (most decisions first); the
    remaining of ``buckets - 1`` edges are plain quantiles. Quantiles alone put most edges
    where the states are, which is not where the choice changes (the KV cache is mostly
    far from full, and the choice changes near full)."""
    cands = quantile_edges(values, fine)
    if not cands:
        return []
    idx = np.searchsorted(cands, values, side="right")
    modes, weight = [], []
    for i in range(len(cands) + 1):
        a = actions[idx == i]
        if len(a):
            vals, n = np.unique(a, return_counts=True)
            modes.append(vals[np.argmax(n)])
            weight.append(len(a))
        else:
            modes.append(None)
            weight.append(0)
    changes = [(weight[i] + weight[i + 1], cands[i]) for i in range(len(cands))
               if modes[i] is not None and modes[i + 1] is not None and modes[i] != modes[i + 1]]
    chosen = sorted(e for _, e in sorted(changes, reverse=True)[:buckets - 1])
    for e in quantile_edges(values, buckets):
        if len(chosen) >= buckets - 1:
            break
        if e not in chosen:
            chosen.append(e)
    return sorted(chosen)


def cell_modes(cells: np.ndarray, values: np.ndarray, n_cells: int, shape: list[int]):
    """Per cell, the value chosen most often, the smallest among ties (unvisited cells: the
    nearest visited one's), and the visit counts."""
    counts = np.bincount(cells, minlength=n_cells)
    uniq, which = np.unique(values, return_inverse=True)
    votes = np.bincount(cells * len(uniq) + which.ravel(), minlength=n_cells * len(uniq))
    table = uniq[votes.reshape(n_cells, len(uniq)).argmax(axis=1)] if len(uniq) else np.zeros(n_cells)
    coords = np.array(np.unravel_index(np.arange(n_cells), shape)).T
    seen = np.flatnonzero(counts)
    for c in np.flatnonzero(counts == 0):
        dist = np.abs(coords[seen] - coords[c]).sum(axis=1)
        near = seen[dist == dist.min()]
        table[c] = table[near[np.argmax(counts[near])]]
    return table, counts


def cells_of(table: BudgetTable, feats: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The flat cell index of each of ``n`` decisions, as ``BudgetTable.cell`` finds it
    (the runtime's lookup, one decision at a time), for all of them at once."""
    idx = np.zeros(n, dtype=np.int64)
    for name, edges, stride in zip(table.features, table.edges, table.strides):
        idx += np.searchsorted(np.asarray(edges, dtype=float), feats[name], side="right") * stride
    return idx


def build_table(feats: dict[str, np.ndarray], values: np.ndarray, buckets: int, provenance: dict,
                action: dict | None = None, budgets: np.ndarray | None = None,
                edges: list[list[float]] | None = None) -> BudgetTable:
    """A table over the features in ``feats`` (name -> values per decision) whose cells hold
    the most frequent action value: token budgets, or fractions with ``action`` (the
    time-fraction spec with its cost coefficients). ``edges``: each feature's
    ``feature_edges``, when already found."""
    names = list(feats)
    if edges is None:
        edges = [feature_edges(feats[n], values, buckets) for n in names]
    shape = [len(e) + 1 for e in edges]
    n_cells = int(np.prod(shape))
    time_kind = action is not None and action.get("kind") == "time_fraction"
    cells_key = "fractions" if time_kind else "budgets"
    data = {"schema_version": SCHEMA_VERSION, "kind": KIND, "action": action or {"kind": "tokens"},
            "features": [{"name": n, "edges": e} for n, e in zip(names, edges)],
            cells_key: [1] * n_cells, "default_budget": 1, "provenance": provenance}
    cells = cells_of(BudgetTable(data), feats, len(values))
    table, counts = cell_modes(cells, values, n_cells, shape)
    data[cells_key] = [float(v) for v in table] if time_kind else [int(v) for v in table]
    data["visited"] = [int(v > 0) for v in counts]
    data["default_budget"] = default_budget(values if budgets is None else budgets)
    return BudgetTable(data)


DEFAULT_BUDGET_CAP = 8192
"""A fallback budget stays within vLLM's own default ceiling on any part."""


def default_budget(budgets: np.ndarray) -> int:
    """The budget an engine falls back to when a lookup fails: the median budget the policy
    applied (at least 1, never above ``DEFAULT_BUDGET_CAP``)."""
    return int(min(max(np.median(budgets), 1), DEFAULT_BUDGET_CAP)) if len(budgets) else 2048


def table_values(table: BudgetTable, feats: dict, n: int) -> np.ndarray:
    """The cell value the table looks up for each of ``n`` decisions (``feats``: their values)."""
    return np.asarray(table.action.cells)[cells_of(table, feats, n)]


def agreement(table: BudgetTable, feats: dict, values: np.ndarray) -> float:
    """The share of decisions on which the table takes the policy's value."""
    return float(np.mean(np.isclose(table_values(table, feats, len(values)), values))) if len(values) else math.nan


def log_error(table: BudgetTable, feats: dict, values: np.ndarray) -> float:
    """The mean distance between the table's and the policy's values in log scale (a budget
    16 times too long counts as much as 30 choices 10% off; agreement counts them 1 to 30)."""
    if not len(values):
        return math.nan
    return float(np.mean(np.abs(np.log(table_values(table, feats, len(values))) - np.log(values))))


def scenario_provenance(scenario: Scenario) -> dict:
    """The hardware, model and SLO a table is built for, as the runtime checks them."""
    return {"hardware": hardware_provenance(scenario.hardware_profile()),
            "model": model_provenance(scenario.model_profile()),
            "slo": {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s}}


def action_spec(policy, scenario: Scenario) -> dict | None:
    """The time-fraction action of a run acting in time (its cost coefficients and ITL
    target), or None for a token-budget run."""
    return time_action(scenario) if policy.actions == "time" else None


def time_action(scenario: Scenario) -> dict:
    """A time-fraction action for a scenario: its cost coefficients, ITL target and the
    operator's cap on the longest pass, where it has one (``max_fraction``)."""
    action = {"kind": "time_fraction", "itl_s": scenario.slo_itl_s, "cap": BUDGET_CAP,
              "cost": scenario.simulator_cost().as_dict()}
    if scenario.max_pass_itl is not None:
        action["max_fraction"] = scenario.max_pass_itl
    return action


def run_provenance(model, args: ExportArgs) -> dict:
    config = model.config
    prov = {"run_dir": str(args.run_dir), "algo": config["args"].get("algo"),
            "commit": config.get("commit"), "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "rule": "cell = the model's most frequent action among visited decisions; unvisited "
                    "cells = nearest visited cell"}
    if model.obs_norm is not None:
        prov["observation_normalisation"] = {"mean": list(model.obs_norm.mean),
                                             "var": list(model.obs_norm.var),
                                             "clip": model.obs_norm.clip}
    return prov
