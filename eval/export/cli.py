"""``python -m eval export``: the command line over the table pipeline (``eval.export``):
flags checked before any simulation, the run loaded, the table exported, written and
reported."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from envs.deployment import TRAINING_DEPLOYMENTS
from envs.cli import parse
from envs.errors import ConfigError, integer, number, require, show
from envs.files import check_distinct, check_output
from envs.scenario import Scenario, check_max_pass_itl
from envs.workload import check_num_requests
from eval.capacity import capacity_sweep
from eval.export import export_run
from eval.export.args import MAX_EPISODES, ExportArgs, RuleExportArgs
from eval.export.carry import carries, on_deployment
from eval.export.cells import action_spec
from eval.export.features import CARRIED, MAX_BUCKETS, feature_specs
from eval.export.record import policy_for
from eval.export.refine import progress_path, refined_path
from eval.export.report import carry_line, report, serve_line
from eval.export.rules import by_deployment, parse_rule, rule_specs, rule_table
from eval.parallel import make_executor
from policies.base import tighter
from policies.learned import load_run
from policies.table import DERIVED, TableError, write_atomic


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
    given = given_traffic(args)
    for name, value in given.items():  # the first given is refused
        require(bool(args.hardware or args.model), name, value, "needs a deployment named "
                "(--hardware or --model): a run's own table is chosen on the run's serving workload")
    if args.hardware or args.model:  # the names and the traffic, before the run is loaded
        Scenario(**{k: v for k, v in (("hardware", args.hardware), ("model", args.model)) if v},
                 **given).check()
    check_num_requests("fidelity_requests", args.fidelity_requests)
    for f in ("slo_ttft_s", "slo_itl_s"):
        if getattr(args, f) is not None:
            number(f, getattr(args, f), 0, 3600, low_open=True)
    check_max_pass_itl(args.max_pass_itl)
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--rule" or a.startswith("--rule=") for a in argv):
        return rule_main(argv)
    args = parse_args(argv)
    model = load_run(args.run_dir)
    serving = Scenario(**model.config["scenario"])
    serving = serving.with_fields(slo_ttft_s=args.slo_ttft_s or serving.slo_ttft_s,
                                  slo_itl_s=args.slo_itl_s or serving.slo_itl_s,
                                  max_pass_itl=tighter(serving.max_pass_itl, args.max_pass_itl))
    require(serving.max_pass_itl is None or model.actions == "time", "max_pass_itl",
            serving.max_pass_itl, "needs a run acting in time (a token table cannot hold a cap "
            "on the pass's time)")
    if args.max_pass_itl is not None and serving.max_pass_itl != args.max_pass_itl:
        print(f"NOTE: max_pass_itl {args.max_pass_itl:g} is looser than the run's cap "
              f"({serving.max_pass_itl:g}), which the table keeps: the model never learned "
              "what its actions above it do")
    model.limit_pass(serving)
    check_against_run(args, model, serving)
    if args.hardware or args.model:
        model, serving = named_deployment(args, model, serving)
    t0 = time.perf_counter()
    table = export_run(model, serving, args)
    table.save(args.out)
    if args.csv:
        write_atomic(args.csv, table.to_csv())
    report(table, time.perf_counter() - t0, args)
    return 0


def named_deployment(args: ExportArgs, model, serving: Scenario):
    """(the run's model as a run on the deployment ``--hardware``/``--model`` name, that
    deployment's serving scenario at the model's capacity there): refused in one line where
    the model meets the SLO at no load (``check_against_run`` refuses the rest first)."""
    serving = named_serving(args, serving)
    found = capacity_sweep([(serving, policy_for(model, serving))], NAMED_STREAMS,
                           args.fidelity_requests, executor=make_executor(args.workers))[0]
    capacity = float(found.capacity)
    where = f"{serving.hardware} + {serving.model}"
    require(capacity > 0, "hardware", where, "the model meets the SLO at no load there: no "
            "table to make")
    print(f"{where}: the model's capacity there {capacity:.3f} req/s ({NAMED_STREAMS} streams); "
          "the table is built around it", flush=True)
    serving = serving.with_fields(rate=capacity)
    return on_deployment(model, serving, capacity), serving


def named_serving(args: ExportArgs, serving: Scenario) -> Scenario:
    """The serving scenario of the deployment ``--hardware``/``--model`` name: the run's
    serving scenario there, on the traffic given (``TRAFFIC``; the run's otherwise), with
    the part's own overhead and KV cache."""
    traffic = given_traffic(args)
    return serving.with_fields(hardware=args.hardware or serving.hardware,
                               model=args.model or serving.model,
                               per_pass_overhead_s=None, num_kv_blocks=None, **traffic).check()


TRAFFIC = ("arrival", "burstiness", "on_s", "off_s", "prompt", "output")
"""The serving workload's fields a named deployment's export may be given: its table is
built, chosen and checked on that traffic (default: the run's)."""


def given_traffic(args: ExportArgs) -> dict:
    """The ``TRAFFIC`` fields given on the command line (those not None)."""
    return {f: getattr(args, f) for f in TRAFFIC if getattr(args, f) is not None}


NAMED_STREAMS = 2
"""Streams on which a named deployment's capacity under the model sets the table's load."""


def check_against_run(args: ExportArgs, model, serving: Scenario) -> None:
    """The flags that depend on the run, checked once it is loaded and before any work: a
    named deployment needs a run across deployments, a derived feature a run acting in
    time, a deployment's feature a table that carries (a run across deployments, no
    deployment named), and a refinement one deployment's synthetic serving scenario."""
    named = bool(args.hardware or args.model)
    require(not named or bool(model.config["args"].get("all_deployments")), "hardware",
            args.hardware or args.model, "naming a deployment needs a run across deployments "
            "(train.py --all-deployments); a run on one deployment exports only its own")
    carry = carries(model) and not named
    names = feature_specs(args.features)[0] if args.features else []
    bad = [n for n in names if n in DERIVED and not action_spec(model, serving)]
    require(not bad, "features", args.features, f"{bad[0] if bad else ''} needs a run acting in time")
    bad = [n for n in names if n in CARRIED and not carry]
    require(not bad, "features", args.features, f"{bad[0] if bad else ''} is a deployment's "
            "feature: it needs a run across deployments acting in time (train.py "
            "--all-deployments) and no deployment named: a table that carries")
    require(not (args.refine_streams and serving.trace), "refine_streams", args.refine_streams,
            "needs a synthetic serving scenario: a trace's parts are those the choice replays")
    require(not (args.refine_streams and carry), "refine_streams", args.refine_streams,
            "needs a run on one deployment: a table that carries is chosen across the "
            "deployments its run trained on, not refined on one")


def rule_main(argv: list[str]) -> int:
    args = parse(RuleExportArgs, argv, prog="python -m eval export --rule RULE")
    scenario = args.scenario().check()
    check_output("out", args.out)
    if args.csv is not None:
        check_output("csv", args.csv)
    check_distinct(out=args.out, csv=args.csv)
    t0 = time.perf_counter()
    if args.by:
        table = by_deployment_table(args, scenario)
        table.save(args.out)
        if args.csv:
            write_atomic(args.csv, table.to_csv())
        check = table.fidelity["rule_check"]
        print(f"table: {args.out} ({table.cells} cells over {', '.join(table.features)}; "
              f"made in {time.perf_counter() - t0:.1f} s): {table.provenance['rule']}")
        print(f"each member the same budget as its rule at every pass of the scenario's "
              f"{check['requests']:,}-request stream ({check['passes']:,} passes, "
              f"{check['differ']} differ)")
        print(carry_line(table))
        print(serve_line(table))
        return 0
    table = rule_table(args.rule, scenario, scenario.arrivals())
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


def by_deployment_table(args, scenario):
    """``--by FEATURE:EDGES``: the rules of ``--rule``, one per bucket of the deployment's
    FEATURE, in one table fitted over the training deployments at this SLO."""
    feature, _, rest = args.by.partition(":")
    try:
        edges = [float(e) for e in rest.split(":")] if rest else []
    except ValueError:
        edges = []
    require(bool(edges) and all(math.isfinite(e) for e in edges)
            and all(a < b for a, b in zip(edges, edges[1:])), "by", args.by,
            "must be FEATURE:EDGE[:EDGE...] with increasing finite numbers")
    fitted = [scenario.with_fields(hardware=h, model=m, per_pass_overhead_s=None,
                                   num_kv_blocks=None) for h, m in TRAINING_DEPLOYMENTS]
    try:
        return by_deployment([r.strip() for r in args.rule.split(",")], feature, edges, scenario,
                             scenario.arrivals(), fitted)
    except TableError as err:
        raise ConfigError(f"by: {err}") from None
