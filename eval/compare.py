"""Comparisons of policies on identical arrivals, and capacity tables, with their reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.files import write_atomic
from envs.scenario import Scenario
from envs.seeds import PERIODIC_EVAL_SEEDS
from envs.workload import MAX_RATE, load_trace
from eval import plots
from eval.capacity import BRACKET_STEPS, POWERS_OF_TWO, quarter_steps_around
from eval.harness import PolicyResult, Verdict, best_of, paired_verdict, static_policies
from eval.parallel import LocalExecutor
from eval.report import git_commit, results_table, scenario_line, verdict_sentence
from eval.table_use import use_line


def workloads_for(scenario: Scenario, seeds: int, num_requests: int | None):
    """The same arrivals for every policy: synthetic streams seeded from
    PERIODIC_EVAL_SEEDS (no training episode ever draws those seeds), or the trace's
    window cut into ``seeds`` parts."""
    return scenario.streams(seeds, PERIODIC_EVAL_SEEDS, num_requests)


def training_overlap(policy, scenario: Scenario) -> str | None:
    """A sentence when a learned policy is evaluated on arrivals it may have trained on."""
    config = getattr(policy, "config", None) or getattr(getattr(policy, "table", None), "provenance", None)
    if not config:
        return None
    args = config.get("args", config)
    trained_on = args.get("trace") or args.get("workload")
    if scenario.trace and trained_on and Path(str(trained_on)).stem == Path(scenario.trace).stem:
        # Training used the first 80% of the trace, in the trace's own seconds.
        train_end = 0.8 * load_trace(scenario.trace).duration_s
        overlaps = scenario.window_start_s < train_end
        return (f"{policy.name} was trained on the first 80% of {trained_on} (to "
                f"{train_end:.0f} s); this evaluation replays {scenario.trace} from "
                f"{scenario.window_start_s:g} s"
                + (" and overlaps its training arrivals" if overlaps else
                   ", after its training window"))
    return None


def simulate_stream(scenario: Scenario, policy, stream: int, streams: int,
                    num_requests: int | None, keep: bool) -> tuple[dict, object]:
    """One policy on one evaluation stream: (its summary, its SimResult when ``keep``)."""
    w = scenario.stream(stream, streams, PERIODIC_EVAL_SEEDS, num_requests)
    policy.reset()
    result = scenario.simulator(w).run(policy)
    return result.summary(scenario.slo()), (result if keep else None)


@dataclass
class Comparison:
    scenario: Scenario
    results: dict[str, PolicyResult]
    ladder: dict[int, PolicyResult]
    """Every fine-ladder static budget measured, by budget."""
    first_runs: dict = field(default_factory=dict)  # name -> SimResult of the first stream
    notes: list[str] = field(default_factory=list)

    def best_static(self) -> tuple[int, PolicyResult]:
        """The hindsight-best static budget on the fine ladder, by goodput (then p99 TTFT)."""
        b = best_of(self.ladder)
        return b, self.ladder[b]

    def verdict(self, name: str) -> Verdict:
        _, best = self.best_static()
        return paired_verdict([r["goodput"] for r in self.results[name].runs],
                              [r["goodput"] for r in best.runs])

    def as_json(self) -> dict:
        out = {name: {**r.summary(), "verdict": str(self.verdict(name))}
               for name, r in self.results.items()}
        b, best = self.best_static()
        out["_hindsight_static"] = {"budget": b, "goodput": best.mean("goodput"), **best.summary()}
        return out


def run_streams(scenario: Scenario, policies, seeds: int, num_requests: int | None, executor,
                progress, keep_first: bool = True) -> tuple[dict[str, PolicyResult], dict]:
    """Every policy on every stream, fanned out; (results by name, first runs by name)."""
    tasks = [(scenario, p, i, seeds, num_requests, keep_first and i == 0)
             for p in policies for i in range(seeds)]
    found = (executor or LocalExecutor()).map(simulate_stream, tasks, progress)
    results, first = {}, {}
    for k, p in enumerate(policies):
        runs = found[k * seeds:(k + 1) * seeds]
        results[p.name] = PolicyResult(p.name, p.kind, [s for s, _ in runs])
        if runs and runs[0][1] is not None:
            first[p.name] = runs[0][1]
    return results, first


def compare(scenario: Scenario, policies, seeds: int = 5, num_requests: int | None = None,
            progress=None, executor=None) -> Comparison:
    """Every policy and the static ladder on the same arrivals (powers of two, then the
    fine ladder's quarter steps around the best by goodput); keeps each policy's first
    run for the figures."""
    def statics(budgets):
        return [p for p in static_policies(scenario, budgets) if p.name not in results]

    results: dict[str, PolicyResult] = {}
    found, first = run_streams(scenario, list(policies), seeds, num_requests, executor, progress)
    results.update(found)
    coarse = statics(POWERS_OF_TWO)
    found, _ = run_streams(scenario, coarse, seeds, num_requests, executor, progress, False)
    results.update(found)
    rungs = [b for b in POWERS_OF_TWO if b >= scenario.max_num_seqs]
    best = best_of({b: results[f"static:{b}"] for b in rungs})
    fine = quarter_steps_around(best, scenario.max_num_seqs)
    found, _ = run_streams(scenario, statics(fine), seeds, num_requests, executor, progress, False)
    results.update(found)
    ladder = {b: results[f"static:{b}"] for b in sorted(rungs + fine)}
    notes = [n for n in (training_overlap(p, scenario) for p in policies) if n]
    return Comparison(scenario, {p.name: results[p.name] for p in policies}, ladder, first, notes)


def two_questions(cmp: Comparison) -> list[str]:
    """DESIGN.md section 5: does each adaptive policy match the hindsight-best static budget
    (regret), and where does it beat it (gain)? Said plainly, including where it does not."""
    b, best = cmp.best_static()
    lines = [f"Best static budget in hindsight on the fine ladder (steps of 2^(1/4)): {b} "
             f"(goodput {best.mean('goodput'):.3f} ± {best.ci95('goodput'):.3f}, p99 TTFT "
             f"{best.mean('ttft_p99_s'):.2f} s, p99 ITL {best.mean('itl_p99_s') * 1e3:.1f} ms)."]
    for name, r in cmp.results.items():
        if r.kind == "static":
            continue
        lines.append(f"- {name}: {verdict_sentence(cmp.verdict(name), f'static:{b}')}; worst gap "
                     f"{r.mean('itl_max_s') * 1e3:.0f} ms vs {best.mean('itl_max_s') * 1e3:.0f} ms, "
                     f"smooth share {r.mean('smooth_share'):.3f} vs {best.mean('smooth_share'):.3f}.")
    return lines


def write_figures(cmp: Comparison, out: Path, prefix: str = "") -> list[Path]:
    sc = cmp.scenario
    figs = []
    points = {n: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for n, r in cmp.results.items()}
    statics = {b: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for b, r in cmp.ladder.items()}
    figs.append(plots.pareto(points, statics, (sc.slo_ttft_s, sc.slo_itl_s),
                             out / f"{prefix}pareto.png", "p99 TTFT against p99 ITL"))
    # Timeline: the window around the first long prefill of the first adaptive policy.
    order = sorted(cmp.results, key=lambda n: (cmp.results[n].kind not in ("learned", "table"),
                                               cmp.results[n].kind in ("static", "default")))
    name = order[0]
    res = cmp.first_runs[name]
    if len(res.pass_prefill_tokens):
        start = int(np.argmax(res.pass_prefill_tokens > 0.5 * res.pass_prefill_tokens.max()))
        lo, hi = max(start - 20, 0), min(start + 80, len(res.pass_end_s))
        figs.append(plots.timeline(res, (lo, hi), out / f"{prefix}timeline.png",
                                   f"{name}: passes {lo}-{hi}"))
    samples = {}
    for n, r in cmp.first_runs.items():
        if n in cmp.results and cmp.results[n].kind != "static":
            decided = r.pass_budget >= 0
            if len(np.unique(r.pass_budget[decided])) > 1:
                samples[n] = (r.pass_decodes[decided], r.pass_prefill_tokens[decided],
                              r.pass_budget[decided])
    if samples:
        figs.append(plots.budget_vs_state(samples, out / f"{prefix}budget_vs_state.png",
                                          "budget chosen against running decodes"))
    return figs


def comparison_report(cmp: Comparison, out: Path, seeds: int, title: str = "Comparison") -> str:
    figs = write_figures(cmp, out)
    lines = [f"# {title}", "",
             f"- scenario: {scenario_line(cmp.scenario)}",
             f"- streams: {len(next(iter(cmp.results.values())).runs)} (identical arrivals for every "
             + (f"policy; parts of the trace {cmp.scenario.trace}'s window)" if cmp.scenario.trace else
                f"policy; synthetic seeds {PERIODIC_EVAL_SEEDS}+, never drawn in training)"),
             f"- commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             results_table(cmp.results), "", "## Against the best static budget", "",
             *two_questions(cmp), ""]
    if cmp.notes:
        lines += ["## Note on training arrivals", "", *[f"- {n}" for n in cmp.notes], ""]
    lines += ["## Figures", ""] + [f"![{p.stem}]({p.name})" for p in figs] + [""]
    lines += ["Goodput: requests whose TTFT and TPOT meet the SLO (vLLM bench); ± is a 95% "
              "interval over streams. Smooth share: requests whose worst gap is within twice the "
              "ITL target. Worst gap: the longest pause any request saw.", ""]
    text = "\n".join(lines)
    write_atomic(out / "report.md", text)
    return text


def unbounded_note(studies) -> str | None:
    """A line naming the results whose search met the SLO at every load it tried (their
    capacity is a lower bound), or None."""
    found = [(n, len(r.unbounded)) for st in studies
             for n, r in [*st.policies.items(), *((f"static:{b}", r) for b, r in st.rungs.items())]
             if r.unbounded]
    if not found:
        return None
    names = ", ".join(f"{n} ({k} stream{'s' * (k > 1)})" for n, k in found[:8])
    more = " and more" if len(found) > 8 else ""
    return (f"NOTE: the SLO held at every load tried (up to 2^{BRACKET_STEPS - 1} times the "
            f"scenario's, at most {MAX_RATE:.0e} requests/s) for {names}{more}: those "
            "capacities are lower bounds, and the verdicts that use them are not measurements; "
            "longer streams (--requests) let a load bind.")


def held_out_cell(study, name: str) -> str:
    """A policy against the held-out static pick, as the verdict reads it."""
    if not study.has_held_out:
        return "n/a (one stream)"
    held, _ = study.held_out_static()
    if held.capacity <= 0:
        return "the held-out pick serves nothing"
    return str(paired_verdict(study.policies[name].per_stream, held.per_stream))


def held_out_line(study) -> str:
    """What the static budget picked without the stream it is judged on serves, and how
    much of the hindsight pick's lead is the pick's luck."""
    if not study.has_held_out:
        return "One stream: no held-out pick (it needs another stream to pick on)."
    held, picks = study.held_out_static()
    if study.best.capacity <= 0:
        return "Held-out pick: no static budget meets the SLO on any stream."
    luck = study.best.capacity - held.capacity
    return (f"Held-out pick (each stream judged under the rung best on the other streams, a "
            f"user's pick from past arrivals): rungs {'/'.join(map(str, picks))} (one per stream), "
            f"serving {held.text(3)} req/s; the hindsight pick's lead from "
            f"choosing on the streams it is judged on: {luck / study.best.capacity:.1%}.")


def capacity_report(study, out: Path, seeds: int, num_requests: int, uses: dict | None = None) -> str:
    """The capacity table of one scenario: every policy with its interval and its verdict
    against the hindsight-best static budget on the fine ladder, and the ladder itself;
    with ``uses`` (table name -> ``eval.table_use.pooled_use``), what each table does at its
    capacity."""
    b = study.best_budget
    best = study.best
    lines = ["# Capacity under the SLO", "", f"- scenario: {scenario_line(study.scenario)}",
             f"- capacity: per stream, the highest load at which p99 TTFT and p99 ITL meet the SLO "
             f"(bisection to 2%), over {seeds} stream{'s' * (seeds != 1)} of {num_requests} requests; ± is a 95% "
             "interval over streams; verdicts compare stream by stream",
             f"- commit {git_commit()}", "",
             (f"Hindsight-best static budget (fine ladder, steps of 2^(1/4)): {b} at "
              f"{best.text(3)} req/s." if best.capacity > 0 else
              "No static budget on the fine ladder meets the SLO at any load tried, on any stream."),
             "", held_out_line(study), "",
             "| policy | capacity (req/s) | against static:" + str(b) + " | against the held-out pick |",
             "|---|---:|---|---|"]
    for n, r in study.policies.items():
        against = (verdict_sentence(study.verdict(n), f'static:{b}', 'capacity') if best.capacity > 0
                   else "no static budget meets the SLO" + (", this policy does" if r.capacity > 0 else ""))
        lines.append(f"| {n} | {r.text(3)} | {against} | {held_out_cell(study, n)} |")
    lines += ["", "Static ladder measured: " + ", ".join(
        f"{k}: {r.capacity:.2f}" for k, r in study.rungs.items()) + " req/s."]
    note = unbounded_note([study])
    if note:
        lines += ["", note]
    worth = study.flat_verdicts()
    if worth:
        lines += ["", "What each table's cells are worth (the table against itself flattened, every "
                  "cell at one fraction of the ITL target, paired stream by stream):", ""]
        lines += [f"- {t} against {f}: {v.cell}" for t, f, v in worth]
    values = {**{n: r.capacity for n, r in study.policies.items()},
              f"static:{b} (hindsight best)": best.capacity}
    fig = plots.capacity_bars(values, out / "capacity.png", "capacity under the SLO")
    lines += ["", f"![capacity]({fig.name})", ""]
    if uses:
        lines += ["## What the tables do at their capacity", ""]
        lines += [f"- {n}: {use_line(u, u['action'], 'streams')}" for n, u in uses.items()] + [""]
    text = "\n".join(lines)
    write_atomic(out / "capacity.md", text)
    return text
