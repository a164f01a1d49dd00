"""Stage 5 (optional, ``--refine-streams``), refine: a table improved cell by cell in closed loop.

In: the rounds (stage 4), the serving scenario (and with ``--refine-on final`` its
variants), the model and the table's action and provenance. Out: one more candidate
round, its cells changed where a value the model takes raised the mean capacity under
the SLO on streams of their own by more than REFINE_GAIN. The search keeps its place in
the run directory and resumes after a kill.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from envs.scenario import Scenario
from envs.seeds import TABLE_REFINE_SEEDS
from eval.capacity import capacity_sweep, probe_stream, stream_capacity
from eval.export.args import ExportArgs
from eval.export.cells import build_table
from eval.export.dagger import Round
from eval.export.features import features_of
from eval.export.record import collect, policy_for
from eval.parallel import LocalExecutor, make_executor, progress_bar
from eval.scenarios import final_scenarios
from policies.table import BudgetTable, write_atomic
from policies.table_policy import TablePolicy


REFINE_GAIN = 0.008
"""The mean capacity gain over the refinement's streams at which a cell's new value is kept:
below it, 20 streams' bisections (to 2%) mostly tell noise: changes of 0.5-1% kept on
the refinement's streams need not hold on others (docs/learning.md)."""
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


def refine_table(model, rounds: list[Round], serving: Scenario, args: ExportArgs, prov: dict,
           action: dict | None) -> Round:
    """A table refined in closed loop on ``args.refine_streams`` streams of the serving
    scenario (seeded apart), or with ``args.refine_on == "final"`` of it and each of its
    variants (eval.scenarios.final_scenarios), their per-stream ratios pooled. It starts
    from the highest mean capacity over those streams among the rounds' tables
    and one more over the last round's features and edges, built from the model's own
    decisions on each stream at the model's capacity there (the states that decide
    capacity; the rounds' come from the training conditions and the serving scenario at
    its own load, which for a part serving far below its capacity are light). Then cell by
    cell, two sweeps: each value the model takes in at least REFINE_SHARE of its
    decisions is tried, and the best kept where it raises the mean capacity by more than
    REFINE_GAIN (each value against the current table on the same arrivals)."""
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
    another table. Returns the path."""
    data = table.to_dict()
    data["provenance"] = {**data["provenance"], "dagger": dagger}
    path = refined_path(run_dir)
    BudgetTable(data, path).save(path)
    return path
