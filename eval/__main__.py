"""Evaluate budget policies on identical arrivals.

    python -m eval compare --trace azure_conv_2023 --policies static:2048,vllm-default,free-ride \\
        --seeds 3 --out reports/azure [--json]
    python -m eval capacity --policies static:2048,queue-depth,table:tables/h100-sxm__llama-3-8b.json
    python -m eval suite --policies vllm-default,queue-depth,sarathi-slo,free-ride --out reports/suite
    python -m eval export RUN_DIR --out tables/NAME.json [--csv tables/NAME.csv]

Policy specs: static:N, vllm-default[:offline], queue-depth[:BASE], no-decode-boost[:LOW:HIGH],
sarathi-slo, free-ride[:FLOOR:CAP], model:RUN_DIR, table:PATH.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from envs.cli import parse
from envs.errors import ConfigError, positive_int, run_cli
from envs.scenario import Scenario

COMMANDS = ("compare", "capacity", "suite", "export")


@dataclass(frozen=True)
class CompareArgs(Scenario):
    """Score policies on the same arrivals (a trace, or seeded synthetic streams)."""

    policies: str = "static:2048,static:8192,vllm-default,queue-depth,sarathi-slo,free-ride"
    """Comma-separated policy specs."""
    seeds: int = 3
    """Synthetic streams (traces replay once)."""
    requests: int | None = None
    """Requests per stream (default: the scenario's num_requests, or the whole trace window)."""
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
    out: str = "reports/suite"
    """Report folder."""


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())


def cmd_compare(argv) -> int:
    from eval.compare import compare, comparison_report
    from eval.report import save_json
    from policies.lookahead import LookaheadPolicy
    from policies.specs import make_policies

    args = parse(CompareArgs, argv, prog="python -m eval compare")
    positive_int("seeds", args.seeds)
    if args.requests is not None:
        positive_int("requests", args.requests)
    scenario = Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__})
    policies = make_policies(args.policies, scenario)
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
    from eval.compare import capacity_report
    from eval.report import save_json
    from policies.specs import make_policies

    args = parse(CapacityArgs, argv, prog="python -m eval capacity")
    positive_int("seeds", args.seeds)
    positive_int("requests", args.requests)
    scenario = Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__})
    policies = make_policies(args.policies, scenario)
    with _progress(len(policies), "capacity") as bar:
        data, text = capacity_report(scenario, policies, Path(args.out), args.seeds, args.requests, bar)
    save_json(Path(args.out) / "capacity.json", data)
    print(json.dumps({k: v["capacity_rps"] for k, v in data.items()}) if args.json else text)
    return 0


def cmd_suite(argv) -> int:
    from eval.scenarios import SUITE
    from eval.suite import run_suite

    args = parse(SuiteArgs, argv, prog="python -m eval suite")
    positive_int("seeds", args.seeds)
    positive_int("requests", args.requests)
    names = list(SUITE) if args.scenarios == "all" else [s.strip() for s in args.scenarios.split(",")]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ConfigError(f"scenarios: unknown {', '.join(unknown)}; known: {', '.join(SUITE)}")
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    with _progress(len(names), "suite") as bar:
        text = run_suite(names, specs, args.seeds, args.requests, args.capacity, Path(args.out), bar)
    print(text)
    return 0


def cmd_export(argv) -> int:
    from eval.export import main as export_main

    return export_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        raise ConfigError(f"command: got {argv[0] if argv else 'nothing'!r}, must be one of "
                          f"{', '.join(COMMANDS)} (python -m eval COMMAND --help)")
    return {"compare": cmd_compare, "capacity": cmd_capacity, "suite": cmd_suite,
            "export": cmd_export}[argv[0]](argv[1:])


if __name__ == "__main__":
    run_cli(main)
