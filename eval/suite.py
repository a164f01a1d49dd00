"""The scenario suite: every named scenario of ``eval/scenarios.py``, for one set of
policies, in one report. The headline is capacity under the SLO, each policy against
the hindsight-best static budget on the fine ladder (and the reference controller when
asked); goodput at each scenario's base load is the second table."""

from __future__ import annotations

import time
from pathlib import Path

from envs.files import write_atomic
from eval.capacity import CapacityStudy, add_references, capacity_studies
from eval.capacity_report import capacity_figures, capacity_report, unbounded_note
from eval.compare import Comparison, compare, comparison_figures, comparison_report
from eval.harness import SIGN_STREAMS
from eval.parallel import progress_bar
from eval.report import cap_words, git_commit, save_json, scenario_line
from eval.scenarios import SUITE
from eval.table_use import tables_use
from policies.base import tighter
from policies.specs import make_policies


def run_suite(names: list[str], specs: list[str], args, executor) -> str:
    """Compare, then (unless ``args.capacity`` is off) find capacities, for every named
    scenario; writes ``args.out``/README.md, suite.json and a folder per scenario."""
    out = Path(args.out)
    t0 = time.perf_counter()
    scenarios = [SUITE[n].with_fields(max_pass_itl=tighter(SUITE[n].max_pass_itl, args.max_pass_itl))
                 for n in names]
    policies = [make_policies(",".join(specs), sc, args.allow_table_mismatch) for sc in scenarios]
    comparisons = []
    with progress_bar(len(names) * (len(specs) + 15) * args.seeds, "suite: goodput") as bar:
        for sc, ps in zip(scenarios, policies):
            comparisons.append(compare(sc, ps, args.seeds, None if sc.trace else args.requests,
                                       progress=bar, executor=executor))
    studies: list[CapacityStudy | None] = [None] * len(names)
    uses: list[dict] = [{} for _ in names]
    if args.capacity:
        with progress_bar(len(names) * (len(specs) + 15) * args.seeds, "suite: capacity") as bar:
            studies = capacity_studies(list(zip(scenarios, policies)), args.seeds, args.requests,
                                       executor, bar)
        if args.reference:
            wanted = set(args.reference_scenarios.split(",")) if args.reference_scenarios else set(names)
            chosen = [st for n, st in zip(names, studies) if n in wanted]
            with progress_bar(len(chosen) * args.seeds, "suite: reference") as bar:
                add_references(chosen, args.seeds, args.requests, executor, bar)
        tables = sum(p.kind == "table" for ps in policies for p in ps)
        if tables:
            with progress_bar(tables * args.seeds, "suite: tables at capacity") as bar:
                uses = tables_use(studies, policies, args.requests, executor, bar)
    data = {}
    with progress_bar(len(names), "suite: figures") as bar:
        for name, cmp, st, use, ps in zip(names, comparisons, studies, uses, policies):
            folder = out / name
            requests = None if cmp.scenario.trace else args.requests
            hint = {}
            if st is not None and st.best.capacity > 0:
                hint = {"capacity_rps": st.best.capacity,
                        "capacity_factor": float(sum(st.best.factors) / len(st.best.factors))}
            figures = comparison_figures(cmp, folder, args.seeds, requests, curves=False)
            comparison_report(cmp, folder, args.seeds, f"Scenario {name}", figures, **hint)
            data[name] = {"scenario": scenario_line(cmp.scenario), "goodput": cmp.as_json()}
            if st is not None:
                figures = capacity_figures(st, ps, folder, args.seeds, args.requests, curves=False)
                capacity_report(st, folder, args.seeds, args.requests, use, figures)
                data[name]["capacity"] = {**st.as_json(), **({"_table_use": use} if use else {})}
            bar.update(1)
    text = suite_text(names, specs, comparisons, studies, args, time.perf_counter() - t0, uses)
    write_atomic(out / "README.md", text)
    save_json(out / "suite.json", data)
    return text


def _spec_names(cmp: Comparison, specs: list[str]) -> dict[str, str]:
    """Column (spec) -> the policy's name in this scenario (sarathi-slo's carries its N)."""
    return dict(zip(specs, list(cmp.results)[:len(specs)]))


