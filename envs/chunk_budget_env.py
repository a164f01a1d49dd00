"""Gymnasium environment: choose the token budget of each scheduler pass.

A thin adapter over :class:`envs.engine.Simulator`; it owns no physics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.cost import free_ride_root
from envs.engine import Simulator
from envs.errors import ConfigError, require
from envs.metrics import SLO
from envs.scenario import Scenario, named_workload
from envs.workload import Workload, load_trace

DEFAULT_LADDER = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
EVAL_SEED_BASE = 2**30

OBSERVATION_FIELDS = (
    "waiting_requests", "waiting_prefill_tokens", "running_decodes", "kv_usage",
    "oldest_wait_vs_ttft", "last_pass_vs_itl", "free_ride_tokens", "head_prefilled_share",
    "head_remaining_tokens", "decode_context_mean", "slo_ttft", "slo_itl",
)


_INV_LOG_512 = 1 / math.log1p(512)
_INV_LOG_16K = 1 / math.log1p(16384)
_INV_LOG_128K = 1 / math.log1p(131072)


def budget_from_action(action, ladder: Sequence[int], action_type: str = "discrete") -> int:
    """Tokens for an action: a ladder index, or a value in [-1, 1] mapped linearly to
    log2 of the budget between the ladder's ends."""
    if action_type == "discrete":
        if isinstance(action, (int, np.integer)):  # the common case, without numpy overhead
            return ladder[int(action)]
        return ladder[int(np.asarray(action).reshape(-1)[0])]
    a = float(np.clip(np.asarray(action, dtype=np.float64).reshape(-1)[0], -1.0, 1.0))
    lo, hi = math.log2(ladder[0]), math.log2(ladder[-1])
    return int(round(2 ** (lo + (a + 1) / 2 * (hi - lo))))


def _log_scale(x: float, top: float) -> float:
    """log1p(x) / log1p(top), clipped to [0, 1]."""
    v = math.log1p(x) / math.log1p(top) if x > 0 else 0.0
    return v if v < 1.0 else 1.0


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the per-step reward's three charges (see the env docstring)."""

    ttft_miss: float = 1.0
    """Per request whose wait crosses the TTFT target without a first token."""
    ttft_wait: float = 0.05
    """Per TTFT-target's worth of waiting accrued by requests without a first token."""
    itl_excess: float = 1.0
    """Per mean-output-length's worth of decode tokens, times each one's excess gap over
    the ITL target in units of that target."""


