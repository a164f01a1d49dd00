"""How each training episode's scenario and arrivals are drawn (domain randomisation).

Pure (numpy only): the Gymnasium environment calls :func:`draw_episode` with its own
``np_random``; anything else can draw the same episodes from the same generator.

Training should happen where the choice of budget matters: below, near and beyond
capacity. An episode therefore draws a *condition* (a set of Scenario fields: workload
mix, arrival process, per-pass overhead, KV capacity, SLO pair), each carrying its
capacity under the SLO (``capacity_rps``, measured beforehand), and loads it at a
factor of that capacity drawn from ``load_range``.
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

    Synthetic scenarios draw a stream at a rate: a condition's ``capacity_rps`` (or the
    scenario's own rate when conditions do not carry one) times a factor uniform in
    ``load_range``, lasting ``episode_s`` seconds (within ``min_requests`` and
    ``max_requests``) or, without ``episode_s``, ``episode_requests`` requests. Trace
    scenarios replay a random window of ``window_s`` seconds from the part of the trace
    between the fractions ``trace_span`` (keep evaluation windows outside it), sped up
    by a factor in ``load_range``.
    """

    load_range: tuple[float, float] = (0.6, 1.2)
    episode_requests: int = 300
    episode_s: float | None = None
    min_requests: int = 50
    max_requests: int = 2000
    window_s: float = 120.0
    trace_span: tuple[float, float] = (0.0, 0.8)
    conditions: tuple[dict, ...] = ()
    """Scenario fields of each condition (plus its ``capacity_rps``), drawn uniformly."""
    stream_seed_base: int = 0
    """Synthetic streams are seeded from this up (training: 0, below EVAL_SEED_BASE;
    evaluation episodes: EVAL_SEED_BASE, so they never replay a training stream)."""
    slo_ttft_range: tuple[float, float] | None = None
    """When set, each episode draws its TTFT target log-uniformly from this range."""
    slo_itl_range: tuple[float, float] | None = None
    """When set, each episode draws its ITL target log-uniformly from this range."""
    overhead_range_s: tuple[float, float] | None = None
    """When set, each episode's per-pass overhead is drawn uniformly from this range."""
    kv_blocks_range: tuple[int, int] | None = None
    """When set, each episode's KV capacity (16-token blocks) is drawn log-uniformly from it."""


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def draw_scenario(rng: np.random.Generator, sampler: EpisodeSampler,
                  scenario: Scenario) -> tuple[Scenario, float]:
    """(the episode's scenario as randomised, the rate its load factor multiplies)."""
    s, sc = sampler, scenario
    base_rate = sc.rate
    if s.conditions:
        cond = dict(s.conditions[int(rng.integers(len(s.conditions)))])
        base_rate = float(cond.pop("capacity_rps", sc.rate))
        sc = replace(sc, **cond)
    if s.slo_ttft_range:
        sc = replace(sc, slo_ttft_s=_log_uniform(rng, *s.slo_ttft_range))
    if s.slo_itl_range:
        sc = replace(sc, slo_itl_s=_log_uniform(rng, *s.slo_itl_range))
    if s.overhead_range_s:
        sc = replace(sc, per_pass_overhead_s=float(rng.uniform(*s.overhead_range_s)))
    if s.kv_blocks_range:
        sc = replace(sc, num_kv_blocks=int(_log_uniform(rng, *s.kv_blocks_range)))
    return sc, base_rate


def draw_episode(rng: np.random.Generator, sampler: EpisodeSampler, scenario: Scenario,
                 trace: Workload | None = None,
                 fixed: Workload | None = None) -> tuple[Scenario, Workload]:
    """(the episode's scenario, its arrivals): ``fixed`` arrivals as they are, a random
    window of ``trace``, or a synthetic stream of the scenario's workload."""
    sc, base_rate = draw_scenario(rng, sampler, scenario)
    if fixed is not None:
        return sc, fixed
    factor = float(rng.uniform(*sampler.load_range))
    if trace is not None:
        span_lo, span_hi = (f * trace.duration_s for f in sampler.trace_span)
        start = float(rng.uniform(span_lo, max(span_lo, span_hi - sampler.window_s)))
        w = trace.window(start, start + sampler.window_s)
        if len(w) == 0:
            w = trace.window(span_lo, None).head(1)
        return sc, w.scaled(factor)
    rate = base_rate * factor
    n = sampler.episode_requests
    if sampler.episode_s:
        n = int(min(max(rate * sampler.episode_s, sampler.min_requests), sampler.max_requests))
    sc = replace(sc, rate=rate, num_requests=n)
    # Training streams use seeds below EVAL_SEED_BASE; evaluation uses seeds from it up.
    return sc, sc.synthetic_spec().build(sampler.stream_seed_base + int(rng.integers(EVAL_SEED_BASE)))


def draw_episodes(base: Scenario, sampler: EpisodeSampler, count: int, seed: int):
    """``count`` episodes (scenario, arrivals) of ``sampler``'s distribution, episode ``i``
    drawn from a generator seeded ``seed + i``."""
    return [draw_episode(np.random.default_rng(seed + i), sampler, base) for i in range(count)]
