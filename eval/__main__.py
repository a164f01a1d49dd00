"""Evaluate budget policies on identical arrivals.

    python -m eval compare --trace azure_conv_2023 --policies static:2048,vllm-default,time-budget \\
        --seeds 5 --out reports/azure [--json]
    python -m eval capacity --policies time-budget,queue-depth,table:tables/h100-sxm__llama-3-8b.json
    python -m eval suite --policies vllm-default,queue-depth,sarathi-slo,time-budget --out reports/suite
    python -m eval export RUN_DIR --out tables/NAME.json [--csv tables/NAME.csv]
    python -m eval export --rule time-budget-deadline --hardware a100-80g --out NAME.json

Every comparison searches the hindsight-best static budget on a fine ladder (steps of
2^(1/4), 64 to 16,384) and says per policy whether it beats, ties with or falls short of it,
with 95% intervals over streams. Sweeps fan out on Ray: ``--workers N`` (a local Ray
instance; default all cores; 1 runs in this process) or ``--ray-address ADDR`` (a cluster).

Policy specs (``--policies``, comma-separated; policies/specs.py):
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from envs.cli import given_fields, parse
from envs.errors import ConfigError, did_you_mean, integer, run_cli, show
from envs.files import check_output
from envs.scenario import Scenario, check_max_pass_itl
from envs.seeds import PERIODIC_EVAL_SEEDS
from envs.workload import check_num_requests
from eval.answer import unseparated
from eval.capacity import BRACKET_STEPS, add_references, capacity_studies, stream_capacity
from eval.capacity_report import capacity_figures, capacity_report, figure_count
from eval.compare import compare, comparison_figures, comparison_report, run_streams
from eval.export.cli import main as export_main
from eval.parallel import MAX_CLUSTER_WORKERS, make_executor, progress_bar
from eval.report import save_json
from eval.scenarios import GROUPS, SUITE
from eval.suite import run_suite
from eval.table_use import tables_use
from policies.baselines import StaticPolicy
from policies.reference import reference_for
from policies.specs import listing, make_policies

COMMANDS = ("compare", "capacity", "suite", "export")
MAX_STREAMS = 1000
"""Most streams (seeds) of one sweep: each is a simulation per policy and ladder rung."""


@dataclass(frozen=True)
class SweepArgs:
    """Where a sweep's independent simulations run, and what it accepts."""

    workers: int | None = None
    """Simulations at once on a local Ray instance (default: all cores; 1 runs them in this
    process, without Ray)."""
    ray_address: str | None = None
    """Join an existing Ray cluster instead (auto, HOST:PORT or ray://HOST:10001)."""

    allow_table_mismatch: bool = False
    """Evaluate a table:PATH built for other hardware, another model shape or another SLO
    than the scenario's (refused otherwise)."""

    def executor(self):
        return make_executor(self.workers, self.ray_address)


@dataclass(frozen=True)
class CompareArgs(SweepArgs, Scenario):
    """Score policies on the same arrivals (a trace, or seeded synthetic streams)."""

    CLI_REFUSED = ("seed",)  # its streams come from held-out seeds
    policies: str = "static:2048,static:8192,vllm-default,queue-depth,sarathi-slo,time-budget"
    """Comma-separated policy specs."""
    seeds: int = 5
    """Streams: seeded synthetic streams, or the trace window cut into this many parts."""
    requests: int | None = None
    """Requests per stream (default: the scenario's num_requests, or the whole trace part)."""
    reference: bool = False
    """Also run the reference controller (MPC over the hindsight-best static; slow)."""
    figures: bool = True
    """Draw the report's pictures (--no-figures: the text alone; the goodput curve runs every
    policy again at 7 loads on 3 streams)."""
    out: str = "reports/compare"
    """Report folder (report.md, figures, results.json)."""
    json: bool = False
    """Print one JSON object keyed by policy instead of the table."""


