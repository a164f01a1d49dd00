"""Gymnasium environment: choose the budget of the scheduler's passes.

A thin adapter over :class:`envs.engine.Simulator`; it owns no physics. The pure
parts it wires together live in gym-free modules: the observation
(:mod:`envs.observation`), the reward (:mod:`envs.reward`), the action ladders and
the time-budget conversion (:mod:`envs.actions`) and the episode draw
(:mod:`envs.episodes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.actions import DEFAULT_LADDER, FRACTION_LADDER, action_value, pass_budget
from envs.engine import Simulator
from envs.episodes import EpisodeSampler, draw_episode
from envs.errors import ConfigError, require
from envs.metrics import SLO
from envs.observation import OBSERVATION_FIELDS, observe, slo_features
from envs.reward import RewardMeter, RewardWeights
from envs.scenario import Scenario, named_workload
from envs.workload import Workload, load_trace

__all__ = ["ChunkBudgetEnv", "EpisodeMetrics", "EpisodeSampler", "RewardWeights"]


class ChunkBudgetEnv(gym.Env):
    """Pick the budget of the scheduler's passes: a time budget, or a token budget.

    ## Description

    A continuous-batching LLM server (vLLM V1 semantics, roofline-priced passes) serves
    a stream of requests. Running decodes always get one token each; the budget decides
    how many prompt tokens ride along in the same pass. Small budgets keep the running
    users' inter-token latency (ITL) low and delay new prompts' first token (TTFT);
    large budgets do the opposite.

    **One step is one decision interval**: the action holds for every pass with prefill
    work in the next ``decision_interval_s`` seconds of simulated time (by default a
    twentieth of the TTFT target), then the environment runs on to the next pass that
    has a decision to make. Steps therefore span about the same simulated time whatever
    the budget, so a per-step discount is a discount per second of serving (a budget
    that makes more, shorter passes does not see the future discounted harder), and the
    default ``gamma`` 0.975 of ``train.py`` looks about forty intervals, twice the TTFT
    target, ahead. With ``decision_interval_s=0`` a step is one pass.

    ## Action Space

    ``actions="time"`` (the default): ``Discrete(len(fractions))``, the pass's time
    budget as a fraction of the ITL target (``FRACTION_LADDER``: 0.25 to 2, steps of
    2^(1/4)). Each pass turns it into tokens with the cost model and that pass's decodes:
    the decodes plus the largest chunk after the head request's prefix whose priced pass
    fits in the fraction of the target (``envs.actions.time_budget``; the cap, 16,384,
    with nothing decoding). One policy thereby carries across hardware, per-pass
    overheads and SLOs. ``actions="tokens"``: an index into a log-spaced ladder of token
    budgets (``DEFAULT_LADDER``, 64 to 16,384). With ``action_type="continuous"``,
    ``Box(-1, 1, (1,))`` maps linearly to the log of either ladder between its ends. A
    budget is never below the running decodes (each must get its token).

    ## Observation Space

    ``Box(0, 1, (19,), float32)``, every entry scaled to [0, 1] and clipped:

    | idx | observation | scaling |
    |-----|-------------|---------|
    | 0 | running decodes | x / max_num_seqs |
    | 1 | waiting requests (vLLM ``num_requests_waiting``) | log1p(x)/log1p(512) |
    | 2 | prompt tokens still to prefill, waiting + partial | log1p(x)/log1p(131072) |
    | 3 | KV-cache usage (vLLM ``kv_cache_usage_perc``) | fraction |
    | 4 | oldest waiting request's age | age / TTFT target / 4 |
    | 5 | price of a decode-only pass at the current decodes | seconds / ITL target / 4 |
    | 6 | chunk a pass can carry within the ITL target | log1p(x)/log1p(16384) |
    | 7 | head request's prompt tokens still to prefill | log1p(x)/log1p(131072) |
    | 8 | share of the head request's prompt already prefilled (or cached) | fraction |
    | 9 | last pass's duration | duration / ITL target / 4 |
    | 10 | mean decode context, tokens | log1p(x)/log1p(131072) |
    | 11 | p99 ITL slack: passes over the ITL target the running decodes could take | log1p(x)/log1p(64) |
    |    | while under 0.8% of decode tokens (last few minutes) run slow (``envs.slack``) | |
    | 12 | TTFT target | log1p(s)/log1p(30) |
    | 13 | ITL target | log1p(1000 s)/log1p(1000) |
    | 14 | when the prefill queue would be done, from its oldest request's arrival: that | seconds / TTFT target / 4 |
    |    | request's age plus every waiting prompt token at the chunk of entry 6 per ITL target | |
    | 15 | the deployment (``envs.deployment``), constant in an episode: the lightest decode-only pass | seconds / ITL target / 4 |
    | 16 | the chunk a pass with one decode carries within the ITL target | log1p(x)/log1p(2^20) |
    | 17 | the share of the lightest pass that is fixed cost | fraction |
    | 18 | the KV cache in prompts of one TTFT target's worth of prefill at passes of the ITL target | log1p(x)/log1p(1024) |

    Entries 12-18 tell deployments apart (hardware, model, per-pass overheads, KV cache, SLO
    pair), so that a policy trained across them (``train.py --all-deployments``) serves
    one it never saw. A model trained on an earlier, shorter vector (14 or 15 entries)
    reads its prefix.

    With prefix caching, a waiting head's cached tokens count as prefilled (``envs.state``'s
    ``head_prefilled_tokens``): entry 8 is then its cached share, and entry 6 the chunk
    that fits with their keys and values read as its prefix.

    All of them are cheap for a real engine to read or compute each pass (counts, KV
    usage, the head request's computed tokens, running requests' context lengths, the
    cost model's coefficients, and the time between steps for the slack). ``train.py``
    normalises them further with SB3's ``VecNormalize``.

    ## Rewards

    The SLO itself (``envs.reward``): each step is charged ``ttft_miss`` (1) per request
    whose TTFT deadline passed in it without a first token, and ``slow_tokens`` (10) per
    request's worth (the episode's mean output length) of decode tokens whose gap
    exceeded the ITL target beyond the 1% a p99 target tolerates (the growth of the
    episode's excess over 1% of its decode tokens; negative when on-time tokens bring it
    back down), both in percent of the episode's requests. A p99 target is a count of
    such events, so a budget just past the cliff costs much more than one just under it.
    ``info`` carries both charges.

    ## Starting State

    An idle engine; the first request of a freshly drawn stream arrives at time 0.
    Episode streams (their condition and load) are drawn from ``self.np_random``.

    ## Episode End

    - Termination: every request of the episode's stream has finished.
    - Truncation: ``max_episode_steps`` decisions (``register``; default 4096).

    When an episode terminates, ``info["episode_metrics"]`` holds its TTFT p50/p99, ITL
    p99/max, goodput, and the budgets applied (each pass's, and their mean).

    ## Arguments

    ``gymnasium.make("chunkpilot/ChunkBudget-v4", hardware="h100-sxm",
    model="llama-3-8b", workload="mixed-bursty", slo=(2.0, 0.1), actions="time",
    action_type="discrete", budgets=DEFAULT_LADDER, fractions=FRACTION_LADDER,
    decision_interval_s=None, sampler=EpisodeSampler(), reward=RewardWeights(),
    scenario=None)``. ``workload`` is a name from ``envs.scenario.WORKLOADS``, a trace
    name or path, a dict of Scenario fields, or a fixed :class:`Workload` (replayed
    as is every episode). ``scenario`` (a :class:`Scenario`) replaces hardware, model,
    workload and SLO at once.

    ## Version History

    - v4: the deployment observed (19 entries: 15-18, ``envs.deployment``), so that one
      policy can serve many; a v3 model reads the first 15.
    - v3: when the prefill queue would be done at passes within the ITL target observed
      (15 entries; a v2 model reads the first 14).
    - v2: the p99 ITL slack observed (14 entries), fractions up to 16, slow tokens charged
      beyond the 1% a p99 target tolerates.
    - v1: time-budget actions, the SLO as reward, decision intervals of simulated time,
      condition-identifying observations.
    - v0: token-ladder actions, a reward with an accrued-wait term, one step per pass.
    """

    metadata = {"render_modes": []}

    def __init__(self, hardware: str = "h100-sxm", model: str = "llama-3-8b",
                 workload: str | dict | Workload = "mixed-bursty",
                 slo: tuple[float, float] | SLO | None = None, actions: str = "time",
                 action_type: str = "discrete", budgets: Sequence[int] = DEFAULT_LADDER,
                 fractions: Sequence[float] = FRACTION_LADDER,
                 decision_interval_s: float | None = None, sampler: EpisodeSampler | None = None,
                 reward: RewardWeights | None = None, scenario: Scenario | None = None):
        super().__init__()
        self.fixed_workload: Workload | None = workload if (
            scenario is None and isinstance(workload, Workload)) else None
        if scenario is None:
            scenario = _scenario_of(hardware, model, workload, slo)
        self.scenario = scenario
        scenario.slo()  # validate
        require(actions in ("time", "tokens"), "actions", actions, "must be 'time' or 'tokens'")
        require(action_type in ("discrete", "continuous"), "action_type", action_type,
                "must be 'discrete' or 'continuous'")
        self.actions, self.action_type = actions, action_type
        self.budgets = _ladder(budgets, "budgets", int)
        self.fractions = _ladder(fractions, "fractions", float)
        if decision_interval_s is not None:
            require(isinstance(decision_interval_s, (int, float)) and math.isfinite(decision_interval_s)
                    and decision_interval_s >= 0, "decision_interval_s", decision_interval_s,
                    "must be a finite number of seconds >= 0 (0: one step per pass)")
        self.decision_interval_s = decision_interval_s
        self.sampler = sampler or EpisodeSampler()
        self.weights = reward or RewardWeights()
        ladder = self.fractions if actions == "time" else self.budgets
        if action_type == "discrete":
            self.action_space = spaces.Discrete(len(ladder))
        else:
            self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(OBSERVATION_FIELDS),),
                                            dtype=np.float32)
        self._trace: Workload | None = None
        if scenario.trace and self.fixed_workload is None:
            self._trace = load_trace(scenario.trace, scenario.rate_scale, scenario.window_start_s,
                                     scenario.window_end_s, scenario.max_requests)
        self.sim: Simulator | None = None

    # --- gymnasium API ---------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        sc, workload = draw_episode(self.np_random, self.sampler, self.scenario, self._trace,
                                    self.fixed_workload)
        self.episode_scenario = sc
        self.sim = sc.simulator(workload)
        self._slo = sc.slo()
        self._interval = (sc.slo_ttft_s / 20 if self.decision_interval_s is None
                          else self.decision_interval_s)
        self.meter = RewardMeter(self.sim, self._slo, float(workload.output_tokens.mean()),
                                 self.weights, len(workload))
        self._budgets: list[int] = []
        self._slo_obs = slo_features(self._slo)
        self._done = not self.sim.advance()
        return self._observe(), {}

    def action_value(self, action) -> float:
        """The action's fraction of the ITL target (``actions="time"``) or token budget."""
        return action_value(action, self.fractions if self.actions == "time" else self.budgets,
                            self.action_type)

    def budget_for(self, value: float) -> int:
        """This pass's budget for an action's value, from the simulator's current state,
        within the episode's cap on the longest pass (``Scenario.max_pass_itl``)."""
        return pass_budget(self.sim.state(), self.actions, value, self._slo.itl_s,
                           self.episode_scenario.max_pass_itl)

    def step(self, action):
        if self.sim is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        sim = self.sim
        value = self.action_value(action)
        end = sim.now + self._interval
        passes = 0
        while True:  # every pass with a decision in the interval gets the action's budget
            budget = self.budget_for(value)
            sim.step(budget)
            self._budgets.append(budget)
            passes += 1
            pending = sim.advance(until_s=end)
            if not pending or sim.now >= end:
                break
        self._done = not (pending or sim.advance())
        missed, slow = self.meter.charges(final=self._done)
        info: dict[str, Any] = {"action_value": value, "budget": budget, "passes": passes,
                                "ttft_miss": missed, "slow_tokens": slow, "sim_time_s": sim.now}
        if self._done:
            info["episode_metrics"] = self.episode_metrics()
        return self._observe(), float(self.meter.reward(missed, slow)), self._done, False, info

    def episode_metrics(self) -> "EpisodeMetrics":
        return EpisodeMetrics(self.sim, self._slo, list(self._budgets))

    def _observe(self) -> np.ndarray:
        return observe(self.sim.state(), self._slo, self._slo_obs)


def _ladder(values: Sequence, field: str, kind) -> tuple:
    out = tuple(kind(v) for v in values)
    require(len(out) >= 2 and all(v > 0 for v in out) and list(out) == sorted(set(out)), field,
            out, "must be at least two distinct positive numbers in increasing order")
    return out


def _scenario_of(hardware: str, model: str, workload, slo) -> Scenario:
    """The scenario of the environment's keyword arguments (see the Arguments section)."""
    scenario = Scenario(hardware=hardware, model=model)
    if isinstance(workload, dict):
        scenario = replace(scenario, **workload)
    elif isinstance(workload, str):
        try:
            scenario = replace(scenario, **named_workload(workload))
        except ConfigError:
            load_trace(workload)  # raises a clear error if it is not a trace either
            scenario = replace(scenario, trace=workload)
    elif not isinstance(workload, Workload):
        raise ConfigError(f"workload: got {type(workload).__name__}, must be a name, "
                          "a trace, a dict of Scenario fields or a Workload")
    if slo is not None:
        s = slo if isinstance(slo, SLO) else SLO(*slo)
        scenario = replace(scenario, slo_ttft_s=s.ttft_s, slo_itl_s=s.itl_s)
    return scenario


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
