"""The scenario suite: every named scenario of ``eval/scenarios.py`` compared (and, on
request, its capacities found) for one set of policies, in one report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from eval.compare import capacity_report, compare, comparison_report
from eval.harness import against_best, static_policies
from eval.report import git_commit, save_json, scenario_line
from eval.scenarios import SUITE


@dataclass
class SuiteRow:
    name: str
    best_budget: int
    best_goodput: float
    goodput: dict[str, float]
    """Goodput by policy spec (a spec's policy name can differ per scenario: sarathi-slo:N)."""
    capacity: dict[str, dict] = field(default_factory=dict)
    best_capacity: tuple[str, float] | None = None


def run_scenario(name: str, specs: list[str], seeds: int, requests: int, with_capacity: bool,
                 out: Path) -> tuple[SuiteRow, dict]:
    """One scenario of the suite: its comparison report, and its capacities if asked."""
    from policies.specs import make_policies

    sc = SUITE[name]
    policies = make_policies(",".join(specs), sc)
    cmp = compare(sc, policies, seeds, None if sc.trace else requests)
    sub = out / name
    comparison_report(cmp, sub, seeds, title=f"Scenario {name}")
    best_b, best = cmp.best_static()
    entry = {"scenario": scenario_line(sc), "results": cmp.as_json()}
    row = SuiteRow(name, best_b, best.mean("goodput"),
                   {spec: cmp.results[p.name].mean("goodput") for spec, p in zip(specs, policies)})
    if with_capacity:
        # The best static budget for capacity is the ladder's best at its own capacity,
        # not the best at the scenario's base load.
        shown = {p.name for p in policies}
        ladder = [p for p in static_policies(sc) if p.name not in shown]
        by_name, _ = capacity_report(sc, policies + ladder, sub, seeds, requests)
        entry["capacity"] = by_name
        row.capacity = {spec: by_name[p.name] for spec, p in zip(specs, policies)}
        statics = [p.name for p in policies + ladder if p.kind == "static"]
        best_cap = max(statics, key=lambda n: by_name[n]["capacity_rps"])
        row.best_capacity = (best_cap, by_name[best_cap]["capacity_rps"])
    return row, entry


def suite_table(rows: list[SuiteRow]) -> list[str]:
    specs = list(rows[0].goodput) if rows else []
    table = ["| scenario | best static (goodput) | " + " | ".join(specs) + " |",
             "|---|---|" + "---:|" * len(specs)]
    for row in rows:
        cells = []
        for p in specs:
            v = row.goodput[p]
            mark = "" if against_best(v, row.best_goodput)[0] != "short" else " (below best static)"
            cap = f", {row.capacity[p]['capacity_rps']:.2f} req/s" if row.capacity else ""
            cells.append(f"{v:.3f}{mark}{cap}")
        best_cap = (f"; capacity: {row.best_capacity[0]} at {row.best_capacity[1]:.2f} req/s"
                    if row.best_capacity else "")
        table.append(f"| {row.name} | goodput: {row.best_budget} ({row.best_goodput:.3f}){best_cap} | "
                     + " | ".join(cells) + " |")
    return table


def run_suite(names: list[str], specs: list[str], seeds: int, requests: int, with_capacity: bool,
              out: Path, progress=None) -> str:
    """Every named scenario; writes ``out``/README.md and suite.json, returns the text."""
    t0 = time.perf_counter()
    rows, sections, data = [], [], {}
    for name in names:
        row, entry = run_scenario(name, specs, seeds, requests, with_capacity, out)
        rows.append(row)
        data[name] = entry
        sections.append(f"- [{name}]({name}/report.md): {scenario_line(SUITE[name])}")
        if progress is not None:
            progress.update(1)
    head = ["# chunkpilot evaluation suite", "",
            f"- policies: {','.join(specs)}; {seeds} streams of {requests} requests per "
            f"synthetic scenario; commit {git_commit()}; {time.strftime('%Y-%m-%d %H:%M')}", ""]
    text = "\n".join(head + ["Goodput per policy (capacity when computed); the static ladder 256-16384 "
                             "picks the best static budget in hindsight per scenario.", ""]
                     + suite_table(rows) + ["", "## Scenarios", ""] + sections
                     + ["", f"Wall time: {time.perf_counter() - t0:.0f} s.", ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(text)
    save_json(out / "suite.json", data)
    return text