@dataclass(frozen=True)
class CapacityArgs(SweepArgs, Scenario):
    """Find each policy's capacity under the SLO by bisection on the arrival rate."""

    CLI_REFUSED = ("num_requests", "seed")  # its streams take --requests, from held-out seeds
    policies: str = "vllm-default,queue-depth,sarathi-slo,time-budget,time-budget-kv"
    """Comma-separated policy specs (the fine static ladder is always searched)."""
    seeds: int = 5
    """Streams: each gets its own capacity; the figure is their mean with a 95% interval."""
    requests: int = 600
    """Requests per stream."""
    reference: bool = False
    """Also find the reference controller's capacity: the rollout over the best time-budget
    rule among --policies (it sees the future; slow), or MPC over the hindsight-best static
    where no such rule is given."""
    figures: bool = True
    """Draw the report's pictures (--no-figures: the text alone; the goodput curve runs every
    policy again at 7 loads on 3 streams)."""
    out: str = "reports/capacity"
    """Report folder."""
    json: bool = False
    """Print one JSON object keyed by policy."""


@dataclass(frozen=True)
class SuiteArgs(SweepArgs):
    """Run the named scenario suite for a set of policies and write one report."""

    policies: str = "vllm-default,static:2048,queue-depth,sarathi-slo,free-ride,time-budget,time-budget-kv"
    """Comma-separated policy specs (the fine static ladder is always searched)."""
    scenarios: str = "main"
    """Comma-separated names from eval/scenarios.py, or groups: all, main (the reference
    results of docs/suite.md), prefix (prompts sharing prefixes, with prefix caching)."""
    seeds: int = 5
    """Streams per scenario (a trace's window is cut into this many parts)."""
    requests: int = 600
    """Requests per stream."""
    capacity: bool = True
    """Find every policy's capacity per scenario, the suite's headline (--no-capacity: only
    goodput at each scenario's base load)."""
    reference: bool = False
    """Also find the reference controller's capacity per scenario: the rollout over the
    scenario's best time-budget rule among --policies (it sees the future; slow), or MPC
    over the hindsight-best static where no such rule is given."""
    reference_scenarios: str | None = None
    """With --reference: only these comma-separated scenarios (default: all)."""
    max_pass_itl: float | None = None
    """Every scenario under this cap on the longest pass while anyone decodes, in ITL
    targets (unset: each scenario's own, none); static budgets are not capped."""
    out: str = "reports/suite"
    """Report folder."""


def _scenario(args) -> Scenario:
    return Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__})


def _check_args(args, argv) -> None:
    """Everything a sweep is given, checked before it starts: streams, requests, workers,
    the report folder, and what the scenario names (profiles, trace, length specs)."""
    integer("seeds", args.seeds, 1, MAX_STREAMS)
    if args.requests is not None:
        check_num_requests("requests", args.requests)
    if args.workers is not None:
        most = MAX_CLUSTER_WORKERS if args.ray_address else 4 * (os.cpu_count() or 1)
        integer("workers", args.workers, 1, most, "1 runs in this process; at most 4 per core of "
                "this machine, or 4096 on a Ray cluster")
    check_output("out", args.out, "folder")
    if isinstance(args, Scenario):
        # Streams come from held-out seeds (envs/seeds.py), never from --seed.
        if "seed" in given_fields(type(args), argv[1:]):
            raise ConfigError(f"seed: got {show(args.seed)}, not used here: {argv[0] if argv else 'a sweep'} "
                              "draws its streams from held-out seeds; set how many with --seeds")
        _scenario(args).check()


def cmd_compare(argv) -> int:
    args = parse(CompareArgs, argv, prog="python -m eval compare")
    if {"num_requests", "requests"} <= given_fields(CompareArgs, argv):
        raise ConfigError(f"requests: got {args.requests} and --num-requests {args.num_requests}; "
                          "give one (--requests: requests per stream; --num-requests: the "
                          "scenario's, the default for --requests)")
    _check_args(args, ["compare"] + list(argv))
    scenario = _scenario(args)
    policies = make_policies(args.policies, scenario, args.allow_table_mismatch)
    executor = args.executor()
    out = Path(args.out)
    with progress_bar((len(policies) + 15) * args.seeds, "compare") as bar:
        cmp = compare(scenario, policies, args.seeds, args.requests, progress=bar, executor=executor)
        if args.reference:
            cmp = compare_with_reference(cmp, args, executor, bar)
    figures = []
    if args.figures:
        with progress_bar(figure_count(policies, True, args.seeds), "figures") as bar:
            figures = comparison_figures(cmp, out, args.seeds, args.requests, executor, bar)
    capacity_rps = factor = None
    if unseparated(cmp):  # point to a load where the policies part
        b, _ = cmp.best_static()
        with progress_bar(BRACKET_STEPS, "capacity of the best fixed budget") as bar:
            capacity_rps, factor, _ = stream_capacity(
                scenario, StaticPolicy(b), 0, args.seeds, args.requests or scenario.num_requests,
                seed_base=PERIODIC_EVAL_SEEDS, progress=bar)
    text = comparison_report(cmp, out, args.seeds, figures=figures, capacity_rps=capacity_rps,
                             capacity_factor=factor)
    save_json(out / "results.json", cmp.as_json())
    print(json.dumps(cmp.as_json(), default=float) if args.json else text)
    return 0


