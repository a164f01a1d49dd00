"""The conditions a budget policy trains under, and their capacities.

One policy per (hardware, model) must hold up across every condition a deployment
meets: short and long prompts, bursts, per-pass overheads, tight or ample KV caches,
strict or loose SLOs. :func:`draw_conditions` samples such conditions (Scenario fields)
from the product of the axes below; :func:`with_capacities` measures each one's
capacity under its SLO with the time-budget rule, so that training episodes can load
each condition from below to beyond the point where the budget decides the outcome.
"""

from __future__ import annotations

import numpy as np

from envs.profiles import get_hardware
from envs.scenario import Scenario
from eval.capacity import capacity_sweep
from policies.baselines import TimeBudgetPolicy

MIXES = {
    # DESIGN.md's mix: 70% short prompts, 30% 4K-16K.
    "short-long": dict(prompt="short-long", output="lognormal:128:0.8:1024"),
    # Lengths of the Azure LLM conversation trace (2023).
    "conversation": dict(prompt="empirical:azure_conv_2023",
                         output="empirical:azure_conv_2023:output_tokens"),
    # Long contexts: the Mooncake sample's prompts (1K to 100K+ tokens).
    "long-context": dict(prompt="empirical:mooncake_synthetic",
                         output="empirical:mooncake_synthetic:output_tokens"),
    # DESIGN.md's worked example as a stream: 2.3K-token conversations, an 8K prompt in ten.
    "worked-example": dict(prompt="mix:0.9*fixed:2304+0.1*fixed:8192",
                           output="lognormal:256:0.5:1024"),
}
ARRIVALS = {
    "poisson": dict(arrival="poisson"),
    "bursty": dict(arrival="gamma", burstiness=0.5),
    "onoff": dict(arrival="onoff", on_s=10.0, off_s=10.0),
}
# (TTFT, ITL) targets, seconds: DESIGN.md's three pairs, and the looser pairs a laptop
# part or a long-context service needs.
DATACENTER_SLOS = ((2.0, 0.1), (1.0, 0.05), (0.5, 0.03), (10.0, 0.2), (30.0, 0.1))
LAPTOP_SLOS = ((10.0, 0.2), (5.0, 0.15), (20.0, 0.3))
MAX_OVERHEAD_S = 0.005
"""Per-pass overhead is drawn uniformly from 0 to 5 ms (what real engines pay per step)."""
TIGHT_KV_SHARE = 0.3
"""Share of conditions whose KV cache is cut to a few times the largest request."""


def slo_pairs(hardware: str) -> tuple[tuple[float, float], ...]:
    return LAPTOP_SLOS if get_hardware(hardware).per_pass_overhead_s > 0.01 else DATACENTER_SLOS


def draw_conditions(base: Scenario, count: int, seed: int) -> list[dict]:
    """``count`` conditions (Scenario fields) for ``base``'s hardware and model, drawn from
    the product of mixes, arrivals, overheads, KV capacities and SLO pairs."""
    rng = np.random.default_rng(seed)
    pairs = slo_pairs(base.hardware)
    device_blocks = base.engine_config().kv_blocks(base.hardware_profile(), base.model_profile())
    out = []
    for _ in range(count):
        mix = list(MIXES)[int(rng.integers(len(MIXES)))]
        arrival = list(ARRIVALS)[int(rng.integers(len(ARRIVALS)))]
        ttft, itl = pairs[int(rng.integers(len(pairs)))]
        cond = {**MIXES[mix], **ARRIVALS[arrival], "slo_ttft_s": ttft, "slo_itl_s": itl}
        if base.hardware_profile().per_pass_overhead_s == 0:
            cond["per_pass_overhead_s"] = round(float(rng.uniform(0, MAX_OVERHEAD_S)), 5)
        if rng.random() < TIGHT_KV_SHARE:
            # Tight: 8-40% of the device's cache, never below what the longest prompt of
            # the mix needs (the Mooncake sample reaches 191K tokens).
            floor = 14000 if mix == "long-context" else 2000
            cond["num_kv_blocks"] = int(max(floor, device_blocks * rng.uniform(0.08, 0.4)))
        out.append(cond)
    return out


MIN_CAPACITY_RPS = 0.1
"""Conditions no deployment would run (an SLO the mix cannot meet at a useful load) are
dropped: below this capacity the budget hardly matters."""


def with_capacities(base: Scenario, conditions: list[dict], seeds: int = 2, num_requests: int = 200,
                    executor=None, progress=None) -> list[dict]:
    """Each condition with its ``capacity_rps`` under its own SLO (the time-budget rule's,
    mean over ``seeds`` streams, each lasting at least ten TTFT targets); conditions with
    less than ``MIN_CAPACITY_RPS`` are dropped."""
    out = []
    for slo_ttft in sorted({c["slo_ttft_s"] for c in conditions}):
        group = [c for c in conditions if c["slo_ttft_s"] == slo_ttft]
        pairs = [(sc, TimeBudgetPolicy(sc.slo_itl_s).limit_pass(sc))  # under the run's cap
                 for sc in (base.with_fields(**c) for c in group)]
        found = capacity_sweep(pairs, seeds, num_requests, executor=executor, progress=progress,
                               min_duration_s=10 * slo_ttft)
        out += [{**c, "capacity_rps": round(r.capacity, 4)} for c, r in zip(group, found)
                if r.capacity >= MIN_CAPACITY_RPS]
    return out
