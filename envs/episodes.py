"""How each training episode's scenario and arrivals are drawn (domain randomisation).

Pure (numpy only): the Gymnasium environment calls :func:`draw_episode` with its own
``np_random``; anything else can draw the same episodes from the same generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from envs.scenario import Scenario
from envs.seeds import EVAL_SEED_BASE
from envs.workload import Workload


@dataclass(frozen=True)
class EpisodeSampler:
    """How each episode's arrivals are drawn.

    Synthetic scenarios draw ``episode_requests`` requests at the scenario's rate
    times a factor uniform in ``rate_range``; trace scenarios replay a random window
    of ``window_s`` seconds from the part of the trace between the fractions
    ``trace_span`` (keep evaluation windows outside it), sped up by a factor in
    ``rate_range``.
    """

    rate_range: tuple[float, float] = (0.6, 1.2)
    episode_requests: int = 300
    window_s: float = 120.0
    trace_span: tuple[float, float] = (0.0, 0.8)
    slo_ttft_range: tuple[float, float] | None = None
    """When set, each episode draws its TTFT target log-uniformly from this range."""
    slo_itl_range: tuple[float, float] | None = None
    """When set, each episode draws its ITL target log-uniformly from this range."""
    hardware_choices: tuple[str, ...] = ()
    """When set, each episode runs on one of these hardware presets."""
    overhead_range_s: tuple[float, float] | None = None
    """When set, each episode's per-pass overhead is drawn uniformly from this range."""
    kv_blocks_range: tuple[int, int] | None = None
    """When set, each episode's KV capacity (16-token blocks) is drawn log-uniformly from it."""


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def draw_scenario(rng: np.random.Generator, sampler: EpisodeSampler, scenario: Scenario) -> Scenario:
    """The episode's scenario: SLO, hardware, overhead and KV capacity as randomised."""
    s, sc = sampler, scenario
    if s.slo_ttft_range:
        sc = replace(sc, slo_ttft_s=_log_uniform(rng, *s.slo_ttft_range))
    if s.slo_itl_range:
        sc = replace(sc, slo_itl_s=_log_uniform(rng, *s.slo_itl_range))
    if s.hardware_choices:
        sc = replace(sc, hardware=str(rng.choice(list(s.hardware_choices))))
    if s.overhead_range_s:
        sc = replace(sc, per_pass_overhead_s=float(rng.uniform(*s.overhead_range_s)))
    if s.kv_blocks_range:
        sc = replace(sc, num_kv_blocks=int(_log_uniform(rng, *s.kv_blocks_range)))
    return sc


def draw_episode(rng: np.random.Generator, sampler: EpisodeSampler, scenario: Scenario,
                 trace: Workload | None = None,
                 fixed: Workload | None = None) -> tuple[Scenario, Workload]:
    """(the episode's scenario, its arrivals): ``fixed`` arrivals as they are, a random
    window of ``trace``, or a synthetic stream of the scenario's workload."""
    sc = draw_scenario(rng, sampler, scenario)
    if fixed is not None:
        return sc, fixed
    factor = float(rng.uniform(*sampler.rate_range))
    if trace is not None:
        span_lo, span_hi = (f * trace.duration_s for f in sampler.trace_span)
        start = float(rng.uniform(span_lo, max(span_lo, span_hi - sampler.window_s)))
        w = trace.window(start, start + sampler.window_s)
        if len(w) == 0:
            w = trace.window(span_lo, None).head(1)
        return sc, w.scaled(factor)
    spec = replace(sc.synthetic_spec(), rate=sc.rate * factor, num_requests=sampler.episode_requests)
    # Training streams use seeds below EVAL_SEED_BASE; evaluation uses seeds from it up.
    return sc, spec.build(int(rng.integers(EVAL_SEED_BASE)))
