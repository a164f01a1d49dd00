"""The evaluation core: run policies on identical arrivals, aggregate over streams, and
rank static budgets. Every comparison, capacity probe, periodic evaluation during
training and table export runs its simulations through :func:`run_policies`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from envs.actions import STATIC_LADDER
from envs.scenario import Scenario
from envs.seeds import PERIODIC_EVAL_SEEDS
from envs.stats import ci95_half, standard_error
from envs.workload import Workload, load_trace
from policies.baselines import StaticPolicy

# Figures averaged over seeds in comparisons.
KEY_METRICS = ("goodput", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
               "itl_max_s", "slow_pass_share", "tpot_p99_s", "throughput_tok_s", "smooth_share", "preemptions",
               "stall_passes", "budget_mean", "requests_finished")

PREFIX_METRICS = ("prefix_hit_rate_requests", "prefix_hit_rate_tokens", "prefix_cached_tokens_per_pass",
                  "prefill_tokens_saved")
"""Prefix caching's figures (``envs.metrics.prefix_figures``), averaged where runs have them."""

OnResult = Callable[[object, int, object], None]
"""Called as ``on_result(policy, stream index, SimResult)`` after every simulation."""


def evaluation_workloads(scenario: Scenario, seeds: int, num_requests: int | None = None,
                         eval_span: tuple[float, float] | None = (0.8, 1.0),
                         seed_base: int = PERIODIC_EVAL_SEEDS) -> list[Workload]:
    """Arrivals no training episode saw: synthetic streams seeded from ``seed_base`` up
    (training draws seeds below EVAL_SEED_BASE), or for a trace the part after the
    training span (the last 20% by default; ``eval_span=None`` replays the scenario's
    own window as given)."""
    if scenario.trace:
        if eval_span is None:
            w = scenario.arrivals()
        else:
            full = load_trace(scenario.trace, scenario.rate_scale, scenario.window_start_s,
                              scenario.window_end_s)
            lo, hi = (f * full.duration_s for f in eval_span)
            w = full.window(lo, hi if eval_span[1] < 1.0 else None)
        return [w.head(num_requests) if num_requests else w]
    base = scenario if num_requests is None else scenario.with_fields(num_requests=num_requests)
    return [base.arrivals(seed_base + i) for i in range(seeds)]


MATCH_TOLERANCE = 0.02
"""Job 1 of DESIGN.md section 5, "match the best static budget": within 2% of it."""


@dataclass(frozen=True)
class Verdict:
    """A policy against a reference measured on the same streams (capacity or goodput),
    judged on each stream's ratio to the reference (:func:`paired_verdict`).

    ``kind`` is "beats" or "falls short" when the 95% interval of the per-stream relative
    differences lies above or below zero, or when the policy is on that side on every one
    of :data:`SIGN_STREAMS` or more streams (``by_sign``); "ties" otherwise; "not judged"
    where fewer than two streams compare (no interval). ``rel`` and ``half`` are the mean
    relative difference and its 95% half-interval (``z`` standard errors where
    :func:`paired_verdict` was given one); ``matches`` says whether the policy is within
    ``MATCH_TOLERANCE`` of the reference (job 1). ``only_policy`` counts the streams where
    the reference serves nothing and the policy serves something (no ratio exists there),
    ``neither`` those where both serve nothing (no information).
    """

    kind: str
    rel: float
    half: float
    streams: int | None = None
    """Streams compared as ratios (the reference above zero on them); None where the
    verdict was read back from a record that did not keep it."""
    only_policy: int = 0
    neither: int = 0
    by_sign: bool = False
    """Whether every stream on one side decided the kind where the interval did not."""

    @property
    def matches(self) -> bool:
        return self.rel >= -MATCH_TOLERANCE

    @property
    def figure(self) -> str:
        """The difference and its interval, or why there is none."""
        extra = (f"; {self.only_policy} stream{'s' * (self.only_policy > 1)} where only the "
                 "policy serves" if self.only_policy else "")
        if self.streams == 0:
            if self.only_policy:
                return f"serves {self.only_policy} stream{'s' * (self.only_policy > 1)} where the reference serves nothing"
            return "nothing compared" if not self.neither else "neither serves on any stream"
        if self.kind == NOT_JUDGED:
            return f"{self.rel:+.1%}, one stream: no interval{extra}"
        side = ("ahead" if self.rel > 0 else "behind")
        sign = f", {side} on all {self.streams} streams" if self.by_sign else ""
        return f"{self.rel:+.1%} ± {self.half:.1%}{sign}{extra}"

    @property
    def cell(self) -> str:
        """The figure and the verdict, as a report's table cell shows them in brackets."""
        return self.figure if self.kind == NOT_JUDGED else f"{self.figure}, {self.kind}"

    def __str__(self) -> str:
        return f"{self.kind} ({self.figure})"