@dataclass(frozen=True)
class EpisodeSampler:
    """How each episode's arrivals are drawn (domain randomisation).

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


class ChunkBudgetEnv(gym.Env):
    """Pick the token budget of every scheduler pass that has prefill work to place.

    ## Description

    A continuous-batching LLM server (vLLM V1 semantics, roofline-priced passes) serves
    a stream of requests. Running decodes always get one token each; the budget decides
    how many prompt tokens ride along in the same pass. Small budgets keep the running
    users' inter-token latency (ITL) low and delay new prompts' first token (TTFT);
    large budgets do the opposite.

    **One step is one pass that has a decision to make**: passes with no prefill work
    waiting are simulated inside the step (their ITL and rewards are accounted), so an
    episode is not padded with decisions that change nothing.

    ## Action Space

    ``Discrete(len(budgets))``: index into a log-spaced ladder of budgets (default
    64 ... 16,384). With ``action_type="continuous"``, ``Box(-1, 1, (1,))`` maps
    linearly to log2 of the budget between the ladder's ends. The budget applied is
    never below the running decodes (each must get its token); ``info["budget_applied"]``
    and ``info["budget_clipped"]`` say what was used.

    ## Observation Space

    ``Box(0, 1, (12,), float32)``, every entry scaled to [0, 1] and clipped:

    | idx | observation | scaling |
    |-----|-------------|---------|
    | 0 | waiting requests (vLLM ``num_requests_waiting``) | log1p(x)/log1p(512) |
    | 1 | prompt tokens still to prefill, waiting + partial | log1p(x)/log1p(131072) |
    | 2 | running decodes | x / max_num_seqs |
    | 3 | KV-cache usage (vLLM ``kv_cache_usage_perc``) | fraction |
    | 4 | oldest waiting request's age | age / TTFT target / 4 |
    | 5 | last pass's duration | duration / ITL target / 4 |
    | 6 | free-ride capacity of this pass, tokens | log1p(x)/log1p(16384) |
    | 7 | share of the head request's prompt already prefilled | fraction |
    | 8 | head request's prompt tokens still to prefill | log1p(x)/log1p(131072) |
    | 9 | mean decode context, tokens | log1p(x)/log1p(131072) |
    | 10 | TTFT target | log1p(s)/log1p(30) |
    | 11 | ITL target | log1p(1000 s)/log1p(1000) |

    All of them are cheap for a real engine to read each pass (counts, KV usage, the
    head request's computed tokens, running requests' context lengths).

    ## Rewards

    The episode's objective is goodput under an SLO pair (TTFT target, ITL target),
    i.e. few requests late for their first token and few slow tokens. p99 and
    per-request TPOT are episode statistics, so the reward charges, per step, what the
    passes it covered cost:

    - ``ttft_miss``: -1 for each request whose wait crosses the TTFT target without a
      first token (charged when the deadline passes, so the charge lands on the steps
      that caused it, not on the one that finally serves the request);
    - ``ttft_wait``: -(waiting time accrued by requests without a first token) / TTFT
      target; summed over an episode this is total TTFT / target (Little's law), a dense
      signal towards throughput;
    - ``itl_excess``: -sum over decode tokens of max(0, gap - ITL target) / ITL target,
      divided by the episode's mean output length; a request all of whose gaps are
      twice the target costs about 1, like a TTFT miss, and tokens inside the target
      cost nothing.

    The weights are ``RewardWeights``; ``info`` carries each charge.

    ## Starting State

    An idle engine; the first request of a freshly drawn stream arrives at time 0.
    Episode streams are drawn from ``self.np_random`` (rate randomised per episode).

    ## Episode End

    - Termination: every request of the episode's stream has finished.
    - Truncation: ``max_episode_steps`` decisions (``register``; default 4096).

    When an episode terminates, ``info["episode_metrics"]`` holds its TTFT p50/p99, ITL
    p99/max, goodput, and the budgets applied (each decision's, and their mean).

    ## Arguments

    ``gymnasium.make("chunkpilot/ChunkBudget-v0", hardware="h100-sxm",
    model="llama-3-8b", workload="mixed-bursty", slo=(2.0, 0.1), budgets=DEFAULT_LADDER,
    action_type="discrete", sampler=EpisodeSampler(), reward=RewardWeights(),
    scenario=None)``. ``workload`` is a name from ``envs.scenario.WORKLOADS``, a trace
    name or path, a dict of Scenario fields, or a fixed :class:`Workload` (replayed
    as is every episode). ``scenario`` (a :class:`Scenario`) replaces hardware, model,
    workload and SLO at once.

    ## Version History

    - v0: initial version.
    """

    metadata = {"render_modes": []}

    def __init__(self, hardware: str = "h100-sxm", model: str = "llama-3-8b",
                 workload: str | dict | Workload = "mixed-bursty",
                 slo: tuple[float, float] | SLO | None = None,
                 budgets: Sequence[int] = DEFAULT_LADDER, action_type: str = "discrete",
                 sampler: EpisodeSampler | None = None, reward: RewardWeights | None = None,
                 scenario: Scenario | None = None):
        super().__init__()
        self.fixed_workload: Workload | None = None
        if scenario is None:
            scenario = Scenario(hardware=hardware, model=model)
            if isinstance(workload, Workload):
                self.fixed_workload = workload
            elif isinstance(workload, dict):
                scenario = replace(scenario, **workload)
            elif isinstance(workload, str):
                try:
                    scenario = replace(scenario, **named_workload(workload))
                except ConfigError:
                    load_trace(workload)  # raises a clear error if it is not a trace either
                    scenario = replace(scenario, trace=workload)
            else:
                raise ConfigError(f"workload: got {type(workload).__name__}, must be a name, "
                                  "a trace, a dict of Scenario fields or a Workload")
            if slo is not None:
                s = slo if isinstance(slo, SLO) else SLO(*slo)
                scenario = replace(scenario, slo_ttft_s=s.ttft_s, slo_itl_s=s.itl_s)
        self.scenario = scenario
        scenario.slo()  # validate
        self.budgets = tuple(int(b) for b in budgets)
        require(len(self.budgets) >= 2 and all(b >= 1 for b in self.budgets)
                and list(self.budgets) == sorted(set(self.budgets)), "budgets", self.budgets,
                "must be at least two distinct positive integers in increasing order")
        require(action_type in ("discrete", "continuous"), "action_type", action_type,
                "must be 'discrete' or 'continuous'")
        self.action_type = action_type
        self.sampler = sampler or EpisodeSampler()
        self.weights = reward or RewardWeights()
        if action_type == "discrete":
            self.action_space = spaces.Discrete(len(self.budgets))
        else:
            self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(OBSERVATION_FIELDS),),
                                            dtype=np.float32)
        self._trace: Workload | None = None
        if scenario.trace and self.fixed_workload is None:
            self._trace = load_trace(scenario.trace, scenario.rate_scale, scenario.window_start_s,
                                     scenario.window_end_s, scenario.max_requests)
        self.sim: Simulator | None = None

    # --- episode streams ---------------------------------------------------------------

    def _draw_episode(self) -> tuple[Scenario, Workload]:
        rng = self.np_random
        s = self.sampler
        sc = self.scenario
        if s.slo_ttft_range:
            lo, hi = s.slo_ttft_range
            sc = replace(sc, slo_ttft_s=float(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if s.slo_itl_range:
            lo, hi = s.slo_itl_range
            sc = replace(sc, slo_itl_s=float(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if s.hardware_choices:
            sc = replace(sc, hardware=str(rng.choice(list(s.hardware_choices))))
        if s.overhead_range_s:
            sc = replace(sc, per_pass_overhead_s=float(rng.uniform(*s.overhead_range_s)))
        if s.kv_blocks_range:
            lo, hi = s.kv_blocks_range
            sc = replace(sc, num_kv_blocks=int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if self.fixed_workload is not None:
            return sc, self.fixed_workload
        factor = float(rng.uniform(*s.rate_range))
        if self._trace is not None:
            t = self._trace
            span_lo, span_hi = (f * t.duration_s for f in s.trace_span)
            start = float(rng.uniform(span_lo, max(span_lo, span_hi - s.window_s)))
            w = t.window(start, start + s.window_s)
            if len(w) == 0:
                w = t.window(span_lo, None).head(1)
            return sc, w.scaled(factor)
        spec = replace(sc.synthetic_spec(), rate=sc.rate * factor, num_requests=s.episode_requests)
        # Training streams use seeds below 2**30; evaluation uses seeds from 2**30 up
        # (EVAL_SEED_BASE), so the two never share arrivals.
        return sc, spec.build(int(rng.integers(EVAL_SEED_BASE)))

    # --- gymnasium API ---------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        sc, workload = self._draw_episode()
        self.episode_scenario = sc
        self.sim = sc.simulator(workload)
        self._slo = sc.slo()
        self._mean_output = float(workload.output_tokens.mean())
        self.meter = RewardMeter(self.sim, self._slo, self._mean_output, self.weights)
        self._budgets: list[int] = []
        self._steps = 0
        self._slo_obs = slo_features(self._slo)
        self._done = not self.sim.advance()
        return self._observe(), {}

    def budget_for(self, action) -> int:
        return budget_from_action(action, self.budgets, self.action_type)

    def step(self, action):
        if self.sim is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        sim = self.sim
        budget = self.budget_for(action)
        applied = max(budget, sim.num_decodes, 1)
        sim.step(applied)
        self._budgets.append(applied)
        self._steps += 1
        self._done = not sim.advance()
        miss, wait, itl = self.meter.charges(final=self._done)
        reward = self.meter.reward(miss, wait, itl)
        info: dict[str, Any] = {"budget": budget, "budget_applied": applied,
                                "budget_clipped": applied != budget, "ttft_miss": miss,
                                "ttft_wait": wait, "itl_excess": itl, "sim_time_s": sim.now}
        if self._done:
            info["episode_metrics"] = self.episode_metrics()
        return self._observe(), float(reward), self._done, False, info

    def episode_metrics(self) -> "EpisodeMetrics":
        return EpisodeMetrics(self.sim, self._slo, list(self._budgets))

    # --- observation -------------------------------------------------------------------------

    def _observe(self) -> np.ndarray:
        return observe(self.sim, self._slo, self._slo_obs)


def slo_features(slo: SLO) -> tuple[float, float]:
    """The SLO pair as the last two observation entries."""
    return _log_scale(slo.ttft_s, 30.0), _log_scale(1000 * slo.itl_s, 1000.0)


def observe(sim: Simulator, slo: SLO, slo_obs: tuple[float, float] | None = None) -> np.ndarray:
    """The observation of ``sim``'s state before its next pass (see ChunkBudgetEnv's table).

    A function of the simulator alone, so that a trained model can drive a simulator
    (or a real engine's equivalent counters) outside the environment.
    """
    if slo_obs is None:
        slo_obs = slo_features(slo)
    # Read the simulator's counters directly: this runs once per environment step.
    n = sim._n
    ctx = sim._so + n * sim.pass_index
    prefilling, waiting = sim.prefilling, sim.waiting
    head = prefilling[0] if prefilling else (waiting[0] if waiting else None)
    if head is not None:
        done_tokens = head.computed
        total_tokens = head.prompt + head.generated
        first = head.arrival
        if prefilling and waiting and waiting[0].arrival < first:
            first = waiting[0].arrival
        oldest = sim.now - first
    else:
        done_tokens = total_tokens = 0
        oldest = 0.0
    free = free_ride_root(sim.roofline, n, ctx, done_tokens)
    log1p = math.log1p
    a = log1p(len(waiting)) * _INV_LOG_512
    b = log1p(sim.waiting_prefill_tokens) * _INV_LOG_128K
    c = oldest / slo.ttft_s * 0.25
    d = sim.last_pass_s / slo.itl_s * 0.25
    e = log1p(free) * _INV_LOG_16K
    f = log1p(total_tokens - done_tokens) * _INV_LOG_128K
    g = log1p(ctx / n) * _INV_LOG_128K if n else 0.0
    obs = (
        a if a < 1.0 else 1.0,
        b if b < 1.0 else 1.0,
        n / sim.config.max_num_seqs,
        sim._used / sim.total_blocks,
        c if c < 1.0 else 1.0,
        d if d < 1.0 else 1.0,
        e if e < 1.0 else 1.0,
        done_tokens / total_tokens if total_tokens else 0.0,
        f if f < 1.0 else 1.0,
        g if g < 1.0 else 1.0,
        *slo_obs,
    )
    return np.array(obs, dtype=np.float32)


class EpisodeMetrics(Mapping):
    """An episode's TTFT p50/p99, ITL p99/max, goodput, requests, preemptions and applied
    budgets, computed from the finished simulator the first time anyone reads them (most
    training loops never do, and the summary costs milliseconds)."""

    def __init__(self, sim: Simulator, slo: SLO, budgets: list[int]):
        self._sim, self._slo, self._budgets = sim, slo, budgets
        self._data: dict | None = None

    def _load(self) -> dict:
        if self._data is None:
            s = self._sim.result().summary(self._slo)
            b = np.asarray(self._budgets, dtype=np.int64)
            self._data = {"ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                          "itl_p99_s": s["itl_p99_s"], "itl_max_s": s["itl_max_s"],
                          "goodput": s["goodput"], "requests": s["requests_finished"],
                          "preemptions": s["preemptions"], "budgets": b,
                          "budget_mean": float(b.mean()) if len(b) else math.nan}
            self._sim = None
        return self._data

    def __getitem__(self, key):
        return self._load()[key]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


class RewardMeter:
    """Charges of the passes a simulator ran since the last call (the env's reward).

    Kept apart from the environment so that look-ahead controllers score their
    rollouts by exactly the same objective.
    """

    def __init__(self, sim: Simulator, slo: SLO, mean_output: float,
                 weights: RewardWeights | None = None):
        self.sim, self.slo, self.weights = sim, slo, weights or RewardWeights()
        self.mean_output = max(mean_output, 1.0)
        self.seg_pos = len(sim._segs)
        # Requests whose TTFT deadline has already passed were charged before this meter.
        reqs, j = sim.requests, 0
        while j < len(reqs) and reqs[j].arrival + slo.ttft_s <= sim.now:
            j += 1
        self.deadline_pos = j
        self.ttft_accrued = sim.ttft_accrued()

    def reward(self, miss: float, wait: float, itl: float) -> float:
        w = self.weights
        return -(w.ttft_miss * miss + w.ttft_wait * wait + w.itl_excess * itl)

    def charges(self, final: bool = False) -> tuple[int, float, float]:
        """(TTFT deadlines missed, accrued wait / TTFT target, ITL excess / mean output)."""
        sim, slo = self.sim, self.slo
        # TTFT deadlines that passed since the last call, in arrival order.
        reqs, j, now, target = sim.requests, self.deadline_pos, sim.now, slo.ttft_s
        miss = 0
        while j < len(reqs) and (reqs[j].arrival + target <= now or final):
            r = reqs[j]
            if not r.warm and not (r.first_token_s <= r.arrival + target):
                miss += 1
            j += 1
        self.deadline_pos = j
        accrued = sim.ttft_accrued()
        wait = (accrued - self.ttft_accrued) / target
        self.ttft_accrued = accrued
        # Decode tokens of the passes simulated since, by their excess gap: each run of
        # passes is an arithmetic sequence of durations a + b*i, summed in closed form.
        segs, i, itl = sim._segs, self.seg_pos, slo.itl_s
        excess = 0.0
        end = len(segs)
        while i < end:
            n = segs[i + 4]
            if not n:
                i += 5
                continue
            k, a, b = int(segs[i + 1]), segs[i + 2], segs[i + 3]
            i += 5
            if b <= 0:
                if a > itl:
                    excess += n * k * (a - itl)
                continue
            i0 = 0 if a > itl else int((itl - a) / b) + 1
            if i0 < k:
                m = k - i0
                excess += n * (m * (a - itl) + b * (i0 + k - 1) * m / 2)
        self.seg_pos = i
        return miss, wait, excess / itl / self.mean_output


class ObservedState:
    """Scheduler counts recovered from an observation vector (the inverse of
    :func:`observe` up to rounding and clipping), so that rules written against the
    scheduler's state also answer SB3's ``predict(observation)``."""

    __slots__ = ("num_waiting", "waiting_prefill_tokens", "num_decodes", "kv_usage",
                 "free_ride_tokens", "head_prefilled_tokens", "head_prompt_tokens")

    def __init__(self, obs, max_num_seqs: int = 256):
        o = [float(x) for x in obs]
        self.num_waiting = int(round(math.expm1(o[0] / _INV_LOG_512)))
        self.waiting_prefill_tokens = int(round(math.expm1(o[1] / _INV_LOG_128K)))
        self.num_decodes = int(round(o[2] * max_num_seqs))
        self.kv_usage = o[3]
        self.free_ride_tokens = int(math.expm1(o[6] / _INV_LOG_16K))
        remaining = math.expm1(o[8] / _INV_LOG_128K)
        share = o[7]
        total = remaining / (1 - share) if share < 1 else remaining
        self.head_prompt_tokens = int(round(total))
        self.head_prefilled_tokens = int(round(total - remaining))
