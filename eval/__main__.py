"""Evaluate budget policies on identical arrivals.

    python -m eval compare --trace azure_conv_2023 --policies static:2048,vllm-default,free-ride \\
        --seeds 3 --out reports/azure [--json]
    python -m eval capacity --policies static:2048,queue-depth,table:tables/h100-sxm__llama-3-8b.json
    python -m eval suite --policies vllm-default,queue-depth,sarathi-slo,free-ride --out reports/suite

Policy specs: static:N, vllm-default[:offline], queue-depth[:BASE], no-decode-boost[:LOW:HIGH],
sarathi-slo, free-ride[:FLOOR:CAP], model:RUN_DIR, table:PATH.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from envs.cli import parse
from envs.errors import ConfigError, positive_int, run_cli
from envs.scenario import Scenario

COMMANDS = ("compare", "capacity", "suite")


@dataclass(frozen=True)
class CompareArgs(Scenario):
    """Score policies on the same arrivals (a trace, or seeded synthetic streams)."""

    policies: str = "static:2048,static:8192,vllm-default,queue-depth,sarathi-slo,free-ride"
    """Comma-separated policy specs."""
    seeds: int = 3
    """Synthetic streams (traces replay once)."""
    requests: int | None = None
    """Requests per stream (default: the scenario's num_requests, or the whole trace window)."""
    allow_table_mismatch: bool = False
    """Evaluate a table:PATH built for other hardware, another model shape or another SLO
    than the scenario's (refused otherwise)."""
    lookahead: bool = False
    """Also run the look-ahead bound (slow: forks the simulator at every decision)."""
    out: str = "reports/compare"
    """Report folder (report.md, figures, results.json)."""
    json: bool = False
    """Print one JSON object keyed by policy instead of the table."""


@dataclass(frozen=True)
class CapacityArgs(Scenario):
    """Find each policy's capacity under the SLO by bisection on the arrival rate."""

    policies: str = "static:1024,static:2048,static:4096,vllm-default,queue-depth,free-ride"
    """Comma-separated policy specs."""
    seeds: int = 2
    """Streams per probe."""
    requests: int = 600
    """Requests per stream."""
    allow_table_mismatch: bool = False
    """Evaluate a table:PATH built for other hardware, another model shape or another SLO
    than the scenario's (refused otherwise)."""
    out: str = "reports/capacity"
    """Report folder."""
    json: bool = False
    """Print one JSON object keyed by policy."""


@dataclass(frozen=True)
class SuiteArgs:
    """Run the named scenario suite for a set of policies and write one report."""

    policies: str = "vllm-default,static:2048,queue-depth,sarathi-slo,free-ride"
    """Comma-separated policy specs (the static ladder is always added for reference)."""
    scenarios: str = "all"
    """Comma-separated names from eval/scenarios.py, or all."""
    seeds: int = 2
    """Streams per scenario."""
    requests: int = 600
    """Requests per synthetic stream (traces: their window)."""
    capacity: bool = False
    """Also find every policy's capacity per scenario (slower)."""
    allow_table_mismatch: bool = False
    """Evaluate a table:PATH built for other hardware, another model shape or another SLO
    than the scenario's (refused otherwise)."""
    out: str = "reports/suite"
    """Report folder."""


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())


def cmd_compare(argv) -> int:
    from eval.compare import compare, comparison_report, save_json
    from eval.lookahead import LookaheadPolicy
    from policies.specs import make_policies

    args = parse(CompareArgs, argv, prog="python -m eval compare")
    positive_int("seeds", args.seeds)
    if args.requests is not None:
        positive_int("requests", args.requests)
    scenario = Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__})
    policies = make_policies(args.policies, scenario, args.allow_table_mismatch)
    if args.lookahead:
        policies.append(LookaheadPolicy(scenario.slo()))
    n = (len(policies) + 7) * (1 if scenario.trace else args.seeds)
    with _progress(n, "compare") as bar:
        cmp = compare(scenario, policies, args.seeds, args.requests, progress=bar)
    out = Path(args.out)
    text = comparison_report(cmp, out, args.seeds)
    save_json(out / "results.json", cmp.as_json())
    print(json.dumps(cmp.as_json(), default=float) if args.json else text)
    return 0


def cmd_capacity(argv) -> int:
    from eval.compare import capacity_report, save_json
    from policies.specs import make_policies

    args = parse(CapacityArgs, argv, prog="python -m eval capacity")
    positive_int("seeds", args.seeds)
    positive_int("requests", args.requests)
    scenario = Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__})
    policies = make_policies(args.policies, scenario, args.allow_table_mismatch)
    with _progress(len(policies), "capacity") as bar:
        data, text = capacity_report(scenario, policies, Path(args.out), args.seeds, args.requests, bar)
    save_json(Path(args.out) / "capacity.json", data)
    print(json.dumps({k: v["capacity_rps"] for k, v in data.items()}) if args.json else text)
    return 0