NOT_JUDGED = "not judged"
"""A :class:`Verdict`'s kind where fewer than two streams compare."""

SIGN_STREAMS = 5
"""Streams all on one side that decide a verdict whatever the spread (DESIGN.md section 4:
a policy behind on every stream falls short): with no difference, all of 5 streams fall on
one given side with probability 1/32, on either side 1/16. A policy ahead on every window
of a trace by 12% to 115% is ahead, though the spread of its gains widens the interval
past zero."""


def _kind(d: np.ndarray, z: float | None, sign: bool = False) -> tuple[str, float, float, bool]:
    """(kind, mean, half-interval, decided by sign) of paired differences ``d`` (two or more)."""
    rel = float(d.mean())
    half = ci95_half(d) if z is None else z * standard_error(d)
    if rel - half > 0:
        return "beats", rel, half, False
    if rel + half < 0:
        return "falls short", rel, half, False
    if sign and len(d) >= SIGN_STREAMS and ((d > 0).all() or (d < 0).all()):
        return ("beats" if rel > 0 else "falls short"), rel, half, True
    return "ties", rel, half, False


def paired_verdict(values, reference, z: float | None = None) -> Verdict:
    """A policy's per-stream figures (capacity, goodput) against a reference's on the same
    streams, judged on ratios: each stream's relative difference ``value / reference - 1``,
    their mean and its 95% interval (Student's t over the streams; ``z`` standard errors
    where a caller selects by a fixed threshold rather than reporting), or every one of
    :data:`SIGN_STREAMS` or more streams on one side. Ratios make the verdict independent
    of scale: a trace cut into windows whose capacities differ 6x is judged window by
    window, where differences in req/s let the largest window's spread swamp a loss on
    every one.

    A stream where the reference serves nothing has no ratio: where the policy serves
    nothing either it is left out (``Verdict.neither``), where the policy serves it is
    counted apart (``Verdict.only_policy``); a stream where the policy serves nothing and
    the reference serves is a loss of 100%. With no stream left to compare as a ratio, a
    policy that serves on two or more streams where the reference serves on none beats it;
    on one such stream it is not judged; with nothing served anywhere, it ties. A stream
    whose figure is undefined on either side (NaN: nothing finished) is left out.
    """
    a, b = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"values: {a.shape} against reference {b.shape}; pair the same streams")
    defined = ~(np.isnan(a) | np.isnan(b))
    a, b = a[defined], b[defined]
    ok = b > 0
    only, neither = int(((~ok) & (a > 0)).sum()), int(((~ok) & ~(a > 0)).sum())
    d = a[ok] / b[ok] - 1.0
    if len(d) == 0:
        kind = "beats" if only >= 2 else NOT_JUDGED if only else "ties"
        return Verdict(kind, math.inf if only else 0.0, 0.0, 0, only, neither)
    if len(d) < 2:
        return Verdict(NOT_JUDGED, float(d[0]), 0.0, 1, only, neither)
    kind, rel, half, by_sign = _kind(d, z, sign=z is None)
    return Verdict(kind, rel, half, len(d), only, neither, by_sign)


def paired_difference(values, reference, z: float | None = None) -> Verdict:
    """The same verdict on absolute paired differences ``value - reference`` (``rel`` is
    then in the figures' own unit; no sign rule): for figures on one scale that may be
    zero, such as episode costs, where a ratio is undefined. One pair or none is not
    judged."""
    d = np.asarray(values, dtype=float) - np.asarray(reference, dtype=float)
    if len(d) < 2:
        return Verdict(NOT_JUDGED, float(d.mean()) if len(d) else 0.0, 0.0, len(d))
    kind, diff, half, _ = _kind(d, z)
    return Verdict(kind, diff, half, len(d))


