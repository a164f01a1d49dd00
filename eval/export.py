"""Export a trained policy as a lookup table that an engine reads in microseconds.

    python -m eval export RUN_DIR --out tables/NAME.json [--csv tables/NAME.csv]
    python -m eval export --rule time-budget-deadline[:TOP] --hardware H --model M --out PATH.json

1. Visited states: the trained model drives the simulator on episodes of its training
   conditions, at the table's SLO (the run's serving SLO unless ``--slo-*`` say
   otherwise); every decision's engine-readable quantities and the model's action (a
   fraction of the ITL target, or a token budget) are recorded.
2. Features: those the policy's choices depend on, picked greedily (up to
   ``--max-features``) by how much each lowers the held-out log error between the
   table's and the model's values; ``--features`` names them instead.
3. Buckets: each feature's edges are where the policy's choice changes, then quantiles of
   the values visited (``feature_edges``), unless ``--features`` gives them. Cells: the
   action chosen most often there; unvisited cells take the nearest visited cell's
   (fewest bucket steps, ties to the more visited) and are flagged ``visited: 0``.
4. The action mapping: a time-fraction table stores the cost model's coefficients for
   its hardware and model (``policies.table.COST_FIELDS``) and its ITL target, so that
   an engine turns a fraction into tokens exactly as the simulator does; the model's
   observation normalisation is recorded with the provenance.
   Then DAgger: the table drives the same episodes, the model labels the states it leads
   to, and features and cells are made again from all the decisions, for
   ``--dagger-rounds`` rounds; the round whose table keeps most of the model's capacity
   and goodput at load (the mean of the two shares), on streams of its own, is kept.
   With ``--refine-streams N`` one more candidate competes: a table refined cell by cell
   on closed-loop capacity over N streams of the serving scenario, or with
   ``--refine-on final`` of it and each of its variants (``refine``), where the model's
   choice is split within a cell and only the closed loop tells which value serves; a
   refined table the choice does not keep is written to the run directory.
5. Fidelity, on arrivals the table was not built from: agreement on decisions, and the
   capacity under the SLO of the model and of the table on the run's held-out final
   scenarios (with 95% intervals). A table more than 1% below the model says so loudly.
6. Provenance: the hardware, model shape and SLO, which the runtime compares with what
   it serves (``python -m policies.table check``, the vLLM schedulers, eval).

A rule is a table too (``--rule``): the time-budget rules choose a fraction of the ITL
target by thresholds on quantities an engine has (the p99 slack, the prefill queue's due
time), so a table of 1, 2 or 4 cells over them makes the rule's budget at every pass; it
is checked against the rule on the scenario's stream before it is written. The
export of a run weighs rules' tables (``--rules``: by default the deadline rules and
``time-budget-slack:7``) against its DAgger
rounds' on the same streams and measures, and writes a rule's table where it keeps more
of the model's figures than every round's: a learned table that does not beat the rule
it learned from is not worth shipping.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from envs.cli import parse
from envs.errors import ConfigError, integer, number, require, show
from envs.files import check_distinct, check_output
from envs.workload import check_num_requests
from envs.scenario import Scenario
from envs.seeds import (TABLE_BUILD_SEEDS, TABLE_FIDELITY_SEEDS, TABLE_REFINE_SEEDS,
                        TABLE_SELECT_SEEDS)
from eval.harness import NOT_JUDGED, Verdict, run_policy
from envs.pricing import Coefficients, decode_pass_s, prefill_due_s
from envs.slack import slack_passes
from policies.table import (DERIVED, KIND, SCHEMA_VERSION, SLACK_COUNTS, STATE, BudgetTable,
                            hardware_provenance, model_provenance, write_atomic)
from policies.table_policy import TablePolicy, read_inputs
from eval.table_use import table_use, use_line

LOUD_CAPACITY_LOSS = 0.01
LOUD_GOODPUT_LOSS = 0.05
CANDIDATES = tuple(n for n in STATE if n not in SLACK_COUNTS) + tuple(DERIVED)
"""Features a table may bucket (the slack counts enter only through ``itl_slack_passes``)."""
MAX_BUCKETS = 32
"""Buckets per feature: 32 over four features is a million cells (a few MB of JSON)."""
MAX_EPISODES = 1000


@dataclass(frozen=True)
class ExportArgs:
    """Export a train.py run's policy as a bucketed lookup table (a rule as a table: python -m
    eval export --rule RULE --help)."""

    run_dir: str = ""
    """The train.py run directory (also accepted as the first positional argument)."""
    out: str = "tables/policy.json"
    """Where to write the table (JSON, written atomically)."""
    csv: str | None = None
    """Also write the table as CSV for people and spreadsheets."""
    buckets: int = 8
    """Buckets per feature (fewer when a feature takes fewer distinct values)."""
    max_features: int = 4
    """Features picked at most (greedily, by the held-out log error against the model)."""
    features: str | None = None
    """Comma-separated features to use instead of picking them, each with its own edges if
    given (``prefill_due_s:6:8:10``: buckets below 6, 6-8, 8-10 and from 10 on), else
    edges where the model's choice changes."""
    slo_ttft_s: float | None = None
    """The SLO the table serves (default: the run's serving SLO)."""
    slo_itl_s: float | None = None
    """The SLO the table serves (default: the run's serving SLO)."""
    build_episodes: int = 24
    """Episodes of the training conditions whose decisions build the table."""
    held_episodes: int = 8
    """Held-out episodes for the agreement figure."""
    dagger_rounds: int = 2
    """Rounds of dataset aggregation (DAgger): the table drives the build and held-out
    episodes, the model labels every state it leads to, and features and cells are made
    again from all the decisions so far; the round whose table keeps most of the model's
    capacity and goodput at load on streams of its own is kept (0: the model's own
    decisions only)."""
    rules: str = ("time-budget-deadline:4,time-budget-deadline:16,time-budget-deadline-kv:4,"
                  "time-budget-deadline-kv:16,time-budget-slack:7")
    """Rules whose exact tables (as ``--rule`` writes them) compete with the DAgger rounds'
    tables on the same streams and measures; a rule's table is written where it keeps more
    of the model's capacity and goodput than every round's (comma-separated; "none": the
    rounds only). Only for runs acting in time. ``time-budget-slack:7`` spends the slack on
    every prompt, in passes of up to 7 times the ITL target (0.7 s at 100 ms, a third of a
    2 s TTFT target): where a pass's fixed part is a large share of one within the target,
    few long passes prefill faster than the deadline rules' passes within it
    (docs/learning.md)."""
    select_streams: int = 3
    """Streams per final scenario (the serving one and its variants) on which the export
    chooses among the rounds', the rules' and the refined table, each seeded apart. Where
    each stream's capacity is jagged, tables a few percent apart need more: on the L40S's
    bursty long prompts 3 kept a round that 12 did not, and that round lost 4-16% against
    the shipped table on held-out streams (docs/learning.md). Each stream adds a capacity
    search and a run per table and scenario."""
    refine_streams: int = 0
    """Refine a table cell by cell in closed loop on this many streams of the serving
    scenario of their own (0: not at all): from the best there of the rounds' tables and
    one built from the model's decisions at its capacity, each cell tries the values the
    model takes in at least 1% of its decisions, and a value is kept where it raises the
    mean capacity under the SLO by more than 0.8%; two sweeps. The refined table then
    competes with the rounds and the rules on the choice's streams, like them. A table
    copies its model's most frequent choice per cell, and where the model's choice is
    split within a cell only the closed loop tells which value serves (the laptop's: 40
    streams, 13 minutes; the L40S's 108 cells on 14 streams of each final scenario: 43
    minutes for two sweeps, each cell measured only on the streams that read it, 55-60%
    of them). Where the choice keeps
    another table the refined one is written to the run directory as refined_table.json;
    the search keeps its place there (refine_progress.json), and an export killed during
    it and started again with the same flags goes on from the last cell done."""
    refine_on: str = field(default="serving", metadata={"choices": ["serving", "final"]})
    """Where --refine-streams refines: the serving scenario, or "final": it and its variants
    (+3 ms per pass, a tight KV cache), each on that many streams, as the choice and the
    fidelity check judge (on the L40S, cells refined on the serving scenario alone spent
    16x in states its variants reach and lost 11% of the capacity under the tight cache)."""
    fidelity_seeds: int = 5
    """Streams per capacity in the fidelity check (0: skip it)."""
    fidelity_requests: int = 600
    """Requests per stream of the fidelity check."""
    workers: int | None = None
    """The fidelity check's and the round choice's runs on a local Ray instance (default: all cores)."""


