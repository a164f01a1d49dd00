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

from envs.deployment import HELD_OUT_DEPLOYMENTS, MADE_UP_PART, TRAINING_DEPLOYMENTS
from envs.errors import require
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
MIN_BLOCKS = 2000
"""The fewest 16-token KV blocks a condition runs with (a tight cache is cut to no less)."""
MIX_FLOOR_BLOCKS = {"long-context": 14000}
"""Mixes that need more than ``MIN_BLOCKS`` (the Mooncake sample reaches 191K tokens)."""
MAX_OVERHEAD_S = 0.005
"""Per-pass overhead is drawn uniformly from 0 to 5 ms (what real engines pay per step)."""
TIGHT_KV_SHARE = 0.3
"""Share of conditions whose KV cache is cut to a few times the largest request."""


PERTURB = 1.5
"""A training condition's bandwidth and FLOP/s are each its preset's times a factor drawn
log-uniformly in [1/PERTURB, PERTURB]: the policy learns the map from a deployment's cost
model to behaviour, not a list of presets."""


def perturbed(hardware: str, rng) -> str:
    """``hardware`` with its bandwidth and FLOP/s scaled by factors drawn in [1/PERTURB,
    PERTURB] (log-uniform), as a spec (``envs.profiles.get_hardware``'s ``@``)."""
    hw = get_hardware(hardware)
    bw, flops = np.exp(rng.uniform(-np.log(PERTURB), np.log(PERTURB), size=2))
    return (f"{hardware}@hbm_bytes_per_s={hw.hbm_bytes_per_s * bw:.4g},"
            f"peak_flops_per_s={hw.peak_flops_per_s * flops:.4g}")


HELD_OUT_PARTS = ("h200", "l40s")
"""Hardware presets held out with every model (besides the made-up part)."""
SAME_FIGURES = 0.01
"""Relative tolerance within which two parts' bandwidth and FLOP/s are the same part."""


def held_out(hardware: str, model: str) -> bool:
    """Whether a deployment (a hardware preset, spec or profile, perturbed or not, and a
    model) is held out: a held-out preset, the made-up part however it is written (its
    figures, not its spelling), or a held-out (hardware, model) pair, whatever its variant."""
    base = str(hardware).partition("@")[0]
    if base in HELD_OUT_PARTS or any(base == h and model == m for h, m in HELD_OUT_DEPLOYMENTS):
        return True
    hw, made_up = get_hardware(hardware), get_hardware(MADE_UP_PART)
    return all(abs(getattr(hw, f) - getattr(made_up, f)) <= SAME_FIGURES * getattr(made_up, f)
               for f in ("hbm_bytes_per_s", "peak_flops_per_s"))


def trained(hardware: str, model: str) -> bool:
    """Whether a deployment is one ``train.py --all-deployments`` trains on (a variant of a
    training preset with its model)."""
    return (str(hardware).partition("@")[0], model) in TRAINING_DEPLOYMENTS and not held_out(hardware, model)


def slo_pairs(hardware: str) -> tuple[tuple[float, float], ...]:
    return LAPTOP_SLOS if get_hardware(hardware).per_pass_overhead_s > 0.01 else DATACENTER_SLOS