def capacity_table(names, specs, comparisons, studies) -> list[str]:
    cols = specs + (["reference"] if any(st and len(st.policies) > len(specs) for st in studies) else [])
    lines = ["| scenario | hindsight static: capacity (req/s) | held-out pick | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for name, cmp, st in zip(names, comparisons, studies):
        by_spec = _spec_names(cmp, specs)
        ref = [n for n in st.policies if st.policies[n].kind == "reference"]
        if ref:
            by_spec["reference"] = ref[0]
        cells = []
        for col in cols:
            n = by_spec.get(col)
            if n is None or n not in st.policies:
                cells.append("not run")
                continue
            r, v = st.policies[n], st.verdict(n)
            cells.append(f"{r.text()} ({v.cell})")
        held, picks = st.held_out_static()
        held_cell = (f"{held.text()} ({'/'.join(map(str, sorted(set(picks))))})"
                     if st.has_held_out else "n/a (one stream)")
        lines.append(f"| {name} | {st.best_budget}: {st.best.text()} | {held_cell} | "
                     + " | ".join(cells) + " |")
    return lines


def goodput_table(names, specs, comparisons) -> list[str]:
    lines = ["| scenario | best fixed budget at that load: goodput | " + " | ".join(specs) + " |",
             "|---|---|" + "---|" * len(specs)]
    for name, cmp in zip(names, comparisons):
        b, best = cmp.best_static()
        cells = []
        for spec, n in _spec_names(cmp, specs).items():
            r, v = cmp.results[n], cmp.verdict(n)
            cells.append(f"{r.mean('goodput'):.3f} ({v.kind})")
        lines.append(f"| {name} | {b}: {best.mean('goodput'):.3f} | " + " | ".join(cells) + " |")
    return lines


def job_counts(names, specs, comparisons, studies) -> list[str]:
    """Per policy: scenarios within 2% of the hindsight static's capacity (job 1) and
    scenarios where it beats it beyond the interval (job 2)."""
    lines = []
    for spec in specs:
        within = beats = held = 0
        short = []
        for name, cmp, st in zip(names, comparisons, studies):
            n = _spec_names(cmp, specs)[spec]
            v = st.verdict(n)
            within += v.matches
            beats += v.kind == "beats"
            held += st.has_held_out and st.held_out_verdict(n).matches
            if not v.matches:
                short.append(f"{name} {v.rel:+.1%}")
        lines.append(f"- {spec}: within 2% of the hindsight static in {within} of {len(names)} "
                     f"scenarios and of the held-out pick in {held}; beats the hindsight static in "
                     f"{beats}" + (f"; more than 2% below it in {', '.join(short)}" if short else ""))
    return lines


def use_counts(names, specs, comparisons, uses) -> list[str]:
    """Per table, counted apart: the scenarios where, at its capacity, at least three
    token-budget bins each hold 5% of the passes it decides, and those where three of its
    cell values do; scenarios where it has no capacity are named, not counted."""
    lines = []
    for spec in specs:
        found = [(name, u.get(_spec_names(cmp, specs)[spec]))
                 for name, cmp, u in zip(names, comparisons, uses)]
        found = [(name, u) for name, u in found if u]
        if not found:
            continue
        none = [name for name, u in found if not u["streams"]]
        found = [(name, u) for name, u in found if u["streams"]]
        few = [name for name, u in found if u.get("budgets_5pct", 0) < 3]
        cells = [name for name, u in found if u["used_5pct"] >= 3]
        lines.append(f"- {spec} at its capacity: at least 3 token-budget bins (2^(1/4)) each in 5% "
                     f"of the passes it decides in {len(found) - len(few)} of {len(found)} scenarios"
                     + (f" (fewer in {', '.join(few)})" if few else "")
                     + f"; at least 3 of its cell values in {len(cells)}"
                     + (f" ({', '.join(cells)})" if cells else "")
                     + (f"; no capacity in {', '.join(none)}" if none else "")
                     + "; each scenario's capacity.md gives the shares and the budget by running decodes")
    return lines


def flat_counts(names, studies) -> list[str]:
    """Per (table, flattened twin) pair: the scenarios where the table beats, ties and falls
    short of itself with one fraction in every cell, each with its figure."""
    pairs: dict[tuple[str, str], dict[str, list[str]]] = {}
    for name, st in zip(names, studies):
        for table, flat, v in st.flat_verdicts():
            kinds = pairs.setdefault((table, flat), {})
            kinds.setdefault(v.kind, []).append(f"{name} {v.figure}")
    lines = []
    for (table, flat), kinds in pairs.items():
        parts = [f"{k} in {len(kinds[k])} ({', '.join(kinds[k])})"
                 for k in ("beats", "ties", "falls short", "not judged") if k in kinds]
        lines.append(f"- {table} against {flat} (what its cells' dependence on state is worth): "
                     + "; ".join(parts))
    return lines


def room_lines(names, studies) -> list[str]:
    """Per scenario with a rollout reference: the room it finds beyond the best rule."""
    found = [(name, ref, rule, v) for name, st in zip(names, studies) for ref, rule, v in st.room_verdicts()]
    if not found:
        return []
    kinds = {}
    for name, ref, rule, v in found:
        kinds.setdefault(v.kind, []).append(f"{name} {v.figure} over {rule}")
    return ["- the rollout reference (sees the future) against the best rule it is over: "
            + "; ".join(f"{k} in {len(kinds[k])} ({', '.join(kinds[k])})"
                        for k in ("beats", "ties", "falls short", "not judged") if k in kinds)]


def suite_text(names, specs, comparisons, studies, args, wall_s: float, uses=None) -> str:
    head = ["# chunkpilot evaluation suite", "",
            f"- policies: {','.join(specs)}; {args.seeds} stream{'s' * (args.seeds != 1)} of {args.requests} requests per "
            f"scenario (a trace's window cut into {args.seeds} parts); commit {git_commit()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}",
            "- the static ladder is searched on the powers of two up to 16,384 tokens, then quarter "
            "steps (2^(1/4)) within an octave of the best; each cell gives the policy's figure ± a "
            "95% interval over streams, then its difference from the hindsight-best static as the "
            "mean of each stream's ratio ± its interval, and the verdict (beats or falls short when "
            f"the interval excludes zero or the policy is on one side on all of {SIGN_STREAMS} or "
            "more streams, ties otherwise)",
            "- goodput at each scenario's base load: the best fixed budget there is the one meeting "
            "p99 TTFT and p99 ITL on most streams, then of highest goodput (goodput does not see "
            "p99 ITL)",
            "- held-out pick: each stream's capacity under the rung that is best on the other "
            "streams (the rungs picked in brackets), a fixed number a user could pick from past "
            "arrivals; the hindsight pick is chosen on the streams it is judged on",
            "- a table's use at its capacity: over the passes it decides on each stream at its own "
            "capacity, the 2^(1/4) token-budget bins and the cell values each holding at least 5% "
            "of them; one budget everywhere is a static budget, three or more is counted as "
            "state-dependent",
            *([f"- --max-pass-itl {args.max_pass_itl:g}: {cap_words(args.max_pass_itl)}"]
              if getattr(args, "max_pass_itl", None) is not None else []),
            "- a table beside its `table-flat:` twin (the same table, one fraction of the ITL "
            "target in every cell): the two paired stream by stream, what the table's dependence "
            "on state is worth apart from its time budget", ""]
    body = []
    if studies[0] is not None:
        body += ["## Capacity under the SLO", "",
                 "Capacity: per stream, the highest load at which p99 TTFT and p99 ITL meet the SLO "
                 "(bisection to 2%).", ""]
        body += capacity_table(names, specs, comparisons, studies) + [""]
        body += job_counts(names, specs, comparisons, studies) + [""]
        note = unbounded_note(studies)
        body += [note, ""] if note else []
        counts = use_counts(names, specs, comparisons, uses or [{} for _ in names])
        counts += flat_counts(names, studies) + room_lines(names, studies)
        body += counts + ([""] if counts else [])
    body += ["## Goodput at each scenario's base load", ""] + goodput_table(names, specs, comparisons)
    body += ["", "## Scenarios", ""] + [f"- [{n}]({n}/report.md): {scenario_line(SUITE[n])}" for n in names]
    return "\n".join(head + body + ["", f"Wall time: {wall_s:.0f} s with {executor_label(args)}.", ""])


def executor_label(args) -> str:
    if args.ray_address:
        return f"the Ray cluster at {args.ray_address}"
    return "1 worker (in process)" if args.workers == 1 else f"{args.workers or 'all'} Ray workers"