@dataclass(frozen=True)
class RuleExportArgs(Scenario):
    """Write a time-budget rule as a lookup table for a scenario's hardware, model and SLO;
    the table is checked against the rule at every pass of the scenario's stream
    (--num-requests, --seed, or a trace's window)."""

    rule: str = "time-budget-deadline"
    """The rule: time-budget[:FRACTION], time-budget-slack[:TOP], time-budget-deadline[:TOP] or
    time-budget-deadline-kv[:TOP]."""
    out: str = "rule-table.json"
    """Where to write the table (JSON, written atomically)."""
    csv: str | None = None
    """Also write the table as CSV for people and spreadsheets."""


RULES = ("time-budget[:FRACTION]", "time-budget-slack[:TOP]", "time-budget-deadline[:TOP]",
         "time-budget-deadline-kv[:TOP]")
"""The rules a table holds exactly: each is a time fraction chosen by thresholds on
quantities an engine has."""


class Recorder:
    """Wraps a model policy; records every decision's state quantities and action value.
    With a ``driver`` (a table policy), the driver's budget is applied and the model only
    labels the states the driver leads to."""

    def __init__(self, policy, names, driver=None):
        self.policy, self.name, self.kind = policy, policy.name, policy.kind
        self.driver = driver
        self.names = list(names)
        self.rows: list[list[float]] = []
        self.values: list[float] = []
        self.budgets: list[int] = []

    def reset(self) -> None:
        self.policy.reset()

    def __call__(self, state) -> int:
        v = self.policy.action_value(state)
        itl = self.policy.slo.itl_s
        values = read_inputs(state, self.names, itl)
        self.rows.append([values[n] for n in self.names])
        self.values.append(v)
        b = max(self.policy.budget_for_value(state, v), state.running_decodes, 1)
        self.budgets.append(b)
        return b if self.driver is None else self.driver(state)


