"""A reference controller that bounds what any budget controller could gain: model
predictive control over the simulator itself. Not deployable: it sees the stream's
future arrivals and their lengths.

At each re-plan it forks the simulator and rolls every candidate forward: the candidate
decides the budget for ``replan_s`` seconds, then the base policy (the scenario's
hindsight-best static budget) takes over until ``horizon_s`` seconds from now. Each
rollout is scored by the environment's reward, the SLO itself (TTFT deadlines missed,
plus decode tokens whose gap exceeded the ITL target in requests' worth); the best candidate
decides until the next re-plan, and ties go to the base. Keeping the base among the
candidates makes this a rollout algorithm over the best static budget: it deviates
from it only where a deviation scores better over the horizon, which is how it stays at
least as good as that budget in practice (greedy re-planning over a finite horizon is
not a proof; the report says where it falls short).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from envs.actions import FINE_LADDER, FRACTION_LADDER, capped_budget, clamp_budget
from envs.engine import check_static_budget
from envs.errors import MAX_TOKENS, ConfigError, require, show
from envs.reward import P99_ALLOWANCE, RewardMeter, SLOMeter
from envs.workload import MAX_SECONDS
from policies.base import BudgetPolicy, Param
from policies.baselines import (StaticPolicy, TimeBudgetFewPolicy, TimeBudgetKVPolicy,
                                TimeBudgetPolicy)


class ReferencePolicy(BudgetPolicy):
    """The MPC reference (the module docstring): a diagnostic, not a policy to serve."""

    spec, kind, diagnostic = "reference", "reference", True
    params = (Param("budget", int, None, 0, MAX_TOKENS, "BUDGET tokens"),
              Param("horizon_s", float, None, 0.0, MAX_SECONDS, "HORIZON_S seconds"),
              Param("replan_s", float, None, 0.0, MAX_SECONDS, "REPLAN_S seconds"))
    summary = ("the MPC reference over static BUDGET (not deployable: sees the future), "
               "horizon H s (2x TTFT), re-plan every R s")

    def __init__(self, slo, base: BudgetPolicy, candidates: Sequence[BudgetPolicy],
                 horizon_s: float | None = None, replan_s: float | None = None,
                 mean_output: float | None = None, name: str | None = None):
        self.slo, self.base = slo, base
        self.name = name or f"reference over {base.name}"
        self.candidates = [c for c in candidates if c.name != base.name]
        self.horizon_s = 2 * slo.ttft_s if horizon_s is None else float(horizon_s)
        self.replan_s = slo.ttft_s / 4 if replan_s is None else float(replan_s)
        require(math.isfinite(self.horizon_s) and self.horizon_s >= slo.itl_s, "horizon_s",
                self.horizon_s, f"must be at least one pass at the ITL target ({slo.itl_s:g} s)")
        require(math.isfinite(self.replan_s) and 0 < self.replan_s <= self.horizon_s, "replan_s",
                self.replan_s, f"must lie in (0, horizon_s = {self.horizon_s:g}]")
        self.mean_output = mean_output
        self.reset()

    def reset(self) -> None:
        self._until = -math.inf
        self._choice = self.base
        self.margin = 0.0
        """How much better than the base the choice scored at the last re-plan."""
        self.choices: dict[str, int] = {}

    def score(self, sim, first: BudgetPolicy) -> float:
        """SLO violations over the horizon when ``first`` decides for ``replan_s`` seconds and
        the base policy after."""
        f = sim.fork()
        per_request = self.mean_output or float(sim.workload.output_tokens.mean())
        meter = RewardMeter(f, self.slo, per_request)
        self.roll(f, first)
        return -meter.reward(*meter.charges())

    def roll(self, f, first: BudgetPolicy) -> None:
        """Run the fork ``f`` over the horizon: ``first`` for ``replan_s`` seconds, then the
        base; every budget under the cap, as it would serve."""
        switch, end = f.now + self.replan_s, f.now + self.horizon_s
        state = f.state()
        while True:
            policy = first if f.now < switch else self.base
            budget = policy(state)
            if self.max_pass_s is not None:  # rolled out as it would serve: under its cap
                budget = capped_budget(state, budget, self.max_pass_s)
            f.step(clamp_budget(budget, state.running_decodes))
            if not f.advance(until_s=end) or f.now >= end:
                break

    def budget(self, state) -> int:
        sim = state.simulator
        if sim.now >= self._until:
            best, best_score = self.base, self.score(sim, self.base)
            base_score = best_score
            for c in self.candidates:
                s = self.score(sim, c)
                if s < best_score:
                    best, best_score = c, s
            self._choice, self._until = best, sim.now + self.replan_s
            self.margin = base_score - best_score  # the choice's lead over the base at it
            self.choices[best.name] = self.choices.get(best.name, 0) + 1
        return self._choice(state)


    @classmethod
    def usage(cls) -> str:
        return "reference:BUDGET[:HORIZON_S[:REPLAN_S]]"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if not 1 <= len(args) <= 3:
            raise ConfigError(f"policy: got {show(spec)}, wrong number of arguments: {cls.usage()}")
        budget = cls.params[0].parse(spec, args[0])
        check_static_budget(budget, scenario.engine_config())
        times = [p.parse(spec, a) for p, a in zip(cls.params[1:], args[1:])]
        return reference_for(scenario, budget, *times)


def reference_for(scenario, base_budget: int, horizon_s: float | None = None,
                  replan_s: float | None = None) -> ReferencePolicy:
    """The reference over a scenario's hindsight-best static budget: candidates are the
    fine ladder's rungs within an octave of it and the per-pass time-budget rules. Its
    name is its spec: ``reference:BUDGET`` (with the times where they were given)."""
    k = FINE_LADDER.index(base_budget) if base_budget in FINE_LADDER else None
    rungs = FINE_LADDER[max(k - 4, 0):k + 5] if k is not None else ()
    statics = [StaticPolicy(b) for b in rungs if b >= scenario.max_num_seqs]
    itl = scenario.slo_itl_s
    rules = [TimeBudgetPolicy(itl, 1.0), TimeBudgetKVPolicy(itl, 1.0), TimeBudgetFewPolicy(itl, 1.0)]
    given = [f"{t:g}" for t in (horizon_s, replan_s) if t is not None]
    return ReferencePolicy(scenario.slo(), StaticPolicy(base_budget), statics + rules, horizon_s,
                           replan_s, name=":".join(["reference", str(base_budget), *given])
                           ).limit_pass(scenario)


HORIZON_TTFT = 5.0
"""The rollout's horizon in TTFT targets where none is given: on the H100 mix the room it
finds grows from a 2 s horizon (a loss) to 10 s, five TTFT targets (docs/learning.md, "The
room beyond the best rule"), and a TTFT target's worth of queue is what a deviation's cost
plays out over."""


class RolloutPolicy(ReferencePolicy):
    """The rollout reference over a rule: what a controller that sees the future could add
    to the best rule, judged as capacity judges (not deployable; a diagnostic).

    At each re-plan (every quarter of the TTFT target) it forks the simulator, so every
    candidate meets the same future arrivals (common random numbers), and rolls each
    forward for ``horizon_s``: the candidate for one re-plan interval, then the rule. The
    candidates are the action ladder's fractions of the ITL target held per pass and the
    rules the export weighs; the rule itself is one, and ties go to it. The score is what
    capacity counts against the p99 targets at the horizon's end: the TTFT deadlines
    missed within it, plus the decode tokens over the ITL target beyond 1% of all decode
    tokens so far (the simulator's slack count, so slack spent earlier is charged), in
    requests' worth. The training reward charges the same two things but only within the
    horizon, which can rank up a deviation that spends slack the stream no longer has. By
    the rollout algorithm's cost improvement it should not lose to its rule beyond noise
    (a finite horizon and a re-planned greedy choice do not make that a proof)."""

    spec, kind, diagnostic = "rollout", "reference", True
    params = (Param("horizon_s", float, None, 0.0, MAX_SECONDS, "HORIZON_S seconds"),)
    summary = ("the rollout reference over RULE, scored by the p99 targets' excess over a "
               "HORIZON_S-second horizon (not deployable: sees the future)")
    RULES = ("time-budget-deadline-kv:4", "time-budget-deadline-kv:16", "time-budget-deadline:16",
             "time-budget-slack:7")
    """The rules among its candidates (the export's, and the plain deadline rule)."""

    @classmethod
    def usage(cls) -> str:
        return "rollout:HORIZON_S:RULE"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if len(args) < 2:
            raise ConfigError(f"policy: got {show(spec)}, wrong number of arguments: {cls.usage()}")
        horizon = cls.params[0].parse(spec, args[0])
        make = options["make_policy"]
        base = make(":".join(args[1:]), scenario)
        if base.diagnostic or base.kind not in ("rule", "table"):
            raise ConfigError(f"policy: got {show(spec)}, RULE must be a rule or a table, "
                              f"not {base.kind}")
        itl = scenario.slo_itl_s
        candidates = [TimeBudgetPolicy(itl, f) for f in FRACTION_LADDER]
        candidates += [make(r, scenario) for r in cls.RULES]
        return cls(scenario.slo(), base, candidates, horizon_s=horizon, name=spec)

    def score(self, sim, first: BudgetPolicy) -> float:
        return self.score_fork(sim, sim.fork(), first)

    def score_fork(self, sim, f, first: BudgetPolicy) -> float:
        """The score of ``first`` on ``f``, a fork of ``sim``."""
        itl = self.slo.itl_s
        sim.itl_slack(itl)  # the real run's slack count, kept from its first reading on
        per_request = self.mean_output or float(sim.workload.output_tokens.mean())
        meter = SLOMeter(f, self.slo)
        self.roll(f, first)
        missed, _ = meter.charges()
        slack = f.itl_slack(itl)
        return missed + max(0.0, slack.slow - P99_ALLOWANCE * slack.tokens) / per_request


class SampledRolloutPolicy(RolloutPolicy):
    """The rollout over a rule on sampled futures: as ``rollout:`` but blind to the
    stream's own future. At each re-plan it draws ``futures`` stretches of arrivals one
    horizon long from elsewhere in the stream being served (a block bootstrap: the
    stream's rate, mix and bursts, never the arrivals about to come; a stretch that would
    overlap the next horizon is drawn again), each with an output length for every
    request in flight drawn from the stream's lengths longer than what it has generated
    (an engine does not know when a request stops), and scores each candidate by its mean
    over them, every candidate on the same draws. What it improves on is then the base's
    expected cost given what an engine can know now (Bertsekas' rollout with Monte Carlo
    simulation), not its cost on one known future: the labels a learned policy can imitate
    (agents/improve.py). Not deployable as it is (it simulates every re-plan), and it
    knows the stream's distribution."""

    spec = "rollout-sampled"
    params = (Param("futures", int, None, 0, 64, "FUTURES sampled stretches"),
              Param("horizon_s", float, None, 0.0, MAX_SECONDS, "HORIZON_S seconds"))
    summary = ("the rollout reference over RULE on FUTURES sampled stretches of the stream "
               "(blind to its own future), scored as rollout: over HORIZON_S seconds")

    def __init__(self, *args, futures: int = 4, seed: int = 0, **kwargs):
        self.futures, self.seed = int(futures), int(seed)
        super().__init__(*args, **kwargs)

    @classmethod
    def usage(cls) -> str:
        return "rollout-sampled:FUTURES:HORIZON_S:RULE"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if len(args) < 3:
            raise ConfigError(f"policy: got {show(spec)}, wrong number of arguments: {cls.usage()}")
        futures = cls.params[0].parse(spec, args[0])
        plain = RolloutPolicy.from_spec(spec, args[1:], scenario, options)
        return cls(scenario.slo(), plain.base, plain.candidates, horizon_s=plain.horizon_s,
                   futures=futures, name=spec)

    def reset(self) -> None:
        super().reset()
        self._rng = np.random.default_rng(self.seed)
        self._stretches: list = []

    def stretch(self, sim):
        """Arrivals of one horizon from a random place in the stream, moved to now."""
        w, now, h = sim.workload, sim.now, self.horizon_s
        span = w.duration_s
        if not len(w) or span <= 0:
            return w
        for _ in range(16):  # away from the horizon about to come, where the stream allows
            u = float(self._rng.uniform(0.0, span))
            if span <= 3 * h or not (now - h < u < now + h):
                break
        a = w.arrival_s
        lo, hi = np.searchsorted(a, u), np.searchsorted(a, u + h)
        idx, times = [np.arange(lo, hi)], [a[lo:hi] - u + now]
        if u + h > span:  # wraps around to the stream's start
            hi2 = np.searchsorted(a, u + h - span)
            idx.append(np.arange(0, hi2))
            times.append(a[:hi2] + (span - u) + now)
        i = np.concatenate(idx)
        return w.rows(i, np.concatenate(times), "stretch")

    def outputs(self, sim) -> dict[int, int]:
        """An output length for each request in flight, drawn from the stream's output
        lengths longer than what it has generated so far (one token more where none is)."""
        pool = np.sort(sim.workload.output_tokens)
        out = {}
        for rid, done in sim.generated_so_far().items():
            k = int(np.searchsorted(pool, done, side="right"))
            out[rid] = int(pool[self._rng.integers(k, len(pool))]) if k < len(pool) else done + 1
        return out

    def budget(self, state) -> int:
        sim = state.simulator
        if sim.now >= self._until:
            self._stretches = [(self.stretch(sim), self.outputs(sim)) for _ in range(self.futures)]
        return super().budget(state)

    def score(self, sim, first: BudgetPolicy) -> float:
        return float(np.mean([self.score_fork(sim, sim.fork(future=w, outputs=o), first)
                              for w, o in self._stretches]))

