"""Report pieces every command shares: number formatting, result tables, verdicts against
the best static budget, the words a report defines, its figures, scenario lines and commit
stamps."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from envs.files import write_atomic
from envs.scenario import Scenario
from eval.harness import MATCH_TOLERANCE, NOT_JUDGED, SIGN_STREAMS, PolicyResult


def git_commit() -> str:
    """The repository's short commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fmt(v, scale=1.0, digits=3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}f}"


def share(v) -> str:
    """A share as a percentage, n/a where undefined."""
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1%}"


def save_json(path: Path, data) -> None:
    """Written atomically: a reader never sees half a report."""
    write_atomic(path, json.dumps(data, indent=2, default=float))


def results_table(results: dict[str, PolicyResult]) -> str:
    """Every figure of every policy (eval compare's report)."""
    lines = ["| policy | p99 SLO met | goodput | goodput req/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
             "| worst gap (ms) | passes over ITL target | TPOT p99 (ms) | smooth share | preemptions "
             "| mean budget |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        s = r.summary()
        lines.append(
            f"| {name} | {s['slo_streams']} of {s['seeds']} | {fmt(s['goodput'])} ± {fmt(s['goodput_ci95'])} "
            f"| {fmt(s['goodput_rps'], digits=2)} "
            f"| {fmt(s['ttft_p50_s'], digits=2)} / {fmt(s['ttft_p99_s'], digits=2)} "
            f"| {fmt(s['itl_p50_s'], 1e3, 1)} / {fmt(s['itl_p99_s'], 1e3, 1)} | {fmt(s['itl_max_s'], 1e3, 0)} "
            f"| {share(s['slow_pass_share'])} | {fmt(s['tpot_p99_s'], 1e3, 1)} | {fmt(s['smooth_share'])} | {fmt(s['preemptions'], digits=0)} "
            f"| {fmt(s['budget_mean'], digits=0)} |")
    return "\n".join(lines)


def prefix_table(results: dict[str, PolicyResult]) -> list[str]:
    """Prefix caching's figures of every policy (none without it): eval compare's report."""
    rows = [(name, r.summary()) for name, r in results.items()]
    rows = [(name, s) for name, s in rows if "prefix_hit_rate_tokens" in s]
    if not rows:
        return []
    lines = ["| policy | prefix hits: requests / prompt tokens | cached tokens per prefill pass "
             "| prefill tokens saved |", "|---|---:|---:|---:|"]
    for name, s in rows:
        lines.append(f"| {name} | {share(s['prefix_hit_rate_requests'])} / "
                     f"{share(s['prefix_hit_rate_tokens'])} | {fmt(s['prefix_cached_tokens_per_pass'], digits=0)} "
                     f"| {fmt(s['prefill_tokens_saved'], digits=0)} |")
    return ["", "Prefix caching (the mean over streams):", "", *lines]


def verdict_sentence(verdict, best_name: str, what: str = "goodput") -> str:
    """DESIGN.md section 5's two jobs, said plainly, for a policy against the hindsight-best
    static budget (an :class:`eval.harness.Verdict` over the same streams)."""
    fig = f"{verdict.figure} {what}"
    job1 = (f"within {MATCH_TOLERANCE:.0%}: job 1 met" if verdict.matches
            else f"not within {MATCH_TOLERANCE:.0%}: job 1 not met")
    if verdict.kind == "beats":
        return f"beats the best static budget ({best_name}) by {fig} (job 2)"
    if verdict.kind == "ties":
        return f"ties with the best static budget ({best_name}), {fig} ({job1})"
    if verdict.kind == NOT_JUDGED:
        return (f"{verdict.rel:+.1%} {what} against the best static budget ({best_name}) on one "
                f"stream: no interval, not judged ({job1} on that stream)")
    return f"falls short of the best static budget ({best_name}): {fig} ({job1})"


def scenario_line(sc: Scenario) -> str:
    load = (f"trace {sc.trace} x{sc.rate_scale:g} from {sc.window_start_s:g} s" if sc.trace else
            f"{sc.arrival} arrivals at {sc.rate:g} req/s, prompts {sc.prompt}, outputs {sc.output}")
    extra = []
    if sc.per_pass_overhead_s is not None:
        extra.append(f"{sc.per_pass_overhead_s * 1e3:g} ms per pass")
    if sc.num_kv_blocks:
        extra.append(f"KV cache {sc.num_kv_blocks} blocks")
    if sc.max_pass_itl is not None:
        extra.append(cap_words(sc.max_pass_itl))
    return (f"{sc.hardware} + {sc.model}; {load}; SLO TTFT {sc.slo_ttft_s:g} s / ITL "
            f"{sc.slo_itl_s * 1e3:g} ms" + (f"; {', '.join(extra)}" if extra else ""))


def cap_words(max_pass_itl: float) -> str:
    """An operator's cap on the longest pass (``Scenario.max_pass_itl``), in words."""
    return (f"adaptive policies make no pass over {max_pass_itl:g} times the ITL target while "
            "anyone decodes (static budgets are not capped)")


def ladder_words(budgets) -> str:
    """How the static ladder was searched, from the budgets it measured."""
    powers = [b for b in budgets if b & (b - 1) == 0]
    return (f"the powers of two from {min(powers):,} to {max(powers):,} tokens, then steps of "
            f"2^(1/4) within an octave of the best" if powers else "a ladder of 2^(1/4) steps")


def capacity_words(seeds: int, requests: int | None, trace: bool, held_out: bool, budgets) -> list[str]:
    """The words a capacity report uses, defined (capacity.md, a run's summary.md)."""
    streams = (f"{seeds} {'held-out ' if held_out else ''}stream{'s' * (seeds != 1)}"
               + (f" of {requests} requests" if requests else "")
               + (" (the trace's window cut into parts)" if trace else "")
               + (" per scenario, seeded apart from every training episode" if held_out else ""))
    return [f"- Capacity: on each stream, the highest arrival rate at which p99 TTFT and p99 ITL "
            f"both meet the SLO (bisection to 2%); {streams}. A figure is the mean over streams "
            "± its 95% interval (Student's t).",
            f"- The best fixed budget: the static budget with the highest capacity on the same "
            f"streams, searched on {ladder_words(budgets)}; it is picked in hindsight.",
            "- Against it: each policy's capacity as a ratio to the best fixed budget's on the same "
            "stream, the mean difference ± its 95% interval; *beats* or *falls short* when the "
            f"interval lies above or below zero or the policy is on that side on every one of "
            f"{SIGN_STREAMS} or more streams, *ties* otherwise. *Job 1* is being within {MATCH_TOLERANCE:.0%} of "
            "the best fixed budget with one untuned policy, *job 2* beating it."]


def figure_lines(figures) -> list[str]:
    """A report's figures, each with its caption: [(path, caption)] as markdown."""
    if not figures:
        return []
    lines = ["## Figures", ""]
    for path, caption in figures:
        lines += [f"![{Path(path).stem}]({Path(path).name})", "", caption, ""]
    return lines