def collect(policy, episodes, driver=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(every engine-readable quantity by name, with the model's token budget as
    ``"budget"``; the model's action value) of every decision, the model driving or, with
    ``driver``, the driver."""
    names = list(STATE)
    rows, values, budgets = [], [], []
    for sc, w in episodes:
        rec = Recorder(policy_for(policy, sc), names, driver)
        run_policy(sc, rec, [w])
        rows += rec.rows
        values += rec.values
        budgets += rec.budgets
    arr = np.asarray(rows, dtype=np.float64).reshape(-1, len(names))
    state = {n: arr[:, j] for j, n in enumerate(names)}
    state["budget"] = np.asarray(budgets, dtype=np.float64)
    return state, np.asarray(values, dtype=np.float64)


def policy_for(policy, scenario: Scenario):
    """The model policy asked to serve ``scenario``'s SLO."""
    from policies.learned import ModelPolicy

    return ModelPolicy(policy.model, scenario.slo(), policy.ladder, policy.action_type,
                       policy.name, policy.actions, policy.obs_norm)


def feature_values(name: str, state: dict, action: dict | None) -> np.ndarray:
    """One feature's value per decision; derived ones with the time-fraction ``action``'s
    coefficients, ITL target and cap (the runtime's own functions)."""
    if name == "decode_pass_s":
        cost = Coefficients.of(action["cost"])
        return np.array([decode_pass_s(cost, int(n), int(c)) for n, c in
                         zip(state["running_decodes"], state["decode_context_tokens"])])
    if name == "itl_slack_passes":
        return np.array([slack_passes(s, t, int(n)) for s, t, n in zip(
            state["itl_slow_tokens"], state["itl_decode_tokens"], state["running_decodes"])])
    if name == "prefill_due_s":
        cost, itl, cap = Coefficients.of(action["cost"]), action["itl_s"], action["cap"]
        return np.array([prefill_due_s(cost, int(n), int(c), int(q), int(w), o, itl, cap)
                         for n, c, q, w, o in zip(
                             state["running_decodes"], state["decode_context_tokens"],
                             state["head_prefilled_tokens"], state["waiting_prefill_tokens"],
                             state["oldest_wait_s"])])
    return state[name]


def features_of(names: list[str], state: dict, action: dict | None) -> dict[str, np.ndarray]:
    """The named features' values per decision."""
    return {n: feature_values(n, state, action) for n in names}


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


MIN_GAIN = 0.005
"""A feature joins the table when it lowers the held-out log error by at least this (half a
percent of a budget on average); a pair of features, by twice this."""


def pick_features(build: tuple, held: tuple, buckets: int, max_features: int, provenance: dict,
                  action: dict | None) -> tuple[list[str], float]:
    """Greedy forward selection: add the feature that most lowers the held-out log error,
    while it lowers it by at least MIN_GAIN; when no one feature does, the pair that
    lowers it most by twice that, if one does; returns the features and the held-out
    agreement. The log error, not agreement, picks: a policy that spends the p99 slack on
    5% of passes with 16 times the target changes capacity by a tenth, and agreement
    barely sees it. The pair matters because a long pass can hang on two quantities
    together (the slack and how full the cache is), each useless alone: on h100-sxm the
    single-feature pick kept no long pass and lost 4.6% of the model's capacity."""
    from itertools import combinations

    (bstate, bvals), (hstate, hvals) = build, held
    candidates = [n for n in CANDIDATES if n in bstate or (
        n in DERIVED and action and all(k in bstate for k in DERIVED[n]))]

    # Each candidate's values and edges do not depend on the others: found once.
    bfeat, hfeat = features_of(candidates, bstate, action), features_of(candidates, hstate, action)
    edges = {n: feature_edges(bfeat[n], bvals, buckets) for n in candidates}

    def score(names):
        t = build_table({m: bfeat[m] for m in names}, bvals, buckets, provenance, action,
                        budgets=bstate.get("budget"), edges=[edges[m] for m in names])
        return log_error(t, {m: hfeat[m] for m in names}, hvals), t

    chosen, best, table = [], math.inf, None
    while len(chosen) < max_features:
        rest = [n for n in candidates if n not in chosen]
        if not rest:
            break
        n, (err, t) = min(((n, score(chosen + [n])) for n in rest), key=lambda kv: kv[1][0])
        if not chosen or err <= best - MIN_GAIN:
            chosen.append(n)
            best, table = err, t
            continue
        if len(chosen) + 2 > max_features:
            break
        pair, (err, t) = min(((p, score(chosen + list(p))) for p in combinations(rest, 2)),
                             key=lambda kv: kv[1][0])
        if err > best - 2 * MIN_GAIN:
            break
        chosen += list(pair)
        best, table = err, t
    if table is None:
        return chosen, math.nan
    return chosen, agreement(table, {m: hfeat[m] for m in chosen}, hvals)


def parse_args(argv: list[str]) -> ExportArgs:
    """RUN_DIR may come first, as a positional argument."""
    positional = [a for a in argv[:1] if not a.startswith("-")]
    args = parse(ExportArgs, argv[len(positional):], prog="python -m eval export RUN_DIR")
    if positional:
        args = ExportArgs(**{**args.__dict__, "run_dir": positional[0]})
    if not args.run_dir:
        raise ConfigError("run_dir: missing; usage: python -m eval export RUN_DIR --out PATH")
    integer("buckets", args.buckets, 2, MAX_BUCKETS, f"{MAX_BUCKETS}^4 cells is a million")
    integer("max_features", args.max_features, 1, 6)
    integer("dagger_rounds", args.dagger_rounds, 0, 10)
    for f in ("build_episodes", "held_episodes"):
        integer(f, getattr(args, f), 1, MAX_EPISODES)
    seen = {}
    for spec in rule_specs(args.rules):
        name = parse_rule(spec, Scenario(), "rules")[0].name
        require(name not in seen, "rules", args.rules, f"names {name} twice ({seen.get(name)}, {spec})")
        seen[name] = spec
    integer("fidelity_seeds", args.fidelity_seeds, 0, 50)
    integer("refine_streams", args.refine_streams, 0, 100)
    integer("select_streams", args.select_streams, 1, 100)
    require(args.refine_on == "serving" or args.refine_streams, "refine_on", args.refine_on,
            "needs --refine-streams N")
    if args.features is not None:
        feature_specs(args.features)
    check_num_requests("fidelity_requests", args.fidelity_requests)
    for f in ("slo_ttft_s", "slo_itl_s"):
        if getattr(args, f) is not None:
            number(f, getattr(args, f), 0, 3600, low_open=True)
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
    if args.refine_streams:  # where a refined table the choice does not keep goes
        check_output("refined_table", refined_path(args.run_dir))
        check_output("refine_progress", progress_path(args.run_dir))
        check_distinct(out=args.out, csv=args.csv, refined_table=refined_path(args.run_dir))
    return args


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
    """A time-fraction action for a scenario: its cost coefficients and ITL target."""
    from envs.actions import BUDGET_CAP

    return {"kind": "time_fraction", "itl_s": scenario.slo_itl_s, "cap": BUDGET_CAP,
            "cost": scenario.simulator().cost.as_dict()}


def export_episodes(model, serving: Scenario, args: ExportArgs):
    """(build episodes, held-out episodes) of the run's training conditions at the table's SLO."""
    from agents.checks import draw_episodes
    from agents.training import sampler_of

    config = model.config
    sampler = sampler_of(config["args"], config.get("conditions", []), TABLE_BUILD_SEEDS)
    slo = dict(slo_ttft_s=serving.slo_ttft_s, slo_itl_s=serving.slo_itl_s)

    def at_slo(eps):
        return [(sc.with_fields(**slo), w) for sc, w in eps]

    return (at_slo(draw_episodes(serving, sampler, args.build_episodes, TABLE_BUILD_SEEDS))
            + serving_episodes(serving, TABLE_BUILD_SEEDS),
            at_slo(draw_episodes(serving, sampler, args.held_episodes, TABLE_FIDELITY_SEEDS)))


def serving_episodes(serving: Scenario, seed_base: int, loads=(0.8, 1.0, 1.2, 1.4)):
    """Streams of the serving scenario and its variants (agents.summary.final_scenarios) at
    loads around its own: the states the table is meant to serve, on arrivals of their own
    seeds (the fidelity check replays others)."""
    from agents.summary import final_scenarios

    out = []
    for k, sc in enumerate(final_scenarios(serving).values()):
        for i, f in enumerate(loads):
            at = sc.at_load(f)
            out.append((at, at.stream(0, 1, seed_base + 100 * k + i)))
    return out


def fidelity(model, table: BudgetTable, serving: Scenario,
             args: ExportArgs) -> tuple[dict, dict, dict]:
    """(capacity of the model and of the table on the run's held-out final scenarios, what
    the table does at its own capacity on each of their streams (:func:`table_use`), the
    table against its flat twin there (:func:`flat_check`))."""
    if not args.fidelity_seeds:
        return {}, {}, {}
    from agents.summary import final_scenarios
    from envs.seeds import CAPACITY_SEEDS
    from eval.harness import paired_verdict

    scenarios = final_scenarios(serving)
    found = capacity_runs(model, [table], scenarios, args.fidelity_seeds, CAPACITY_SEEDS,
                          args.fidelity_requests, args.workers, "fidelity")
    out = {}
    for name, runs in zip(scenarios, found.rps):
        m, t = runs[:, 0], runs[:, 1]
        v = paired_verdict(t, m)
        out[name] = {"model_capacity_rps": float(m.mean()), "table_capacity_rps": float(t.mean()),
                     "loss": -v.rel, "loss_ci95": v.half, "verdict": v.kind}
    use = table_use(table, scenarios, found.factors[:, :, 1], args.fidelity_requests, CAPACITY_SEEDS,
                    args.workers)
    return out, use, flat_check(table, scenarios, use, found.rps[:, :, 1], args)


def flat_check(table: BudgetTable, scenarios: dict, use: dict, rps: np.ndarray,
               args: ExportArgs) -> dict:
    """What a time-fraction table's cells are worth: its capacity (``rps``, per scenario and
    stream) against itself with the fraction it takes most at its capacity (``use``) in
    every cell, on the same streams, paired ({} for a token table, one whose cells hold one
    fraction, or one that decided no pass). A table that ties its flat twin everywhere
    serves no better than the one-line rule the twin is."""
    from envs.seeds import CAPACITY_SEEDS
    from eval.capacity import capacity_sweep
    from eval.harness import paired_verdict
    from eval.parallel import make_executor, progress_bar

    if table.action.kind != "time_fraction" or len(set(table.action.cells)) < 2 or not use.get("passes"):
        return {}
    fraction = float(max(use["shares"], key=use["shares"].get))
    twin = TablePolicy(table.flattened(fraction), name="flat")
    pairs = [(sc, twin) for sc in scenarios.values()]
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
                                  "gain_ci95": v.half, "verdict": v.kind}
    return out


def flat_verdict(g: dict) -> Verdict:
    """One scenario's record of :func:`flat_check` as a verdict of the table against its
    flat twin."""
    return Verdict(g["verdict"], g["gain"], g["gain_ci95"])


def _goodput_task(scenario: Scenario, policy, workload) -> float:
    return float(run_policy(scenario, policy, [workload]).runs[0]["goodput"])


def goodput_runs(model, tables: list[BudgetTable], scenarios: dict, streams: int, seed_base: int,
                 num_requests: int, workers, label: str) -> np.ndarray:
    """Goodput of the model and of each table at each scenario's own load, on ``streams``
    streams from ``seed_base``: an array indexed (scenario, stream, policy), the model
    first."""
    from eval.parallel import make_executor, progress_bar

    tpols = [TablePolicy(t, name="table") for t in tables]
    tasks = []
    for sc in scenarios.values():
        mpol = policy_for(model, sc)
        for w in sc.streams(streams, seed_base, num_requests):
            tasks += [(sc, p, w) for p in (mpol, *tpols)]
    with progress_bar(len(tasks), label) as bar:
        found = np.asarray(make_executor(workers).map(_goodput_task, tasks, bar), dtype=float)
    return found.reshape(len(scenarios), -1, 1 + len(tables))


def load_fidelity(model, table: BudgetTable, serving: Scenario, args: ExportArgs) -> dict:
    """Goodput of the model and of the table at each final scenario's own load (the run's
    serving rate, beyond capacity on the slower parts), on the fidelity's number of
    streams (synthetic ones seeded apart from the build's; a trace's window cut into
    parts). Capacity only asks where the SLO still holds; a table can match its model
    there and still fall apart past it, where a closed loop visits states the model never
    led to (the L40S table built from its model's decisions alone keeps its model's
    capacity and loses a quarter to nearly half of its goodput at 1.5 req/s). Streams
    where either goodput is undefined (nothing finished) are left out; with fewer than two
    left there is no verdict."""
    if not args.fidelity_seeds:
        return {}
    from agents.summary import final_scenarios
    from eval.harness import paired_verdict

    scenarios = final_scenarios(serving)
    found = goodput_runs(model, [table], scenarios, args.fidelity_seeds, TABLE_FIDELITY_SEEDS,
                         args.fidelity_requests, args.workers, "fidelity at load")
    out = {}
    for (name, sc), pairs in zip(scenarios.items(), found):
        pairs = pairs[np.isfinite(pairs).all(axis=1)]
        m, t = pairs[:, 0], pairs[:, 1]
        load = {"trace_speed": sc.rate_scale} if sc.trace else {"rate_rps": sc.rate}
        row = {**load, "streams": int(len(m)),
               "model_goodput": float(m.mean()) if len(m) else None,
               "table_goodput": float(t.mean()) if len(t) else None}
        if len(m) >= 2 and m.mean() > 0:
            v = paired_verdict(t, m)
            row.update(loss=-v.rel, loss_ci95=v.half, verdict=v.kind)
        else:
            row.update(loss=None, loss_ci95=None, verdict="not judged")
        out[name] = row
    return out


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
    streams from ``seed_base``."""
    from eval.capacity import capacity_sweep
    from eval.parallel import make_executor, progress_bar

    tpols = [TablePolicy(t, name="table") for t in tables]
    pairs = [(sc, p) for sc in scenarios.values() for p in (policy_for(model, sc), *tpols)]
    with progress_bar(len(pairs) * streams, label) as bar:
        found = capacity_sweep(pairs, streams, num_requests, executor=make_executor(workers),
                               progress=bar, seed_base=seed_base)
    shape = (len(scenarios), 1 + len(tables), streams)
    per = [np.asarray([getattr(r, key) for r in found], dtype=float).reshape(shape).transpose(0, 2, 1)
           for key in ("per_stream", "factors")]
    return CapacityRuns(*per)


MIN_MODEL_GOODPUT = 0.1
"""Goodput of the model at or below which a stream does not judge the rounds: where it serves a
few requests in a hundred (70B at 1x the Mooncake trace: 3%), a table's share is a matter
of which few it serves (its first table "kept" 155% of the model's goodput there while
losing 4.6% of its capacity)."""


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
    below capacity cannot tell rounds apart (the laptop's 0.05 req/s, where two rounds over
    its named features lost 4% of its capacity), and a table can keep its model's capacity
    and lose past it (the L40S's first table kept its capacity and lost a quarter to
    nearly half of its goodput at 1.5 req/s). Judged by goodput alone, beyond the paired
    interval, the H100's first table was kept, though its next round's kept more of its
    model's capacity (docs/learning.md). Returns the choice and the figures behind it."""
    from agents.summary import final_scenarios

    if len(tables) == 1:
        return {"chosen": 0}
    scenarios = final_scenarios(serving)
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--rule" or a.startswith("--rule=") for a in argv):
        return rule_main(argv)
    args = parse_args(argv)
    from agents.runs import load_run

    model = load_run(args.run_dir)
    serving = Scenario(**model.config["scenario"])
    serving = serving.with_fields(slo_ttft_s=args.slo_ttft_s or serving.slo_ttft_s,
                                  slo_itl_s=args.slo_itl_s or serving.slo_itl_s)
    t0 = time.perf_counter()
    action = action_spec(model, serving)
    rules = rule_candidates(args.rules, serving, action)
    names, fixed = None, {}
    if args.features:
        names, fixed = feature_specs(args.features)
        bad = [n for n in names if n in DERIVED and not action]
        require(not bad, "features", args.features, f"{bad[0] if bad else ''} needs a run acting in time")
    require(not (args.refine_streams and serving.trace), "refine_streams", args.refine_streams,
            "needs a synthetic serving scenario: a trace's parts are those the choice replays")
    build_eps, held_eps = export_episodes(model, serving, args)
    build, held = collect(model, build_eps), collect(model, held_eps)
    prov = {**scenario_provenance(serving), **run_provenance(model, args)}
    rounds = dagger_rounds(model, (build_eps, held_eps), (build, held), names, args, prov, action,
                           fixed)
    refined = []
    if args.refine_streams:
        refined = [refine(model, rounds, serving, args, prov, action)]
    labels = (round_labels(args.dagger_rounds) + ["refined"] * len(refined)
              + [spec for spec, _ in rules])
    rounds += refined
    selection = select_round(model, [r.table for r in rounds] + [t for _, t in rules], serving, args)
    chosen = selection["chosen"]
    dagger = {"rounds": args.dagger_rounds, "candidates": labels, **selection}
    if chosen < len(rounds):
        kept = rounds[chosen]
        table, names, built = kept.table, kept.features, len(kept.build[1])
        data = table.to_dict()
        if 0 < chosen <= args.dagger_rounds:
            data["provenance"]["rule"] += (f"; cells also from the states the tables of the first "
                                           f"{chosen} DAgger round(s) led to, labelled by the model")
    else:
        spec, table = rules[chosen - len(rounds)]
        names, built = table.features, 0
        data = table.to_dict()
        run = {k: v for k, v in prov.items() if k != "observation_normalisation"}
        data["provenance"] = {**run, "rule": f"{data['provenance']['rule']}: it kept more of the "
                              "model's capacity and goodput than the tables built from the model"}
    data["provenance"] = {**data["provenance"], "dagger": dagger}
    if refined and labels[chosen] != "refined":
        aside = save_refined(refined[0].table, dagger, args.run_dir)
        print(f"the refined table, not kept ({labels[chosen]} kept more of the model's capacity "
              f"and goodput on the choice's streams): {aside}", flush=True)
    capacity, use, flat = fidelity(model, table, serving, args)
    data["fidelity"] = {"held_out_decisions": int(len(held[1])), "build_decisions": built,
                        "agreement": agreement(table, features_of(names, held[0], action), held[1]),
                        "capacity": capacity, "at_capacity": use, "against_flat": flat,
                        "goodput": load_fidelity(model, table, serving, args),
                        **({"rule_check": table.fidelity["rule_check"]} if chosen >= len(rounds) else {})}
    final = BudgetTable(data, args.out)
    final.save(args.out)
    if args.csv:
        write_atomic(args.csv, final.to_csv())
    report(final, time.perf_counter() - t0, args)
    return 0


def rule_candidates(specs: str, serving: Scenario, action: dict | None) -> list[tuple[str, BudgetTable]]:
    """(spec, exact table) of each rule in ``specs`` for the serving scenario; none for a
    run acting in tokens."""
    names = rule_specs(specs)
    if action is None or not names:
        return []
    out = []
    for spec in names:
        out.append((spec, rule_table(spec, serving, serving.stream(
            0, 1, TABLE_FIDELITY_SEEDS, RULE_CHECK_REQUESTS), field="rules")))
    return out


def round_labels(rounds: int) -> list[str]:
    """The names of a DAgger export's tables: round 0 (the model's own decisions) and one
    per round."""
    return [f"round {r}" for r in range(rounds + 1)]


def rule_specs(specs: str) -> list[str]:
    """The rule specs of ``--rules``: none for "none" (alone)."""
    if specs.strip() == "none":
        return []
    names = [s.strip() for s in specs.split(",")]
    require(all(names), "rules", specs, 'must be comma-separated rule specs, or "none"')
    return names


def feature_specs(spec: str) -> tuple[list[str], dict[str, list[float]]]:
    """``--features``: the names, and the edges of those given with theirs
    (``prefill_due_s:6:8:10``); refused in one line unless every name is a quantity a table
    may bucket and every feature's edges are numbers, increasing, at most MAX_BUCKETS - 1."""
    names, fixed = [], {}
    for part in (p.strip() for p in spec.split(",")):
        name, *edges = [x.strip() for x in part.split(":")]
        require(name in CANDIDATES, "features", spec,
                f"must name quantities among {', '.join(CANDIDATES)} (got {show(name)})")
        require(name not in names, "features", spec, f"names {name} twice")
        names.append(name)
        if not edges:
            continue
        try:
            values = [float(e) for e in edges]
        except ValueError:
            values = []
        require(bool(values) and all(math.isfinite(v) for v in values)
                and all(a < b for a, b in zip(values, values[1:])) and len(values) < MAX_BUCKETS,
                "features", spec, f"{name}'s edges must be increasing numbers, at most "
                f"{MAX_BUCKETS - 1} (e.g. prefill_due_s:6:8:10)")
        fixed[name] = values
    require(bool(names), "features", spec, "must name at least one feature")
    return names, fixed


REFINE_GAIN = 0.008
"""The mean capacity gain over the refinement's streams at which a cell's new value is kept:
below it, 20 streams' bisections (to 2%) mostly tell noise (on the laptop, a search over
the deadline's due time that kept changes of 0.5-1% gained 1.5% on its streams and lost
0.7-2.5% on others)."""
REFINE_SHARE = 0.01
"""A value the model takes in at least this share of its decisions is tried in every cell."""
REFINE_SWEEPS = 2
"""Sweeps over the cells; the refinement stops early after one that changes none."""


class CellRecorder(TablePolicy):
    """A table policy that keeps, across runs, the index of every cell whose value it
    reads: each pass's for a token table; a time-fraction table's only with decodes
    running (with none the budget is the cap whatever the cell holds)."""

    def __init__(self, table: BudgetTable):
        super().__init__(table, name="table")
        self.seen: set[int] = set()
        self._reads_idle = table.action.kind != "time_fraction"

    def budget(self, state) -> int:
        values = self.values(state)
        if self._reads_idle or state.running_decodes:
            self.seen.add(self.table.action.cell(values))
        return self.budget_of(values, state)


def _stream_capacity_task(scenario: Scenario, table: BudgetTable, stream: int, streams: int,
                          num_requests: int, seed_base: int, record: bool = False) -> tuple[float, list[int]]:
    """One stream's capacity as capacity_sweep searches it, and with ``record`` the cells
    the table read in any probe."""
    from eval.capacity import stream_capacity

    policy = CellRecorder(table) if record else TablePolicy(table, name="table")
    found = stream_capacity(scenario, policy, stream, streams, num_requests, seed_base=seed_base)[0]
    return found, sorted(policy.seen) if record else []


def stream_tasks(scenarios: list[Scenario], streams: int, num_requests: int, seed_base: int,
                 tables: list[BudgetTable], where, record: bool = False) -> list[tuple]:
    """:func:`_stream_capacity_task`'s arguments for each table on each stream of ``where``
    (numbered over ``streams`` streams of each scenario in turn)."""
    return [(scenarios[k // streams], t, k % streams, streams, num_requests, seed_base, record)
            for t in tables for k in where]


def cells_looked_up(table: BudgetTable, scenarios: list[Scenario], streams: int, num_requests: int,
                    seed_base: int, executor=None) -> tuple[list[set[int]], np.ndarray]:
    """(per stream, the cells ``table`` reads in any probe of its capacity search there;
    the capacities those searches find, as capacity_sweep finds them), over ``streams``
    streams of each scenario in turn. The simulator is deterministic, so on a stream whose
    set lacks a cell a table that differs from ``table`` only in that cell runs every probe
    exactly as ``table`` does and has the same capacity there: a cell search need not
    measure it."""
    from eval.parallel import LocalExecutor, progress_bar

    tasks = stream_tasks(scenarios, streams, num_requests, seed_base, [table],
                         range(len(scenarios) * streams), record=True)
    with progress_bar(len(tasks), "refining: the cells the table looks up") as bar:
        found = (executor or LocalExecutor()).map(_stream_capacity_task, tasks, bar)
    return [set(cs) for _, cs in found], np.asarray([c for c, _ in found], dtype=float)


def measure_cell(cells: list, cell: int, alts: list, where: list[int], base: np.ndarray,
                 capacities, make, label: str) -> np.ndarray:
    """Per value of ``alts`` in ``cell``, the table's capacity on every stream: measured on
    ``where``, the current one's (``base``) elsewhere."""
    tables = [make(cells[:cell] + [v] + cells[cell + 1:]) for v in alts]
    found = np.tile(np.asarray(base, dtype=float), (len(alts), 1))
    found[:, where] = capacities(tables, label, where)
    return found


def search_cells(cells: list, tried: list, base: np.ndarray, capacities, streams: int,
                 make, progress: str | None = None, looked_up=None) -> list[int]:
    """Coordinate search over ``cells`` (changed in place): per cell, each value of
    ``tried`` in one capacity sweep (``capacities``: tables, a label and the indices of the
    streams to measure -> their capacities there, on the streams ``base`` was measured
    on), the best kept where it raises the mean of the per-stream ratios by more than
    REFINE_GAIN; REFINE_SWEEPS sweeps, or fewer when one changes nothing. Returns the
    cells changed, in order. With ``looked_up`` (cells -> per stream, the cells the table
    of those cells reads there, and its capacities: :func:`cells_looked_up`) a cell is
    measured only on the streams where the current table reads it, and not at all where
    it reads it on none: elsewhere no value in it changes a probe, and the capacity stays
    the current table's. The sets are taken again after every change, and their
    capacities checked against the current ones (a mismatch would mean the simulator is
    not deterministic: then every cell is measured on every stream). With ``progress`` (a
    JSON file) the search's place is written after every cell and a search killed midway
    resumes there when started again on the same cells, values and streams (the search
    is deterministic, so the result is the one an unbroken search gives); the file goes
    when the search ends."""
    key = json.dumps({"cells": cells, "tried": tried, "base": [float(b) for b in base],
                      "streams": streams}, sort_keys=True)
    place = load_progress(progress, key)
    sweep0, cell0, changed_cells, changed = (place["sweep"], place["cell"], place["changed_cells"],
                                             place["changed"])
    if place.get("cells") is not None:
        cells[:], base = place["cells"], np.asarray(place["base"], dtype=float)
        print(f"refining: resumed at sweep {sweep0 + 1}, cell {cell0 + 1} ({progress})", flush=True)

    def reads() -> list[set[int]] | None:
        if not looked_up:
            return None
        sets, again = looked_up(list(cells))
        if np.array_equal(again, base):
            return sets
        print("WARNING: the table's capacities differ between two searches on the same streams; "
              "every cell is measured on every stream", file=sys.stderr)
        return None

    seen = reads()
    for sweep_no in range(sweep0, REFINE_SWEEPS):
        if sweep_no != sweep0:
            changed, cell0 = False, 0
        measured = could = 0
        for cell in range(cell0, len(cells)):
            alts = [v for v in tried if v != cells[cell]]
            where = [k for k in range(len(base)) if seen is None or cell in seen[k]]
            could += len(base) if alts else 0
            if alts and where:
                measured += len(where)
                found = measure_cell(cells, cell, alts, where, base, capacities, make,
                                     f"refining: sweep {sweep_no + 1}, cell {cell + 1}/{len(cells)}")
                gains = np.mean(np.where(base > 0, found / np.where(base > 0, base, 1) - 1, 0),
                                axis=1)
                j = int(np.argmax(gains))
                if gains[j] > REFINE_GAIN:
                    print(f"refining: cell {cell + 1} {cells[cell]:g} -> {alts[j]:g}, "
                          f"capacity {gains[j]:+.1%} on {streams} streams", flush=True)
                    cells[cell], base = alts[j], found[j]
                    changed = True
                    changed_cells.append(cell)
                    seen = reads()
            if progress:
                write_atomic(progress, json.dumps({
                    "key": key, "sweep": sweep_no, "cell": cell + 1, "cells": cells,
                    "base": [float(b) for b in base], "changed_cells": changed_cells,
                    "changed": changed}))
        if looked_up:
            print(f"refining: sweep {sweep_no + 1} measured {measured:,} of {could:,} cell-streams "
                  "(the rest the table does not read there)", flush=True)
        if not changed:
            break
    if progress:
        Path(progress).unlink(missing_ok=True)
    return changed_cells


def load_progress(path: str | None, key: str) -> dict:
    """A cell search's place as search_cells saved it, if ``path`` holds one for ``key``,
    else the start. A file for other cells, values or streams, or one that does not parse,
    is ignored (and replaced by the next save)."""
    start = {"sweep": 0, "cell": 0, "changed_cells": [], "changed": False}
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return start
    return saved if isinstance(saved, dict) and saved.get("key") == key else start


class RefineStreams(NamedTuple):
    """The refinement's streams: ``streams`` of each scenario in turn (seeded from
    TABLE_REFINE_SEEDS), and how policies are measured on them."""

    scenarios: list[Scenario]
    streams: int
    num_requests: int
    executor: object

    def sweep(self, policies: list, label: str) -> list:
        """Per policy, its capacity results on each scenario."""
        from eval.capacity import capacity_sweep
        from eval.parallel import progress_bar

        k = len(self.scenarios)
        with progress_bar(len(policies) * k * self.streams, label) as bar:
            found = capacity_sweep([(sc, p) for p in policies for sc in self.scenarios], self.streams,
                                   self.num_requests, executor=self.executor, progress=bar,
                                   seed_base=TABLE_REFINE_SEEDS)
        return [found[j:j + k] for j in range(0, len(found), k)]

    def capacities(self, tables: list[BudgetTable], label: str,
                   where: list[int] | None = None) -> np.ndarray:
        """Per table, its capacity on each stream (``where``: only those, numbered over the
        scenarios in turn), each searched as capacity_sweep searches it."""
        from eval.parallel import progress_bar

        n = self.streams
        if where is None or len(where) == len(self.scenarios) * n:
            found = self.sweep([TablePolicy(t, name="table") for t in tables], label)
            return np.asarray([[c for r in rs for c in r.per_stream] for rs in found], dtype=float)
        tasks = stream_tasks(self.scenarios, n, self.num_requests, TABLE_REFINE_SEEDS, tables, where)
        with progress_bar(len(tasks), label) as bar:
            found = [c for c, _ in self.executor.map(_stream_capacity_task, tasks, bar)]
        return np.asarray(found, dtype=float).reshape(len(tables), len(where))

    def looked_up(self, table: BudgetTable) -> tuple[list[set[int]], np.ndarray]:
        """Per stream, the cells ``table`` reads there, and its capacities
        (:func:`cells_looked_up`)."""
        return cells_looked_up(table, self.scenarios, self.streams, self.num_requests,
                               TABLE_REFINE_SEEDS, self.executor)


def refine(model, rounds: list[Round], serving: Scenario, args: ExportArgs, prov: dict,
           action: dict | None) -> Round:
    """A table refined in closed loop on ``args.refine_streams`` streams of the serving
    scenario (seeded apart), or with ``args.refine_on == "final"`` of it and each of its
    variants (agents.summary.final_scenarios), their per-stream ratios pooled. It starts
    from the highest mean capacity over those streams among the rounds' tables
    and one more over the last round's features and edges, built from the model's own
    decisions on each stream at the model's capacity there (the states that decide
    capacity; the rounds' come from the training conditions and the serving scenario at
    its own load, which for a part serving far below its capacity are light). Then cell by
    cell, two sweeps: each value the model takes in at least REFINE_SHARE of its
    decisions is tried, and the best kept where it raises the mean capacity by more than
    REFINE_GAIN (each value against the current table on the same arrivals)."""
    from agents.summary import final_scenarios
    from eval.capacity import probe_stream
    from eval.parallel import make_executor

    n = args.refine_streams
    final = args.refine_on == "final"
    scenarios = list(final_scenarios(serving).values()) if final else [serving]
    runs = RefineStreams(scenarios, n, args.fidelity_requests, make_executor(args.workers))
    sweep, capacities = runs.sweep, runs.capacities

    last = rounds[-1]
    (mine,) = sweep([policy_for(model, serving)], "refining: the model's capacity")
    episodes = [probe_stream(sc, i, n, args.fidelity_requests, f, seed_base=TABLE_REFINE_SEEDS)
                for sc, r in zip(scenarios, mine) for i, f in enumerate(r.factors) if f > 0]
    starts = list(rounds)
    if episodes:
        state, values = collect(model, episodes)
        table = build_table(features_of(last.features, state, action), values, args.buckets, prov,
                            action, budgets=state["budget"],
                            edges=[list(e) for e in last.table.edges])
        starts.append(Round(table, last.features, (state, values), last.held))
    start = capacities([r.table for r in starts], "refining: the starting tables")
    k = int(np.argmax(start.mean(axis=1)))
    base_round, base = starts[k], start[k]
    data = base_round.table.to_dict()
    cells_key = "fractions" if "fractions" in data else "budgets"
    # The model's own choices: the last round's decisions (every round's, once) and those
    # at its capacity; a continuous action's values are all distinct, and then the
    # starting tables' cell values are tried instead.
    taken = np.concatenate([last.build[1], *[r.build[1] for r in starts[len(rounds):]]])
    choice, count = np.unique(taken, return_counts=True)
    tried = [v for v, c in zip(choice, count) if c >= REFINE_SHARE * count.sum()]
    if len(tried) < 2:
        tried = sorted({v for r in starts for v in r.table.action.cells})
    tried = [int(v) if cells_key == "budgets" else float(v) for v in tried]
    data[cells_key] = list(data[cells_key])

    def make(cells: list) -> BudgetTable:
        return BudgetTable({**data, cells_key: cells})

    changed_cells = search_cells(data[cells_key], tried, base, capacities, n * len(scenarios),
                                 make, progress_path(args.run_dir) if args.run_dir else None,
                                 lambda cells: runs.looked_up(make(cells)))
    what = (f"round {k}'s table" + (f" (cells also from the states the tables of the first {k} "
                                    "DAgger round(s) led to)" if k else "")
            if k < len(rounds) else "the model's decisions at its capacity")
    data["provenance"] = {**data["provenance"], "rule": data["provenance"]["rule"] + (
        f"; from {what}, {len(changed_cells)} cell(s) changed where it raised the capacity "
        f"on {n} streams of the serving scenario{' and each of its variants' if final else ''} "
        f"by more than {REFINE_GAIN:.1%}"),
        "refined_cells": sorted(set(changed_cells))}
    return Round(BudgetTable(data), base_round.features, base_round.build, base_round.held)


def progress_path(run_dir: str) -> str:
    """Where a refinement's cell search keeps its place (search_cells)."""
    return str(Path(run_dir) / "refine_progress.json")


def refined_path(run_dir: str) -> str:
    """Where an export writes its refined table when the choice keeps another: in the run
    directory (not beside --out, which for the presets is tables/, the shipped tables)."""
    return str(Path(run_dir) / "refined_table.json")


def save_refined(table: BudgetTable, dagger: dict, run_dir: str) -> str:
    """Write the refined table to refined_path(run_dir) with the choice's figures in its
    provenance, so that a search that may take an hour is not lost when the choice keeps
    another table (on the L40S the KV-aware deadline rule's won by a point of the mean
    share, with the refined table's 107% of the model's capacity against its 95%).
    Returns the path."""
    data = table.to_dict()
    data["provenance"] = {**data["provenance"], "dagger": dagger}
    path = refined_path(run_dir)
    BudgetTable(data, path).save(path)
    return path


RULE_CHECK_REQUESTS = 600
"""Requests of the stream on which a rule's table is checked against the rule."""


class Round(NamedTuple):
    table: BudgetTable
    features: list[str]
    build: tuple
    """(state quantities, the model's action values) of the decisions the table was built from."""
    held: tuple
    """The same, of the held-out decisions its features were picked on."""


def dagger_rounds(model, episodes: tuple, decisions: tuple, names: list[str] | None,
                  args: ExportArgs, prov: dict, action: dict | None,
                  fixed: dict[str, list[float]] | None = None) -> list[Round]:
    """The table built from the model's decisions, then one per round of dataset
    aggregation (DAgger, Ross et al. 2011), ``args.dagger_rounds`` of them: the last
    table drives the same build and held-out episodes, the model labels every state it
    leads to, the features are picked again (unless named) and the table rebuilt on all
    the decisions so far. A table copies its model only where the model went; in closed
    loop a few cells off lead the engine, past capacity above all, into states the model
    never visits and the table never saw (built from its model's decisions alone, the
    L40S table kept its model's capacity and lost a quarter to nearly half of its goodput
    at 1.5 req/s)."""

    build, held = decisions
    out: list[Round] = []
    for r in range(args.dagger_rounds + 1):
        if r:
            driver = TablePolicy(out[-1].table, name="table")
            build = join_decisions(build, collect(model, episodes[0], driver))
            held = join_decisions(held, collect(model, episodes[1], driver))
        features = names or pick_features(build, held, args.buckets, args.max_features, prov, action)[0]
        feats = features_of(features, build[0], action)
        edges = [(fixed or {}).get(n) or feature_edges(feats[n], build[1], args.buckets)
                 for n in features]
        table = build_table(feats, build[1], args.buckets, prov, action,
                            budgets=build[0]["budget"], edges=edges)
        out.append(Round(table, features, build, held))
    return out


def join_decisions(a: tuple, b: tuple) -> tuple:
    """Two ``collect`` results as one."""
    return {k: np.concatenate([a[0][k], b[0][k]]) for k in a[0]}, np.concatenate([a[1], b[1]])


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


def capacity_judged(f: dict) -> str:
    """A fidelity capacity record's difference and verdict, table against model."""
    if f["verdict"] == NOT_JUDGED:
        return f"{-f['loss']:+.1%}, one stream: not judged"
    return f"{-f['loss']:+.1%} ± {f['loss_ci95']:.1%}, table {f['verdict']} model"


def capacity_warning(name: str, f: dict, streams: int | None) -> str:
    """The warning for a fidelity capacity loss above LOUD_CAPACITY_LOSS on scenario
    ``name``: a loss beyond the interval is the table's; one within an interval wider than
    the loss is not told from noise on these streams (the L40S's: -13.2% ± 26.3% on 5),
    and more streams would tell it."""
    head = (f"WARNING: the table loses {f['loss']:.1%} of the model's capacity on {name} (more "
            f"than {LOUD_CAPACITY_LOSS:.0%}")
    if f["verdict"] == NOT_JUDGED:
        return head + " on one stream, not judged); --fidelity-seeds N measures on more"
    if f["verdict"] == "falls short" or not f.get("loss_ci95"):
        return head + "); use more buckets or features, or serve the model"
    on = f"{streams} streams" if streams else "these streams"
    return (head + f", but ± {f['loss_ci95']:.1%}: {on} cannot tell it from noise); "
            "--fidelity-seeds N measures on more, and if the loss holds, use more buckets or "
            "features, or serve the model")


def report(table: BudgetTable, seconds: float, args: ExportArgs) -> None:
    fid = table.fidelity
    kind = table.action.kind
    values = sorted(set(table.action.cells))
    dagger = table.provenance.get("dagger") or {}
    labels = dagger.get("candidates") or round_labels(dagger.get("rounds", 0))
    source = labels[dagger.get("chosen", 0)]
    built = (f"{sum(table.visited)} visited; {kind} {values[0]:g}-{values[-1]:g}; built from "
             f"{fid['build_decisions']:,} decisions"
             + ("; refined in closed loop" if source == "refined" else "")
             if source.startswith("round") or source == "refined" else
             f"the {source} rule's, exactly: {kind} {', '.join(f'{v:g}' for v in table.action.cells)}")
    print(f"table: {args.out} ({table.cells} cells over {', '.join(table.features)}; {built}; "
          f"made in {seconds:.0f} s)")
    print(f"agreement with the model on {fid['held_out_decisions']:,} held-out decisions: "
          f"{fid['agreement']:.1%}")
    if len(labels) > 1:
        kept = "; ".join(f"{what} {', '.join(f'{v:.1%}' for v in dagger[key])}"
                         for what, key in (("capacity", "capacity_kept"), ("goodput at load", "goodput_kept"))
                         if dagger.get(key))
        if kept and not dagger.get("goodput_kept"):
            kept += (f"; goodput at load not judged: the model serves at most {MIN_MODEL_GOODPUT:.0%} "
                     "of requests within the SLO there")
        which = "the refined table" if source == "refined" else f"the table of {source}"
        print(f"kept: {which} among {', '.join(labels)}" + (
            f" (the model's figures each keeps, in that order, on {dagger['streams']} streams of "
            f"their own: {kept}; kept: the highest mean of the shares, the earliest on a tie)" if kept
            else " (no stream where the model meets the SLO at any load: not compared)"))
    for name, f in fid.get("capacity", {}).items():
        print(f"capacity on {name}: model {f['model_capacity_rps']:.3f}, table "
              f"{f['table_capacity_rps']:.3f} req/s ({capacity_judged(f)})")
    low = 0.0
    for name, f in fid.get("goodput", {}).items():
        if f["verdict"] == "falls short" and (f["model_goodput"] or 0.0) > MIN_MODEL_GOODPUT:
            low = max(low, f["loss"])  # where the model serves a few in a hundred, not a loss
        load = (f" at {f['rate_rps']:g} req/s" if f.get("rate_rps") else
                f" at {f['trace_speed']:g}x the trace" if f.get("trace_speed") else "")
        judged = (f"{-f['loss']:+.1%} ± {f['loss_ci95']:.1%}, table {f['verdict']} model"
                  if f["verdict"] != "not judged" else "not judged: fewer than two streams with "
                  "a goodput, or none for the model")
        both = ("model {:.3f}, table {:.3f}".format(f["model_goodput"], f["table_goodput"])
                if f["model_goodput"] is not None else "nothing finished")
        print(f"goodput on {name}{load}: {both} ({judged})")
    use = fid.get("at_capacity")
    if use and use.get("passes"):
        print(use_line(use, kind))
    flat = fid.get("against_flat")
    if flat:
        f = flat["fraction"]
        rule = f"time-budget:{f:g}" if f <= 2 else f"table-flat:{f:g}:TABLE"
        found = "; ".join(f"{name} {g['table_capacity_rps']:.3f} against {g['flat_capacity_rps']:.3f} "
                          f"req/s ({flat_verdict(g).cell})"
                          for name, g in flat["scenarios"].items())
        print(f"what its cells are worth: against itself with {f:g} of the ITL target, the fraction "
              f"it takes most, in every cell ({rule}): {found}")
        if all(g["verdict"] != "beats" for g in flat["scenarios"].values()):
            print(f"NOTE: nowhere does the table serve more than its flat twin beyond the interval: "
                  f"on these streams its dependence on state shows no gain over {rule}")
    if len(values) == 1:
        same = (f"the time-budget rule at {values[0]:g} (time-budget:{values[0]:g})"
                if kind == "time_fraction" else f"a static budget (static:{values[0]:g})")
        print(f"NOTE: every cell holds {values[0]:g}: the policy does not depend on the state "
              f"here; it is {same}, which serves the same budgets without a table")
    for name, f in fid.get("capacity", {}).items():
        if f["loss"] > LOUD_CAPACITY_LOSS:
            print(capacity_warning(name, f, getattr(args, "fidelity_seeds", None)), file=sys.stderr)
    if low > LOUD_GOODPUT_LOSS:
        print(f"WARNING: at the serving load the table falls short of the model's goodput by "
              f"{low:.1%} somewhere (beyond the interval, and more than {LOUD_GOODPUT_LOSS:.0%}): "
              "past capacity it drives the engine into states its model does not; use other "
              "features, or serve the model", file=sys.stderr)
    print(serve_line(table))


def serve_line(table: BudgetTable) -> str:
    if table.max_budget is None:
        return (f"serve it in vLLM with --max-num-batched-tokens {table.action.cap} (its budgets' "
                "cap; a lower ceiling clamps them); see docs/serving.md")
    return (f"serve it in vLLM with --max-num-batched-tokens {table.max_budget} (the table's "
            "largest budget); see docs/serving.md")


def rule_cells(rule, spec: str, field: str = "rule") -> tuple[list[dict], list[float]]:
    """The features and time fractions of a table that makes ``rule``'s budget at every
    pass: the slack (one pass over the target or more) and, for the deadline rule, the
    prefill queue's due time past ``margin`` of the TTFT target (the rule's strict
    comparison, as an edge one float above the threshold); for its KV-aware form also KV
    usage, at the throttle's own steps (``policies.baselines.KVSteps``), where the slack
    is spent only in the bucket below ``kv_low``."""
    from policies.baselines import (KVSteps, TimeBudgetDeadlinePolicy, TimeBudgetPolicy,
                                    TimeBudgetSlackPolicy)

    kind = type(rule)
    if kind is TimeBudgetPolicy:
        return [{"name": "running_decodes", "edges": []}], [rule.fraction]
    if kind is TimeBudgetSlackPolicy and rule.kv is None:
        return [{"name": "itl_slack_passes", "edges": [1.0]}], [rule.fraction, rule.top]
    if kind is TimeBudgetDeadlinePolicy and rule.fraction == 1.0:
        due = math.nextafter(rule.margin * rule.ttft_s, math.inf)
        features = [{"name": "itl_slack_passes", "edges": [1.0]}, {"name": "prefill_due_s", "edges": [due]}]
        if rule.kv is None:
            return features, [rule.fraction] * 3 + [rule.top]
        if isinstance(rule.kv, KVSteps):
            kv = rule.kv  # buckets: below kv_low (where the slack may be spent), then its steps
            steps = [kv.fractions[0], *kv.fractions]
            cells = [rule.top if spend and k == 0 else f
                     for spend in (False, False, False, True) for k, f in enumerate(steps)]
            return features + [{"name": "kv_usage", "edges": [kv.kv_low, *kv.edges]}], cells
    raise ConfigError(not_a_table(spec, field))


class RuleCheck:
    """Drives the simulator with a rule; counts the passes where a table's budget differs,
    and the passes that looked a cell up (with decodes running), per cell."""

    def __init__(self, rule, table: BudgetTable):
        self.rule, self.table = rule, TablePolicy(table)
        self.name, self.budgets, self.differ = rule.name, [], 0
        self.cells = [0] * table.cells

    def reset(self) -> None:
        self.rule.reset()
        self.table.reset()

    def __call__(self, state) -> int:
        want = self.rule(state)
        self.differ += self.table(state) != want
        self.budgets.append(want)
        if state.running_decodes:
            self.cells[self.table.cell(state)] += 1
        return want


def not_a_table(spec: str, field: str) -> str:
    """The one-line refusal of a rule no table holds exactly."""
    return (f"{field}: got {show(spec)}, a table holds exactly only {', '.join(RULES)}"
            + (' (or "none" alone)' if field == "rules" else "")
            + "; time-budget-kv, time-budget-slack-kv and time-budget-few move their fraction "
            "continuously with KV usage or the decodes")


def parse_rule(spec: str, scenario: Scenario, field: str = "rule") -> tuple:
    """(the rule a spec names, its table's features, its fractions); refused in one line
    unless a table holds it exactly."""
    from policies.specs import make_policy

    if spec.strip().partition(":")[0] not in {r.partition("[")[0] for r in RULES}:
        raise ConfigError(not_a_table(spec, field))
    try:
        rule = make_policy(spec, scenario)
    except ConfigError as err:
        raise ConfigError(f"{field}: " + str(err).removeprefix("policy: ")) from None
    return (rule, *rule_cells(rule, spec, field))


def rule_table(spec: str, scenario: Scenario, workload, field: str = "rule") -> BudgetTable:
    """A table that is the rule ``spec`` for ``scenario``'s hardware, model and SLO,
    checked against the rule pass by pass on ``workload`` (its fidelity records the
    passes, how many differ, which is none unless the runtime and the simulator part
    ways, and the passes that looked each cell up; ``visited`` marks the cells reached)."""
    rule, features, fractions = parse_rule(spec, scenario, field)
    data = {"schema_version": SCHEMA_VERSION, "kind": KIND, "action": time_action(scenario),
            "features": features, "fractions": fractions, "default_budget": 2048,
            "provenance": {**scenario_provenance(scenario), "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "rule": f"the {rule.name} rule (policies/baselines.py), cell for cell"}}
    check = RuleCheck(rule, BudgetTable(data))
    scenario.simulator(workload).run(check)
    data["default_budget"] = default_budget(np.asarray(check.budgets))
    data["visited"] = [int(c > 0) for c in check.cells]
    require(not check.differ, field, spec, f"its table differs from the rule at {check.differ} of "
            f"{len(check.budgets)} passes; nothing written")
    data["fidelity"] = {"rule_check": {"passes": len(check.budgets), "differ": int(check.differ),
                                       "requests": len(workload), "passes_per_cell": check.cells}}
    return BudgetTable(data)


def rule_main(argv: list[str]) -> int:
    args = parse(RuleExportArgs, argv, prog="python -m eval export --rule RULE")
    scenario = Scenario(**Scenario.fields_dict(args)).check()
    check_output("out", args.out)
    if args.csv is not None:
        check_output("csv", args.csv)
    check_distinct(out=args.out, csv=args.csv)
    t0 = time.perf_counter()
    table = rule_table(args.rule, scenario, scenario.workload())
    check = table.fidelity["rule_check"]
    table.save(args.out)
    if args.csv:
        write_atomic(args.csv, table.to_csv())
    cells = ", ".join(f"{f:g}" for f in table.action.cells)
    n = table.cells
    print(f"table: {args.out} ({n} cell{'s' * (n > 1)} over {', '.join(table.features)}; "
          f"fractions {cells}; made in {time.perf_counter() - t0:.1f} s)")
    per = check["passes_per_cell"]
    passes = "the one pass" if check["passes"] == 1 else f"all {check['passes']:,} passes"
    print(f"the same budget as {args.rule} at {passes} of the scenario's "
          f"{check['requests']:,}-request stream; passes with decodes running, per cell: "
          f"{', '.join(str(c) for c in per)}; fallback budget {table.default_budget}")
    if not all(per):
        print(f"NOTE: {per.count(0)} of {n} cell{'s' * (n > 1)} never reached on this stream: "
              "checked by the rule's thresholds alone there (a longer or busier stream, "
              "--num-requests or --rate, reaches more)")
    print(serve_line(table))
    return 0


