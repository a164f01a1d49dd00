"""Comparisons of policies on identical arrivals, and capacity tables, with their reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.files import write_atomic
from envs.scenario import Scenario
from envs.seeds import PERIODIC_EVAL_SEEDS
from envs.workload import load_trace
from eval import plots
from eval.answer import load_answer, load_words, slo_words
from eval.capacity import POWERS_OF_TWO, quarter_steps_around
from eval.harness import (MATCH_TOLERANCE, PolicyResult, Verdict, best_of, paired_verdict,
                          serving_of, static_policies)
from eval.parallel import LocalExecutor
from eval.figures import (CURVE_STREAMS, GOODPUT_LOADS, at_load_figures, figure_policies,
                          goodput_curves, runs_at_load)
from eval.report import (figure_lines, git_commit, ladder_words, prefix_table, results_table,
                         scenario_line, verdict_sentence)
from policies.baselines import StaticPolicy


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
    policies: list = field(default_factory=list)
    """The policies compared (the objects: the goodput curve runs them again)."""

    def best_static(self) -> tuple[int, PolicyResult]:
        """The hindsight-best static budget on the fine ladder at this load
        (:func:`eval.harness.rank_key`: the streams meeting the p99 targets, then goodput,
        then p99 TTFT)."""
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
        results[p.name] = PolicyResult(p.name, p.kind, [s for s, _ in runs], serving_of(p))
        if runs and runs[0][1] is not None:
            first[p.name] = runs[0][1]
    return results, first


def compare(scenario: Scenario, policies, seeds: int = 5, num_requests: int | None = None,
            progress=None, executor=None) -> Comparison:
    """Every policy and the static ladder on the same arrivals (powers of two, then the
    fine ladder's quarter steps around the best of them by :func:`eval.harness.rank_key`);
    keeps each policy's first run for the figures."""
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
    return Comparison(scenario, {p.name: results[p.name] for p in policies}, ladder, first, notes,
                      list(policies))


def two_questions(cmp: Comparison) -> list[str]:
    """DESIGN.md section 5: does each adaptive policy match the best fixed budget at this
    load (regret), and where does it beat it (gain)? Said plainly, including where it does
    not, and where a policy breaks the p99 targets that the best fixed budget meets."""
    b, best = cmp.best_static()
    n = len(best.runs)
    met = best.slo_streams()
    lines = [f"Best fixed budget at this load on the fine ladder (steps of 2^(1/4)): {b:,}, ranked "
             f"first by the streams on which it meets p99 TTFT and p99 ITL ({met} of {n}), then by "
             f"goodput ({best.mean('goodput'):.3f} ± {best.ci95('goodput'):.3f}; p99 TTFT "
             f"{best.mean('ttft_p99_s'):.2f} s, p99 ITL {best.mean('itl_p99_s') * 1e3:.1f} ms)."]
    for name, r in cmp.results.items():
        if r.kind == "static":
            continue
        gaps = (f"worst gap {r.mean('itl_max_s') * 1e3:.0f} ms vs {best.mean('itl_max_s') * 1e3:.0f} ms, "
                f"smooth share {r.mean('smooth_share'):.3f} vs {best.mean('smooth_share'):.3f}")
        if not r.meets_slo and best.meets_slo:
            lines.append(f"- {name}: meets p99 TTFT and p99 ITL on {r.slo_streams()} of {len(r.runs)} "
                         f"streams (p99 TTFT {r.mean('ttft_p99_s'):.2f} s, p99 ITL "
                         f"{r.mean('itl_p99_s') * 1e3:.1f} ms), where static:{b} meets them on all: "
                         f"behind it whatever its goodput ({r.mean('goodput'):.3f}); {gaps}.")
            continue
        lines.append(f"- {name}: {verdict_sentence(cmp.verdict(name), f'static:{b}')}; {gaps}.")
    return lines


def comparison_figures(cmp: Comparison, out: Path, seeds: int, num_requests: int | None,
                       executor=None, progress=None, curves: bool = True) -> list[tuple[Path, str]]:
    """The comparison's pictures, [(figure, caption)]: goodput against the static budget at
    this load; p99 TTFT against p99 ITL; every policy and the best fixed budget on the first
    stream (latency tails, the budget timeline around the worst gap, the budget against the
    running decodes); with ``curves``, goodput against load (0.5-1.5 times this one)."""
    sc = cmp.scenario
    slo = slo_words(sc)
    b, _ = cmp.best_static()
    panel = {"title": scenario_line(sc), "best": b,
             "failing": {k for k, r in cmp.ladder.items() if not r.meets_slo},
             "rungs": {k: (r.mean("goodput"), r.ci95("goodput")) for k, r in cmp.ladder.items()},
             "policies": {n: (r.mean("goodput"), r.ci95("goodput")) for n, r in cmp.results.items()}}
    figs = [(plots.ladder_figure([panel], out / "goodput_by_budget.png", "goodput",
                                 f"Goodput {load_words(sc)} under {slo}", "share of requests"),
             f"Goodput {load_words(sc)} against the static budget (the fine ladder, mean over streams "
             "with its 95% interval), each policy a line with its interval shaded; a cross marks a "
             "budget that breaks p99 TTFT or ITL on some stream. Goodput counts requests whose TTFT "
             "and TPOT meet the targets; it does not see p99 ITL.")]
    points = {n: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for n, r in cmp.results.items()}
    statics = {k: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for k, r in cmp.ladder.items()}
    figs.append((plots.pareto(points, statics, (sc.slo_ttft_s, sc.slo_itl_s), out / "pareto.png",
                              f"p99 TTFT against p99 ITL, mean over streams, {load_words(sc)}"),
                 "p99 TTFT against p99 ITL (means over streams): the SLO is met below and left of "
                 "the two targets."))
    first = {n: r for n, r in cmp.first_runs.items() if n in cmp.results}
    if f"static:{b}" not in first:
        first.update(runs_at_load(sc, [StaticPolicy(b)], 0, seeds, num_requests, 1.0,
                                  PERIODIC_EVAL_SEEDS))
    figs += at_load_figures(first, sc, out, f"the first stream {load_words(sc)}")
    samples = {}
    for n, r in first.items():
        if cmp.results.get(n) is not None and cmp.results[n].kind != "static":
            decided = r.pass_budget >= 0
            if len(np.unique(r.pass_budget[decided])) > 1:
                samples[n] = (r.pass_decodes[decided], r.pass_prefill_tokens[decided],
                              r.pass_budget[decided])
    if samples:
        figs.append((plots.budget_vs_state(samples, out / "budget_vs_state.png",
                                           "budget chosen against running decodes (first stream)"),
                     "What each adaptive policy chose against the running decodes, every decided pass "
                     "of the first stream, coloured by the prompt tokens the pass carried."))
    if curves:
        runners = figure_policies(cmp.policies, b)
        streams = min(CURVE_STREAMS, seeds)
        found = goodput_curves(sc, runners, GOODPUT_LOADS, [1.0] * streams, num_requests,
                               PERIODIC_EVAL_SEEDS, executor, progress, seeds)
        figs.append((plots.goodput_vs_load(found, out / "goodput_vs_load.png",
                                           f"goodput against load, {slo}",
                                           f"load, times this comparison's ({load_words(sc)[3:]})"),
                     f"Goodput against the load, 0.5-1.5 times this comparison's, mean over "
                     f"{streams} stream{'s' * (streams != 1)} with its 95% interval shaded."))
    return figs


def comparison_report(cmp: Comparison, out: Path, seeds: int, title: str = "Comparison",
                      figures: list[tuple[Path, str]] | None = None,
                      capacity_rps: float | None = None, capacity_factor: float | None = None) -> str:
    """``report.md``: the answer and the commands that serve it (:func:`eval.answer.load_answer`;
    ``capacity_rps`` and ``capacity_factor``, where known, point a load that does not separate
    the policies to one near capacity), then every figure of every policy, each against the
    best fixed budget, and ``figures``."""
    sc = cmp.scenario
    n = len(next(iter(cmp.results.values())).runs)
    lines = [f"# {title}: {slo_words(sc)} {load_words(sc)}", "",
             *load_answer(cmp, capacity_rps, capacity_factor).markdown(),
             "## What was measured", "",
             f"- Scenario: {scenario_line(sc)}; commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M')}.",
             f"- Streams: {n} (identical arrivals for every "
             + (f"policy; parts of the trace {sc.trace}'s window)." if sc.trace else
                f"policy; synthetic seeds {PERIODIC_EVAL_SEEDS}+, never drawn in training)."),
             "- Goodput: the share of requests whose TTFT and TPOT meet the SLO (vLLM bench's "
             "definition); it does not see p99 ITL, so a policy is ranked first by the streams on "
             "which its p99 TTFT and p99 ITL meet the targets (*p99 SLO met*), then by goodput. "
             "± is a 95% interval over streams (Student's t).",
             "- Against the best fixed budget: goodput as a ratio to its goodput on the same "
             "stream, the mean difference ± its 95% interval; *beats* or *falls short* when the "
             f"interval lies above or below zero, *ties* otherwise; *job 1* is being within "
             f"{MATCH_TOLERANCE:.0%}. The fixed budgets: {ladder_words(cmp.ladder)}.",
             "- Worst gap: the longest pause any request saw. Passes over ITL target: the share "
             "of passes with decodes that took longer than the ITL target (p99 ITL hides them; "
             "`--max-pass-itl` caps the first for every adaptive policy). Smooth share: requests "
             "whose worst gap is within twice the ITL target.", "",
             results_table(cmp.results), *prefix_table(cmp.results), "",
             "## Against the best fixed budget", "",
             *two_questions(cmp), ""]
    if cmp.notes:
        lines += ["## Note on training arrivals", "", *[f"- {n}" for n in cmp.notes], ""]
    lines += figure_lines(figures)
    text = "\n".join(lines).rstrip() + "\n"
    write_atomic(out / "report.md", text)
    return text
