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
               "itl_max_s", "tpot_p99_s", "throughput_tok_s", "smooth_share", "preemptions",
               "stall_passes", "budget_mean", "requests_finished")

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
    """A policy against a reference measured on the same streams (capacity or goodput).

    ``kind`` is "beats" or "falls short" when the 95% interval of the per-stream
    differences excludes zero, "ties" when it does not, and "not judged" on one stream,
    where there is no interval; ``matches`` says whether the policy is within
    ``MATCH_TOLERANCE`` of the reference (job 1), ``rel`` and ``half`` the mean relative
    difference and its 95% half-interval (``z`` standard errors where
    :func:`paired_verdict` was given one).
    """

    kind: str
    rel: float
    half: float

    @property
    def matches(self) -> bool:
        return self.rel >= -MATCH_TOLERANCE

    @property
    def figure(self) -> str:
        """The difference and its interval, or that one stream has none."""
        if self.kind == NOT_JUDGED:
            return f"{self.rel:+.1%}, one stream: no interval"
        return f"{self.rel:+.1%} ± {self.half:.1%}"

    @property
    def cell(self) -> str:
        """The figure and the verdict, as a report's table cell shows them in brackets."""
        return self.figure if self.kind == NOT_JUDGED else f"{self.figure}, {self.kind}"

    def __str__(self) -> str:
        return f"{self.kind} ({self.figure})"


NOT_JUDGED = "not judged"
"""A :class:`Verdict`'s kind on one stream."""


def paired_verdict(values, reference, z: float | None = None) -> Verdict:
    """Compare per-stream figures of a policy with a reference's on the same streams: the
    mean paired difference and its 95% interval (Student's t over the streams), or ``z``
    standard errors where a caller selects by a fixed threshold rather than reporting."""
    a, b = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    base = float(np.mean(b)) if len(b) else 0.0
    if not len(a) or base <= 0:
        top = float(np.mean(a)) if len(a) else 0.0
        return Verdict("beats" if top > 0 else "ties", 0.0, 0.0)
    d = (a - b) / base
    rel = float(d.mean())
    if len(d) < 2:
        return Verdict(NOT_JUDGED, rel, 0.0)
    half = ci95_half(d) if z is None else z * standard_error(d)
    if rel - half > 0:
        return Verdict("beats", rel, half)
    if rel + half < 0:
        return Verdict("falls short", rel, half)
    return Verdict("ties", rel, half)


@dataclass
class PolicyResult:
    name: str
    kind: str = "rule"
    runs: list[dict] = field(default_factory=list)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.runs if not (isinstance(r[key], float) and math.isnan(r[key]))]
        return float(np.mean(vals)) if vals else math.nan

    def ci95(self, key: str) -> float:
        return ci95_half([r[key] for r in self.runs])

    def summary(self) -> dict:
        out = {k: self.mean(k) for k in KEY_METRICS}
        out.update({f"{k}_ci95": self.ci95(k) for k in ("goodput", "ttft_p99_s", "itl_p99_s")})
        out["seeds"] = len(self.runs)
        return out


def run_policy(scenario: Scenario, policy, workloads: Iterable[Workload],
               on_result: OnResult | None = None) -> PolicyResult:
    """One policy on each workload, a fresh simulator per stream."""
    slo = scenario.slo()
    res = PolicyResult(policy.name, getattr(policy, "kind", "rule"))
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


def rank_key(result: PolicyResult) -> tuple[float, float]:
    """The one ranking of static budgets at a given load: goodput, then lower p99 TTFT."""
    return result.mean("goodput"), -result.mean("ttft_p99_s")


def best_of(results: dict):
    """The key of the best result in ``results`` (any keys) by :func:`rank_key`."""
    return max(results, key=lambda k: rank_key(results[k]))


def static_policies(scenario: Scenario, budgets: Iterable[int] = STATIC_LADDER) -> list:
    """Static budgets a scenario's engine accepts (vLLM refuses a budget below
    max_num_seqs)."""
    return [StaticPolicy(b) for b in budgets if b >= scenario.max_num_seqs]
