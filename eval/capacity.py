"""Capacity under an SLO: the highest request rate at which p99 TTFT and p99 ITL both
meet their targets, found by bisection on the arrival rate (how Sarathi-Serve and
DistServe report capacity).

A synthetic scenario scales its ``rate``; a trace scenario scales its ``rate_scale``.
Each probe runs every seed's stream at that rate (same seeds for every policy) and
takes the mean p99s over seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from envs.scenario import Scenario
from envs.seeds import CAPACITY_SEEDS
from eval.harness import run_policy


@dataclass(frozen=True)
class CapacityResult:
    policy: str
    capacity: float
    """Highest load meeting the SLO, in requests/s (0 when even the lowest probe fails)."""
    unit: str
    probes: tuple[tuple[float, float, float], ...]
    """(load, mean p99 TTFT, mean p99 ITL) of every probe, in the order run."""


def probe_workloads(scenario: Scenario, load: float, seeds: int, num_requests: int):
    """(the scenario at ``load``, its streams): a trace sped up to ``load`` (one stream),
    or ``seeds`` synthetic streams at ``load`` requests per second."""
    if scenario.trace:
        sc = scenario.with_fields(rate_scale=load)
        w = sc.workload()
        return sc, [w.head(num_requests) if num_requests else w]
    sc = scenario.with_fields(rate=load, num_requests=num_requests or scenario.num_requests)
    return sc, [sc.workload(CAPACITY_SEEDS + i) for i in range(seeds)]


def _meets(scenario: Scenario, policy, load: float, seeds: int, num_requests: int):
    slo = scenario.slo()
    sc, workloads = probe_workloads(scenario, load, seeds, num_requests)
    runs = run_policy(sc, policy, workloads).runs
    ttft = [s["ttft_p99_s"] for s in runs]
    itl = [s["itl_p99_s"] for s in runs]
    t, it = float(np.mean(ttft)), float(np.nanmean(itl)) if not all(map(math.isnan, itl)) else 0.0
    return t <= slo.ttft_s and it <= slo.itl_s, t, it


def capacity(scenario: Scenario, policy, seeds: int = 2, num_requests: int = 600,
             rel_tol: float = 0.02, max_probes: int = 16) -> CapacityResult:
    """Bisection between a load that meets the SLO and one that does not."""
    base = scenario.rate_scale if scenario.trace else scenario.rate
    probes = []

    def probe(load):
        ok, t, it = _meets(scenario, policy, load, seeds, num_requests)
        probes.append((load, t, it))
        return ok

    lo, hi = None, None
    load = base
    for _ in range(8):  # bracket: halve until it meets, double until it fails
        if probe(load):
            lo = load
            if hi is not None:
                break
            load *= 2
        else:
            hi = load
            if lo is not None:
                break
            load /= 2
    if lo is None:
        lo = 0.0
    if hi is None:
        hi = lo
    while hi - lo > rel_tol * max(hi, 1e-9) and len(probes) < max_probes and lo > 0:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    if scenario.trace:
        full = scenario.workload()
        rps = lo * full.mean_rate if len(full) > 1 else 0.0
        unit = "req/s"
        return CapacityResult(policy.name, rps, unit, tuple(probes))
    return CapacityResult(policy.name, lo, "req/s", tuple(probes))
