"""Comparisons, capacity tables and the scenario suite, with their reports."""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.chunk_budget_env import EVAL_SEED_BASE
from envs.scenario import Scenario
from envs.workload import load_trace
from eval import plots
from eval.capacity import capacity
from eval.harness import PolicyResult, against_best, evaluation_workloads
from policies.baselines import StaticPolicy

LADDER = (256, 512, 1024, 2048, 4096, 8192, 16384)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def workloads_for(scenario: Scenario, seeds: int, num_requests: int | None):
    """The same arrivals for every policy: the trace window as given, or synthetic streams
    seeded from EVAL_SEED_BASE (no training episode ever draws those seeds)."""
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
        return max(self.ladder.items(), key=lambda kv: (kv[1].mean("goodput"), -kv[1].mean("ttft_p99_s")))

    def as_json(self) -> dict:
        out = {name: r.summary() for name, r in self.results.items()}
        b, best = self.best_static()
        out["_best_static"] = {"budget": b, **best.summary()}
        return out


def compare(scenario: Scenario, policies, seeds: int = 3, num_requests: int | None = None,
            progress=None) -> Comparison:
    workloads = workloads_for(scenario, seeds, num_requests)
    slo = scenario.slo()
    results, first = {}, {}
    ladder_policies = [StaticPolicy(b) for b in LADDER if b >= scenario.max_num_seqs]
    runs = list(policies) + [p for p in ladder_policies if p.name not in {q.name for q in policies}]
    for policy in runs:
        res = PolicyResult(policy.name)
        for i, w in enumerate(workloads):
            policy.reset()
            sim_result = scenario.simulator(w).run(policy)
            s = sim_result.summary(slo)
            res.runs.append(s)
            if i == 0:
                first[policy.name] = sim_result
            if progress is not None:
                progress.update(1)
        results[policy.name] = res
    ladder = {p.tokens: results[p.name] for p in ladder_policies}
    shown = {p.name: results[p.name] for p in policies}
    notes = [n for n in (training_overlap(p, scenario) for p in policies) if n]
    return Comparison(scenario, shown, ladder, first, notes)


def fmt(v, scale=1.0, digits=3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}f}"


def results_table(results: dict[str, PolicyResult]) -> str:
    lines = ["| policy | goodput | goodput req/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | worst gap (ms) "
             "| TPOT p99 (ms) | smooth share | preemptions | mean budget |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        s = r.summary()
        lines.append(
            f"| {name} | {fmt(s['goodput'])} ± {fmt(s['goodput_ci95'])} | {fmt(s['goodput_rps'], digits=2)} "
            f"| {fmt(s['ttft_p50_s'], digits=2)} / {fmt(s['ttft_p99_s'], digits=2)} "
            f"| {fmt(s['itl_p50_s'], 1e3, 1)} / {fmt(s['itl_p99_s'], 1e3, 1)} | {fmt(s['itl_max_s'], 1e3, 0)} "
            f"| {fmt(s['tpot_p99_s'], 1e3, 1)} | {fmt(s['smooth_share'])} | {fmt(s['preemptions'], digits=0)} "
            f"| {fmt(s['budget_mean'], digits=0)} |")
    return "\n".join(lines)


def two_questions(cmp: Comparison) -> list[str]:
    """DESIGN.md section 5: does each adaptive policy match the hindsight-best static budget
    (regret), and where does it beat it (gain)? Said plainly, including where it does not."""
    b, best = cmp.best_static()
    g_best = best.mean("goodput")
    lines = [f"Best static budget in hindsight: {b} (goodput {g_best:.3f}, p99 TTFT "
             f"{best.mean('ttft_p99_s'):.2f} s, p99 ITL {best.mean('itl_p99_s') * 1e3:.1f} ms)."]
    for name, r in cmp.results.items():
        if name.startswith("static:"):
            continue
        kind, rel = against_best(r.mean("goodput"), g_best)
        verdict = {"beats": f"beats it by {rel:+.1%} goodput (job 2)",
                   "matches": f"matches it within 1% ({rel:+.1%}; job 1), without beating it",
                   "short": f"does NOT match it: {rel:+.1%} goodput"}[kind]
        lines.append(f"- {name}: {verdict}; worst gap {r.mean('itl_max_s') * 1e3:.0f} ms vs "
                     f"{best.mean('itl_max_s') * 1e3:.0f} ms, smooth share {r.mean('smooth_share'):.3f} "
                     f"vs {best.mean('smooth_share'):.3f}.")
    return lines


def scenario_line(sc: Scenario) -> str:
    load = (f"trace {sc.trace} x{sc.rate_scale:g} from {sc.window_start_s:g} s" if sc.trace else
            f"{sc.arrival} arrivals at {sc.rate:g} req/s, prompts {sc.prompt}, outputs {sc.output}")
    extra = []
    if sc.per_pass_overhead_s is not None:
        extra.append(f"{sc.per_pass_overhead_s * 1e3:g} ms per pass")
    if sc.num_kv_blocks:
        extra.append(f"KV cache {sc.num_kv_blocks} blocks")
    return (f"{sc.hardware} + {sc.model}; {load}; SLO TTFT {sc.slo_ttft_s:g} s / ITL "
            f"{sc.slo_itl_s * 1e3:g} ms" + (f"; {', '.join(extra)}" if extra else ""))


def write_figures(cmp: Comparison, out: Path, prefix: str = "") -> list[Path]:
    sc = cmp.scenario
    figs = []
    points = {n: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for n, r in cmp.results.items()}
    statics = {b: (r.mean("ttft_p99_s"), r.mean("itl_p99_s")) for b, r in cmp.ladder.items()}
    figs.append(plots.pareto(points, statics, (sc.slo_ttft_s, sc.slo_itl_s),
                             out / f"{prefix}pareto.png", "p99 TTFT against p99 ITL"))
    # Timeline: the window around the first long prefill of the first adaptive policy.
    order = sorted(cmp.results, key=lambda n: (not n.startswith(("model:", "table:", "learned")),
                                               n.startswith(("static:", "vllm-default"))))
    name = order[0]
    res = cmp.first_runs[name]
    if len(res.pass_prefill_tokens):
        start = int(np.argmax(res.pass_prefill_tokens > 0.5 * res.pass_prefill_tokens.max()))
        lo, hi = max(start - 20, 0), min(start + 80, len(res.pass_end_s))
        figs.append(plots.timeline(res, (lo, hi), out / f"{prefix}timeline.png",
                                   f"{name}: passes {lo}-{hi}"))
    samples = {}
    for n, r in cmp.first_runs.items():
        if n in cmp.results and not n.startswith("static:"):
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
             f"policy; synthetic seeds {EVAL_SEED_BASE}+, never drawn in training)",
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
    statics = {n: v for n, v in values.items() if n.startswith("static:") or n.startswith("vllm-default")}
    best_static = max((n for n in values if n.startswith("static:")), key=values.get, default=None)
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


def save_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float))
