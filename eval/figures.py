"""The pictures a report shows, and the runs they need (:mod:`eval.plots` draws them).

- :func:`ladder_panel`: a capacity study's ladder and policies, for
  :func:`eval.plots.ladder_figure` (no runs: the study has them);
- :func:`runs_at_load`: every policy on one stream at one load, kept whole: the latency
  tails and the budget timeline come from them;
- :func:`worst_gap_window`: the window around the longest pass any of them ran with
  decodes waiting, named;
- :func:`goodput_curves`: goodput of every policy at several loads, streams fanned out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from envs.scenario import Scenario
from envs.stats import ci95_half
from eval import plots
from eval.capacity import probe_stream
from eval.harness import paired_verdict
from eval.parallel import LocalExecutor
from policies.baselines import StaticPolicy

GOODPUT_LOADS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)
"""Loads of the goodput curve, as multiples of each stream's capacity under the best fixed
budget (or of a comparison's own load): below capacity every policy meets its targets, past
it they part."""
CURVE_STREAMS = 3
"""Streams per point of the goodput curve (the first few of the study's)."""
WINDOW_ITL_TARGETS = 40
"""The budget timeline's width, in ITL targets (4 s at 100 ms): room for a few prompts'
prefill around the worst gap."""


def figure_policies(policies, best_budget: int) -> list:
    """The policies a report's pictures run again: every one that is not a diagnostic, each
    name once, and the best fixed budget (``static:best_budget``) where it is not among them."""
    out, names = [], set()
    for p in policies:
        if not getattr(p, "diagnostic", False) and p.name not in names:
            out.append(p)
            names.add(p.name)
    if f"static:{best_budget}" not in names:
        out.append(StaticPolicy(best_budget))
    return out


def ladder_panel(study, title: str) -> dict:
    """A capacity study as one panel of :func:`eval.plots.ladder_figure`: each rung and each
    policy as its capacity relative to the best fixed budget's on the same stream, the mean
    over streams with its 95% interval (:func:`eval.harness.paired_verdict`: a policy's band
    is its verdict), so that streams of different scale do not widen it; in req/s where
    the best fixed budget serves nothing."""
    best = study.best
    if best.capacity <= 0:
        return {"title": title, "best": study.best_budget, "relative": False,
                "rungs": {b: (r.capacity, r.ci95) for b, r in study.rungs.items()},
                "policies": {n: (r.capacity, r.ci95) for n, r in study.policies.items()}}

    def rel(r):
        v = paired_verdict(r.per_stream, best.per_stream)
        return (1.0 + v.rel, v.half) if v.streams else (np.nan, 0.0)

    return {"title": f"{title}; best fixed budget {study.best_budget:,}: {best.capacity:.2f} req/s = 100%",
            "best": study.best_budget, "relative": True,
            "rungs": {b: rel(r) for b, r in study.rungs.items()},
            "policies": {n: rel(r) for n, r in study.policies.items()}}


def _run(scenario: Scenario, policy, stream: int, streams: int, num_requests: int | None,
         factor: float, seed_base: int, keep: bool):
    sc, w = probe_stream(scenario, stream, streams, num_requests or scenario.num_requests, factor,
                         seed_base=seed_base)
    policy.reset()
    result = sc.simulator(w).run(policy)
    return result if keep else result.summary(sc.slo())


def runs_at_load(scenario: Scenario, policies, stream: int, streams: int,
                 num_requests: int | None, factor: float, seed_base: int) -> dict:
    """Every policy's whole run (``SimResult``) on stream ``stream`` at ``factor`` times the
    scenario's load, in this process (a few runs; their pass logs stay here)."""
    return {p.name: _run(scenario, p, stream, streams, num_requests, factor, seed_base, True)
            for p in policies}


def worst_gap_window(results: dict, itl_s: float) -> tuple[tuple[float, float], str]:
    """(the window, its name): the span of :data:`WINDOW_ITL_TARGETS` ITL targets around
    the longest pass that any of ``results`` ran with decodes waiting on it (the worst gap
    a running user saw), and a sentence saying whose it was."""
    worst = (-1.0, 0.0, "")
    for name, r in results.items():
        dur, dec = r.pass_duration_s, r.pass_decodes
        if not len(dur) or not (dec > 0).any():
            continue
        i = int(np.argmax(np.where(dec > 0, dur, -1.0)))
        if dur[i] > worst[0]:
            worst = (float(dur[i]), float(r.pass_end_s[i] - dur[i]), name)
    gap, at, name = worst
    half = WINDOW_ITL_TARGETS * itl_s / 2
    if gap < 0:
        return (0.0, 2 * half), "the first seconds (no pass ran with decodes waiting)"
    return (max(at - half, 0.0), at + half), (f"the window around the worst gap: {gap * 1e3:,.0f} ms "
                                               f"under {name}, at {at:,.1f} s")


def timeline_runs(results: dict) -> dict:
    """Each run's (pass start times, budgets, durations, decodes)."""
    return {n: (r.pass_end_s - r.pass_duration_s, r.pass_budget, r.pass_duration_s, r.pass_decodes)
            for n, r in results.items()}


def tail_samples(results: dict) -> dict:
    """Each run's (TTFT per request, pass durations, decodes per pass)."""
    return {n: (r.ttft_s, r.pass_duration_s, r.pass_decodes) for n, r in results.items()}


def goodput_curves(scenario: Scenario, policies, loads, factors, num_requests: int | None,
                   seed_base: int, executor=None, progress=None, of_streams: int | None = None) -> dict:
    """name -> (``loads``, mean goodput over the streams, its 95% half-interval): stream ``i``
    (of ``of_streams``, as the study cut them) run at each load times ``factors[i]`` times the
    scenario's load; with each stream's own capacity as its factor, the streams line up at
    1 whatever their scale."""
    of = of_streams or len(factors)
    streams = len(factors)
    tasks = [(scenario, p, i, of, num_requests, m * factors[i], seed_base, False)
             for p in policies for m in loads for i in range(streams)]
    found = (executor or LocalExecutor()).map(_run, tasks, progress)
    out, k = {}, 0
    for p in policies:
        means, halves = [], []
        for _ in loads:
            good = [s["goodput"] for s in found[k:k + streams] if np.isfinite(s["goodput"])]
            k += streams
            means.append(float(np.mean(good)) if good else np.nan)
            halves.append(ci95_half(good))
        out[p.name] = (np.asarray(loads, dtype=float), np.asarray(means), np.asarray(halves))
    return out


def at_load_figures(results: dict, scenario: Scenario, out: Path, what: str,
                    prefix: str = "") -> list[tuple[Path, str]]:
    """The latency tails and the budget timeline of ``results`` (one stream, one load):
    [(figure, caption)]."""
    slo = (scenario.slo_ttft_s, scenario.slo_itl_s)
    window, name = worst_gap_window(results, scenario.slo_itl_s)
    tails = plots.latency_tails(tail_samples(results), slo, out / f"{prefix}latency.png",
                                f"TTFT and ITL tails, {what}")
    line = plots.budget_timeline(timeline_runs(results), window, scenario.slo_itl_s,
                                 out / f"{prefix}budget_timeline.png",
                                 f"budget and pass time of every policy, {name}")
    return [(tails, f"TTFT and ITL tails of every policy, {what}: a policy meets a p99 target "
                    "where its curve is below the 1% line at the dashed target."),
            (line, f"The budget of every policy over the same arrivals, {name} "
                   f"({what}); below, each pass that carried decodes: the gap each running user saw.")]