def meets_p99(ttft_p99_s: float, itl_p99_s: float, slo_ttft_s: float, slo_itl_s: float) -> bool:
    """Whether one stream's p99 TTFT and p99 ITL meet their targets: the criterion of
    capacity under the SLO, and of every "best" named at a fixed load. A stream with no
    inter-token gap (every output one token) has no ITL to break."""
    itl = 0.0 if math.isnan(itl_p99_s) else itl_p99_s
    return ttft_p99_s <= slo_ttft_s and itl <= slo_itl_s


@dataclass
class PolicyResult:
    name: str
    kind: str = "rule"
    runs: list[dict] = field(default_factory=list)
    serving: tuple[str, str] | None = None
    """How an engine serves the policy (``BudgetPolicy.serving``); None for a diagnostic."""

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.runs if not (isinstance(r[key], float) and math.isnan(r[key]))]
        return float(np.mean(vals)) if vals else math.nan

    def ci95(self, key: str) -> float:
        return ci95_half([r[key] for r in self.runs])

    def slo_streams(self) -> int:
        """Streams on which p99 TTFT and p99 ITL both meet the SLO the runs were summarised
        under (:func:`meets_p99`)."""
        return sum(meets_p99(r["ttft_p99_s"], r["itl_p99_s"], r["slo_ttft_s"], r["slo_itl_s"])
                   for r in self.runs)

    @property
    def meets_slo(self) -> bool:
        """p99 TTFT and p99 ITL within their targets on every stream."""
        return bool(self.runs) and self.slo_streams() == len(self.runs)

    def summary(self) -> dict:
        out = {k: self.mean(k) for k in KEY_METRICS}
        if self.runs and PREFIX_METRICS[0] in self.runs[0]:
            out.update({k: self.mean(k) for k in PREFIX_METRICS})
        out.update({f"{k}_ci95": self.ci95(k) for k in ("goodput", "ttft_p99_s", "itl_p99_s")})
        out["seeds"] = len(self.runs)
        out["slo_streams"] = self.slo_streams()
        return out


def serving_of(policy) -> tuple[str, str] | None:
    """``policy.serving()`` (how an engine serves it), None for a bare callable."""
    serving = getattr(policy, "serving", None)
    return serving() if serving else None


def run_policy(scenario: Scenario, policy, workloads: Iterable[Workload],
               on_result: OnResult | None = None) -> PolicyResult:
    """One policy on each workload, a fresh simulator per stream."""
    slo = scenario.slo()
    res = PolicyResult(policy.name, getattr(policy, "kind", "rule"), serving=serving_of(policy))
    for i, w in enumerate(workloads):
        policy.reset()
        result = scenario.simulator(w).run(policy)
        res.runs.append(result.summary(slo))
        if on_result is not None:
            on_result(policy, i, result)
    return res


def run_policies(scenario: Scenario, policies, workloads: list[Workload],
                 on_result: OnResult | None = None) -> dict[str, PolicyResult]:
    """Each policy on each workload (the same arrivals for all), keyed by policy name."""
    return {p.name: run_policy(scenario, p, workloads, on_result) for p in policies}


def rank_key(result: PolicyResult) -> tuple[float, float, float]:
    """The one ranking at a given load: the streams on which p99 TTFT and p99 ITL meet the
    SLO first, then goodput, then the lower p99 TTFT. Goodput (vLLM bench's TTFT and TPOT
    per request) does not see p99 ITL: a budget that stalls every running user for 350 ms
    once a prompt arrives keeps its TPOT, and its goodput, under a 100 ms target."""
    return result.slo_streams(), result.mean("goodput"), -result.mean("ttft_p99_s")


def best_of(results: dict):
    """The key of the best result in ``results`` (any keys) by :func:`rank_key`."""
    return max(results, key=lambda k: rank_key(results[k]))


def static_policies(scenario: Scenario, budgets: Iterable[int] = STATIC_LADDER) -> list:
    """Static budgets a scenario's engine accepts (vLLM refuses a budget below
    max_num_seqs)."""
    return [StaticPolicy(b) for b in budgets if b >= scenario.max_num_seqs]
