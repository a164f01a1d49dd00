"""Run policies on identical arrivals and aggregate their metrics over seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from envs.chunk_budget_env import EVAL_SEED_BASE
from envs.scenario import Scenario
from envs.workload import Workload, load_trace

# Figures averaged over seeds in comparisons.
KEY_METRICS = ("goodput", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
               "itl_max_s", "tpot_p99_s", "throughput_tok_s", "smooth_share", "preemptions",
               "stall_passes", "budget_mean", "requests_finished")


def evaluation_workloads(scenario: Scenario, seeds: int, num_requests: int | None = None,
                         eval_span: tuple[float, float] | None = (0.8, 1.0)) -> list[Workload]:
    """Arrivals no training episode saw: synthetic streams seeded from EVAL_SEED_BASE up
    (training draws seeds below it), or for a trace the part after the training span (the
    last 20% by default; ``eval_span=None`` replays the scenario's own window as given)."""
    if scenario.trace:
        if eval_span is None:
            w = scenario.workload()
        else:
            full = load_trace(scenario.trace, scenario.rate_scale, scenario.window_start_s,
                              scenario.window_end_s)
            lo, hi = (f * full.duration_s for f in eval_span)
            w = full.window(lo, hi if eval_span[1] < 1.0 else None)
        return [w.head(num_requests) if num_requests else w]
    base = scenario if num_requests is None else scenario.with_fields(num_requests=num_requests)
    return [base.workload(EVAL_SEED_BASE + i) for i in range(seeds)]


MATCH_TOLERANCE = 0.01  # "matches the best static budget": within 1% of its goodput


def against_best(goodput: float, best_goodput: float) -> tuple[str, float]:
    """DESIGN.md section 5's two jobs: ("beats" | "matches" | "short", relative difference)
    of a policy's goodput against the best static budget's."""
    rel = (goodput - best_goodput) / best_goodput if best_goodput > 0 else 0.0
    if rel >= MATCH_TOLERANCE:
        return "beats", rel
    if rel >= -MATCH_TOLERANCE:
        return "matches", rel
    return "short", rel


@dataclass
class PolicyResult:
    name: str
    runs: list[dict] = field(default_factory=list)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.runs if not (isinstance(r[key], float) and math.isnan(r[key]))]
        return float(np.mean(vals)) if vals else math.nan

    def ci95(self, key: str) -> float:
        vals = [r[key] for r in self.runs]
        if len(vals) < 2:
            return 0.0
        return float(1.96 * np.std(vals, ddof=1) / math.sqrt(len(vals)))

    def summary(self) -> dict:
        out = {k: self.mean(k) for k in KEY_METRICS}
        out.update({f"{k}_ci95": self.ci95(k) for k in ("goodput", "ttft_p99_s", "itl_p99_s")})
        out["seeds"] = len(self.runs)
        return out


def run_policies(scenario: Scenario, policies, workloads: list[Workload]) -> dict[str, PolicyResult]:
    """Each policy on each workload (the same arrivals for all)."""
    slo = scenario.slo()
    results: dict[str, PolicyResult] = {}
    for policy in policies:
        res = PolicyResult(policy.name)
        for w in workloads:
            policy.reset()
            res.runs.append(scenario.simulator(w).run(policy).summary(slo))
        results[policy.name] = res
    return results