def draw_conditions(base: Scenario, count: int, seed: int,
                    deployments: tuple[tuple[str, str], ...] | None = None) -> list[dict]:
    """``count`` conditions (Scenario fields) for ``base``'s hardware and model, drawn from
    the product of mixes, arrivals, overheads, KV capacities and SLO pairs. With
    ``deployments`` ((hardware, model) pairs), each condition first draws one of them and
    a variant of its hardware (:func:`perturbed`), and records both."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if deployments is None:
            out.append(_draw(rng, base))
            continue
        hardware, model = deployments[int(rng.integers(len(deployments)))]
        hardware = perturbed(hardware, rng)
        out.append({"hardware": hardware, "model": model,
                    **_draw(rng, base.with_fields(hardware=hardware, model=model))})
    return out


def _draw(rng, base: Scenario) -> dict:
    """One condition for ``base``'s hardware and model."""
    pairs = slo_pairs(base.hardware)
    device_blocks = base.engine_config().kv_blocks(base.hardware_profile(), base.model_profile())
    # A mix whose longest request the cache cannot hold at all is left out (a 32B model's
    # 47K tokens on an 80 GB part, against the Mooncake sample's 191K-token prompts).
    mixes = [m for m in MIXES if device_blocks >= MIX_FLOOR_BLOCKS.get(m, MIN_BLOCKS)]
    require(bool(mixes), "hardware", base.hardware, f"with {base.model} holds {device_blocks} KV "
            f"blocks, fewer than any mix needs ({MIN_BLOCKS})")
    mix = mixes[int(rng.integers(len(mixes)))]
    arrival = list(ARRIVALS)[int(rng.integers(len(ARRIVALS)))]
    ttft, itl = pairs[int(rng.integers(len(pairs)))]
    cond = {**MIXES[mix], **ARRIVALS[arrival], "slo_ttft_s": ttft, "slo_itl_s": itl}
    if base.hardware_profile().per_pass_overhead_s == 0:
        cond["per_pass_overhead_s"] = round(float(rng.uniform(0, MAX_OVERHEAD_S)), 5)
    if rng.random() < TIGHT_KV_SHARE:
        # Tight: 8-40% of the device's cache, never below what the longest prompt of
        # the mix needs (the Mooncake sample reaches 191K tokens).
        floor = MIX_FLOOR_BLOCKS.get(mix, MIN_BLOCKS)
        cond["num_kv_blocks"] = int(min(max(floor, device_blocks * rng.uniform(0.08, 0.4)),
                                        device_blocks))
    return cond


MIN_CAPACITY_RPS = 0.1
"""Conditions no deployment would run (an SLO the mix cannot meet at a useful load) are
dropped: below this capacity the budget hardly matters."""


def condition_sweeps(base: Scenario, conditions: list[dict], policies, seeds: int = 2,
                     num_requests: int = 200, starts: list[float] | None = None, executor=None,
                     progress=None) -> list[list]:
    """For each condition (Scenario fields, with or without ``capacity_rps``), in order, the
    capacity results (``eval.capacity.CapacityResult``) under its own SLO of the policies
    ``policies(scenario)`` makes for its scenario, each over ``seeds`` streams lasting at
    least ten TTFT targets; ``starts``: each condition's first load factor (a hint)."""
    found: dict[int, list] = {}
    for slo_ttft in sorted({c["slo_ttft_s"] for c in conditions}):
        group = [i for i, c in enumerate(conditions) if c["slo_ttft_s"] == slo_ttft]
        pairs, hints, widths = [], [], []
        for i in group:
            sc = base.with_fields(**{k: v for k, v in conditions[i].items() if k != "capacity_rps"})
            made = policies(sc)
            pairs += [(sc, p) for p in made]
            hints += [[starts[i]] * seeds if starts else None] * len(made)
            widths.append(len(made))
        results = capacity_sweep(pairs, seeds, num_requests, executor=executor, progress=progress,
                                 starts=hints if starts else None, min_duration_s=10 * slo_ttft)
        at = 0
        for i, w in zip(group, widths):
            found[i], at = results[at:at + w], at + w
    return [found[i] for i in range(len(conditions))]


def with_capacities(base: Scenario, conditions: list[dict], seeds: int = 2, num_requests: int = 200,
                    executor=None, progress=None) -> list[dict]:
    """Each condition with its ``capacity_rps`` under its own SLO (the time-budget rule's,
    mean over ``seeds`` streams, each lasting at least ten TTFT targets), ordered by TTFT
    target; conditions with less than ``MIN_CAPACITY_RPS`` are dropped."""
    found = condition_sweeps(base, conditions, lambda sc: [TimeBudgetPolicy(sc.slo_itl_s).limit_pass(sc)],
                             seeds, num_requests, executor=executor, progress=progress)
    order = sorted(range(len(conditions)), key=lambda i: conditions[i]["slo_ttft_s"])
    return [{**conditions[i], "capacity_rps": round(found[i][0].capacity, 4)} for i in order
            if found[i][0].capacity >= MIN_CAPACITY_RPS]