def compare_with_reference(cmp, args, executor, bar):
    """Add the reference controller over the comparison's hindsight-best static budget."""
    ref = reference_for(cmp.scenario, cmp.best_static()[0])
    found, first = run_streams(cmp.scenario, [ref], args.seeds, args.requests, executor, bar)
    cmp.results.update(found)
    cmp.first_runs.update(first)
    return cmp


def cmd_capacity(argv) -> int:
    args = parse(CapacityArgs, argv, prog="python -m eval capacity")
    if "num_requests" in given_fields(CapacityArgs, argv):
        raise ConfigError(f"num_requests: got {show(args.num_requests)}, not used here: a capacity "
                          f"search's streams take --requests ({args.requests} here), and it "
                          "searches the load")
    _check_args(args, ["capacity"] + list(argv))
    scenario = _scenario(args)
    policies = make_policies(args.policies, scenario, args.allow_table_mismatch)
    executor = args.executor()
    out = Path(args.out)
    tables = sum(p.kind == "table" for p in policies)  # and each table's trace at its capacity
    with progress_bar((len(policies) + 15 + tables) * args.seeds, "capacity searches") as bar:
        (study,) = capacity_studies([(scenario, policies)], args.seeds, args.requests, executor, bar)
        if args.reference:
            add_references([study], args.seeds, args.requests, executor, bar)
        (uses,) = tables_use([study], [policies], args.requests, executor, bar)
    figures = []
    if args.figures:
        with progress_bar(figure_count(policies, True, args.seeds), "figures") as bar:
            figures = capacity_figures(study, policies, out, args.seeds, args.requests, executor, bar)
    text = capacity_report(study, out, args.seeds, args.requests, uses, figures)
    data = {**study.as_json(), **({"_table_use": uses} if uses else {})}
    save_json(out / "capacity.json", data)
    print(json.dumps(data) if args.json else text)
    return 0


def cmd_suite(argv) -> int:
    args = parse(SuiteArgs, argv, prog="python -m eval suite")
    names = [n for s in args.scenarios.split(",") for n in GROUPS.get(s.strip(), [s.strip()])]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ConfigError(f"scenarios: unknown {show(', '.join(unknown), 200)}; "
                          f"{did_you_mean(unknown[0], SUITE)}known: {', '.join(SUITE)}")
    if args.reference_scenarios is not None:
        wanted = [s.strip() for s in args.reference_scenarios.split(",")]
        stray = [n for n in wanted if n not in names]
        if stray or not args.reference:
            raise ConfigError(
                f"reference_scenarios: got {show(args.reference_scenarios, 200)}; "
                + (f"{', '.join(stray)} not among the suite's scenarios ({', '.join(names)})" if stray
                   else "given without --reference, which it narrows"))
    check_max_pass_itl(args.max_pass_itl)
    _check_args(args, ["suite"] + list(argv))
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    print(run_suite(names, specs, args, args.executor()))
    return 0


def cmd_export(argv) -> int:
    return export_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__ + listing())
            return 0
        raise ConfigError(f"command: got {show(argv[0]) if argv else 'nothing'}, must be one of "
                          f"{', '.join(COMMANDS)} (python -m eval COMMAND --help)")
    return {"compare": cmd_compare, "capacity": cmd_capacity, "suite": cmd_suite,
            "export": cmd_export}[argv[0]](argv[1:])


if __name__ == "__main__":
    run_cli(main)
