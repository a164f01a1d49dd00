"""Gymnasium environment: choose the token budget of each scheduler pass.

A thin adapter over :class:`envs.engine.Simulator`; it owns no physics. The pure
parts it wires together live in gym-free modules: the observation
(:mod:`envs.observation`), the reward (:mod:`envs.reward`), the budget ladder
(:mod:`envs.actions`) and the episode draw (:mod:`envs.episodes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.actions import DEFAULT_LADDER, budget_from_action, clamp_budget
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
        self.fixed_workload: Workload | None = workload if (
            scenario is None and isinstance(workload, Workload)) else None
        if scenario is None:
            scenario = _scenario_of(hardware, model, workload, slo)
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

    # --- gymnasium API ---------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        sc, workload = draw_episode(self.np_random, self.sampler, self.scenario, self._trace,
                                    self.fixed_workload)
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
        applied = clamp_budget(budget, sim.num_decodes)
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

    def _observe(self) -> np.ndarray:
        return observe(self.sim, self._slo, self._slo_obs)


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