def cmd_suite(argv) -> int:
    from eval.harness import against_best
    from eval.compare import (LADDER, capacity_report, compare, comparison_report, git_commit,
                              save_json, scenario_line)
    from eval.scenarios import SUITE
    from policies.specs import make_policies

    args = parse(SuiteArgs, argv, prog="python -m eval suite")
    positive_int("seeds", args.seeds)
    positive_int("requests", args.requests)
    names = list(SUITE) if args.scenarios == "all" else [s.strip() for s in args.scenarios.split(",")]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ConfigError(f"scenarios: unknown {', '.join(unknown)}; known: {', '.join(SUITE)}")
    out = Path(args.out)
    t0 = time.perf_counter()
    head = ["# chunkpilot evaluation suite", "",
            f"- policies: {args.policies}; {args.seeds} streams of {args.requests} requests per "
            f"synthetic scenario; commit {git_commit()}; {time.strftime('%Y-%m-%d %H:%M')}", ""]
    rows, sections, data = [], [], {}
    with _progress(len(names), "suite") as bar:
        for name in names:
            sc = SUITE[name]
            policies = make_policies(args.policies, sc, args.allow_table_mismatch)
            cmp = compare(sc, policies, args.seeds, None if sc.trace else args.requests)
            sub = out / name
            comparison_report(cmp, sub, args.seeds, title=f"Scenario {name}")
            best_b, best = cmp.best_static()
            entry = {"scenario": scenario_line(sc), "results": cmp.as_json()}
            specs = [s.strip() for s in args.policies.split(",") if s.strip()]
            # Columns by spec: a spec's policy name can differ per scenario (sarathi-slo:N).
            row = {spec: cmp.results[p.name].mean("goodput") for spec, p in zip(specs, policies)}
            caps = {}
            if args.capacity:
                # The best static budget for capacity is the ladder's best at its own capacity,
                # not the best at the scenario's base load.
                ladder = [p for p in make_policies(",".join(f"static:{b}" for b in LADDER
                                                            if b >= sc.max_num_seqs), sc)
                          if p.name not in {q.name for q in policies}]
                by_name, _ = capacity_report(sc, policies + ladder, sub, args.seeds, args.requests)
                entry["capacity"] = by_name
                caps = {spec: by_name[p.name] for spec, p in zip(specs, policies)}
                best_cap = max((n for n in by_name if n.startswith("static:")),
                               key=lambda n: by_name[n]["capacity_rps"])
                caps["_best_static"] = (best_cap, by_name[best_cap]["capacity_rps"])
            data[name] = entry
            rows.append((name, best_b, best.mean("goodput"), row, caps))
            sections.append(f"- [{name}]({name}/report.md): {scenario_line(sc)}")
            bar.update(1)
    policy_names = list(rows[0][3]) if rows else []
    table = ["| scenario | best static (goodput) | " + " | ".join(policy_names) + " |",
             "|---|---|" + "---:|" * len(policy_names)]
    for name, b, g, row, caps in rows:
        cells = []
        for p in policy_names:
            v = row[p]
            mark = "" if against_best(v, g)[0] != "short" else " (below best static)"
            cap = f", {caps[p]['capacity_rps']:.2f} req/s" if caps and p in caps else ""
            cells.append(f"{v:.3f}{mark}{cap}")
        best_cap = (f"; capacity: {caps['_best_static'][0]} at {caps['_best_static'][1]:.2f} req/s"
                    if caps else "")
        table.append(f"| {name} | goodput: {b} ({g:.3f}){best_cap} | " + " | ".join(cells) + " |")
    text = "\n".join(head + ["Goodput per policy (capacity when computed); the static ladder 256-16384 "
                             "picks the best static budget in hindsight per scenario.", ""] + table
                     + ["", "## Scenarios", ""] + sections
                     + ["", f"Wall time: {time.perf_counter() - t0:.0f} s.", ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(text)
    save_json(out / "suite.json", data)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        raise ConfigError(f"command: got {argv[0] if argv else 'nothing'!r}, must be one of "
                          f"{', '.join(COMMANDS)} (python -m eval COMMAND --help)")
    return {"compare": cmd_compare, "capacity": cmd_capacity, "suite": cmd_suite}[argv[0]](argv[1:])


if __name__ == "__main__":
    run_cli(main)
