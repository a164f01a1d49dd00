"""The export's report: what it printed about the table it wrote (from the table alone:
its cells, provenance and fidelity record), and the warnings a serving engineer must see."""

from __future__ import annotations

import sys

from eval.export.args import ExportArgs
from eval.export.dagger import round_labels
from eval.export.fidelity import LOUD_CAPACITY_LOSS, LOUD_GOODPUT_LOSS, flat_verdict
from eval.export.select import MIN_MODEL_GOODPUT
from eval.harness import NOT_JUDGED
from eval.table_use import use_line
from policies.baselines import FRACTION
from policies.table import DEPLOYMENT_AXES, BudgetTable


def capacity_judged(f: dict) -> str:
    """A fidelity capacity record's difference and verdict, table against model."""
    if f["verdict"] == NOT_JUDGED:
        return f"{-f['loss']:+.1%}, one stream: not judged"
    return f"{-f['loss']:+.1%} ± {f['loss_ci95']:.1%}, table {f['verdict']} model"


def capacity_warning(name: str, f: dict, streams: int | None) -> str:
    """The warning for a fidelity capacity loss above LOUD_CAPACITY_LOSS on scenario
    ``name``: a loss beyond the interval is the table's; one within an interval wider than
    the loss is not told from noise on these streams, and more streams would tell it."""
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
    kinds = table.candidate_kinds() or ["round"] * len(labels)
    source, source_kind = labels[dagger.get("chosen", 0)], kinds[dagger.get("chosen", 0)]
    built = (f"{sum(table.visited)} visited; {kind} {values[0]:g}-{values[-1]:g}; built from "
             f"{fid['build_decisions']:,} decisions"
             + ("; refined in closed loop" if source_kind == "refined" else "")
             if source_kind != "rule" else
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
        which = "the refined table" if source_kind == "refined" else f"the table of {source}"
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
    for line in flat_lines(fid.get("against_flat")):
        print(line)
    if source_kind == "rule":
        print(rule_note(source))
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
    if table.deployment_range is not None:
        print(carry_line(table))
        for line in blind_note(table):
            print(line)
    print(serve_line(table))


def carry_line(table: BudgetTable) -> str:
    """Where a table that carries (provenance ``deployments``) may serve, re-priced."""
    rng = table.deployment_range or {}
    if not rng:
        return "it carries, re-priced, to any deployment (its cells do not depend on the deployment)"
    return ("it carries, re-priced, to deployments whose " + "; ".join(
        f"{k} lies in [{lo:.4g}, {hi:.4g}]" for k, (lo, hi) in rng.items())
        + " (python -m policies.table check says whether one does)")


def blind_note(table: BudgetTable) -> list[str]:
    """A learned table that carries but reads no feature of the deployment: every
    deployment it serves looks up the same cells, made from the decisions of all of them
    (docs/learning.md measures one such table losing 7.7% of its model's capacity)."""
    if not table.deployment_range or any(f in DEPLOYMENT_AXES for f in table.features):
        return []
    return [f"NOTE: the table reads no feature of the deployment ({', '.join(DEPLOYMENT_AXES)}): "
            "every deployment it serves looks up the same cells, made from all of them; name one "
            "with --features, with edges that keep apart deployments whose best rules differ "
            '(docs/learning.md, "The learned policy as a table that carries")']


def flat_lines(flat: dict | None) -> list[str]:
    """What the table's cells are worth against its flat twin, as the export measured it."""
    if not flat:
        return []
    f = flat["fraction"]
    # Within time-budget's range the twin is that rule; beyond it, only the flat table.
    rule = f"time-budget:{f:g}" if f <= FRACTION.high else f"table-flat:{f:g}:PATH"
    found = "; ".join(f"{name} {g['table_capacity_rps']:.3f} against {g['flat_capacity_rps']:.3f} "
                      f"req/s ({flat_verdict(g).cell})"
                      for name, g in flat["scenarios"].items())
    lines = [f"what its cells are worth: against itself with {f:g} of the ITL target, the fraction "
             f"it takes most, in every cell ({rule}): {found}"]
    if all(g["verdict"] != "beats" for g in flat["scenarios"].values()):
        lines.append(f"NOTE: nowhere does the table serve more than its flat twin beyond the interval: "
                     f"on these streams its dependence on state shows no gain over {rule}")
    return lines


def rule_note(rule: str) -> str:
    """What a kept rule's table is, and where to measure whether a learned one could do better."""
    return (f"NOTE: the table is the {rule} rule's, a rule and not a learned policy: it kept more "
            "of the model's capacity and goodput than every table built from the model. Whether "
            "a learned table could serve more than the rule here is the room beyond it: the "
            "rollout reference over the best rule (`python -m eval capacity ... --policies "
            "RULES --reference`; for a preset's table, `python -m agents.presets --only NAME "
            "--room` records it in the table, and `policies.table show` prints it)")


def serve_line(table: BudgetTable) -> str:
    if table.max_budget is None:
        return (f"serve it in vLLM with --max-num-batched-tokens {table.action.cap} (its budgets' "
                "cap; a lower ceiling clamps them); see docs/serving.md")
    return (f"serve it in vLLM with --max-num-batched-tokens {table.max_budget} (the table's "
            "largest budget); see docs/serving.md")
