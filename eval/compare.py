"""Comparisons of policies on identical arrivals, and capacity tables, with their reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.scenario import Scenario
from envs.seeds import PERIODIC_EVAL_SEEDS
from envs.workload import load_trace
from eval import plots
from eval.capacity import capacity
from eval.harness import (PolicyResult, against_best, best_of, evaluation_workloads, run_policies,
                          static_policies)
from eval.report import git_commit, results_table, scenario_line, verdict_sentence


def workloads_for(scenario: Scenario, seeds: int, num_requests: int | None):
    """The same arrivals for every policy: the trace window as given, or synthetic streams
    seeded from PERIODIC_EVAL_SEEDS (no training episode ever draws those seeds)."""
    return evaluation_workloads(scenario, seeds, num_requests, eval_span=None)


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


@dataclass
class Comparison:
    scenario: Scenario
    results: dict[str, PolicyResult]
    ladder: dict[int, PolicyResult]
    first_runs: dict = field(default_factory=dict)  # name -> SimResult of the first stream
    notes: list[str] = field(default_factory=list)

    def best_static(self) -> tuple[int, PolicyResult]:
        b = best_of(self.ladder)
        return b, self.ladder[b]

    def as_json(self) -> dict:
        out = {name: r.summary() for name, r in self.results.items()}
        b, best = self.best_static()
        out["_best_static"] = {"budget": b, **best.summary()}
        return out


def compare(scenario: Scenario, policies, seeds: int = 3, num_requests: int | None = None,
            progress=None) -> Comparison:
    """Every policy and the static ladder on the same arrivals; keeps each policy's first
    run for the figures."""
    workloads = workloads_for(scenario, seeds, num_requests)
    first = {}

    def keep(policy, index, result):
        if index == 0:
            first[policy.name] = result
        if progress is not None:
            progress.update(1)

    ladder_policies = static_policies(scenario)
    shown = {p.name for p in policies}
    runs = list(policies) + [p for p in ladder_policies if p.name not in shown]
    results = run_policies(scenario, runs, workloads, on_result=keep)
    ladder = {p.tokens: results[p.name] for p in ladder_policies}
    notes = [n for n in (training_overlap(p, scenario) for p in policies) if n]
    return Comparison(scenario, {p.name: results[p.name] for p in policies}, ladder, first, notes)


def two_questions(cmp: Comparison) -> list[str]:
    """DESIGN.md section 5: does each adaptive policy match the hindsight-best static budget
    (regret), and where does it beat it (gain)? Said plainly, including where it does not."""
    b, best = cmp.best_static()
    g_best = best.mean("goodput")
    lines = [f"Best static budget in hindsight: {b} (goodput {g_best:.3f}, p99 TTFT "
             f"{best.mean('ttft_p99_s'):.2f} s, p99 ITL {best.mean('itl_p99_s') * 1e3:.1f} ms)."]
    for name, r in cmp.results.items():
        if r.kind == "static":
            continue
        kind, rel = against_best(r.mean("goodput"), g_best)
        lines.append(f"- {name}: {verdict_sentence(kind, rel, f'static:{b}')}; worst gap "
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
             f"policy; synthetic seeds {PERIODIC_EVAL_SEEDS}+, never drawn in training)",
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    return text


def capacity_report(scenario: Scenario, policies, out: Path, seeds: int, num_requests: int,
                    progress=None) -> tuple[dict, str]:
    caps = {}
    for p in policies:
        caps[p.name] = capacity(scenario, p, seeds=seeds, num_requests=num_requests)
        if progress is not None:
            progress.update(1)
    values = {n: c.capacity for n, c in caps.items()}
    kinds = {p.name: p.kind for p in policies}
    statics = {n for n in values if kinds[n] in ("static", "default")}
    best_static = max((n for n in values if kinds[n] == "static"), key=values.get, default=None)
    # (the best static among those measured: include the ladder for a hindsight-best figure)
    lines = ["# Capacity under the SLO", "", f"- scenario: {scenario_line(scenario)}",
             f"- capacity: the highest rate at which mean p99 TTFT and p99 ITL over {seeds} streams of "
             f"{num_requests} requests meet the SLO (bisection to 2%)",
             f"- commit {git_commit()}", "", "| policy | capacity (req/s) |", "|---|---:|"]
    lines += [f"| {n} | {v:.3f} |" for n, v in values.items()]
    if best_static:
        lines += ["", f"Best static budget: {best_static} ({values[best_static]:.3f} req/s)."]
        for n, v in values.items():
            if n not in statics and values[best_static] > 0:
                lines.append(f"- {n} serves {v / values[best_static] - 1:+.1%} requests per second "
                             f"compared with {best_static} at the same SLO.")
    fig = plots.capacity_bars(values, out / "capacity.png", "capacity under the SLO")
    lines += ["", f"![capacity]({fig.name})", ""]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.md").write_text(text)
    return {n: {"capacity_rps": c.capacity, "probes": c.probes} for n, c in caps.items()}, text
