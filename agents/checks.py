"""Checks before training that the learning problem is worth solving, and the figures
that say afterwards what the policy does.

- :func:`ranking_check`: the episode return must rank fixed choices the way their
  capacity under the SLO does (otherwise the reward teaches something else);
- :func:`room_check`: a reference controller (model-predictive, it sees the future)
  must beat the best fixed choice on the training distribution (otherwise there is no
  room for a state-dependent policy, and a constant is the honest answer);
- :func:`condition_teachers`: the fixed choice that serves each training condition best,
  which the policy imitates before learning (a privileged teacher: it knows the
  condition, the policy must tell it from what it observes).

Fixed choices are named by their policy specs (``time-budget-deadline:16``). Episodes are
run as independent tasks of an executor (Ray or in-process).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from agents.conditions import condition_sweeps
from envs.actions import FRACTION_LADDER
from envs.episodes import EpisodeSampler, draw_episodes
from envs.reward import RewardMeter, RewardWeights
from envs.scenario import Scenario
from envs.stats import ci95_half
from eval.capacity import capacity_sweep
from eval.harness import paired_difference
from eval.parallel import LocalExecutor
from policies.baselines import TimeBudgetFewPolicy, TimeBudgetKVPolicy, TimeBudgetPolicy
from policies.reference import ReferencePolicy
from policies.specs import make_policy


def episode_cost(scenario: Scenario, workload, policy, weights: RewardWeights | None = None) -> float:
    """The cost (minus the return) of one episode served by ``policy``, by the
    environment's reward."""
    sim = scenario.simulator(workload)
    meter = RewardMeter(sim, scenario.slo(), float(workload.output_tokens.mean()), weights,
                        len(workload))
    policy.reset()
    sim.run(policy)
    return -meter.reward(*meter.charges(final=True))


def _cost_task(scenario, workload, spec, weights):
    return episode_cost(scenario, workload, make_policy(spec, scenario), weights)


def constant_costs(episodes, names: list[str], weights=None, executor=None, progress=None) -> dict:
    """Each fixed choice's cost on each episode (``names``: policy specs; the same episodes
    for all: paired)."""
    tasks = [(sc, w, n, weights) for n in names for sc, w in episodes]
    found = (executor or LocalExecutor()).map(_cost_task, tasks, progress)
    k = len(episodes)
    return {n: np.asarray(found[i * k:(i + 1) * k]) for i, n in enumerate(names)}


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def ranking_check(base: Scenario, conditions: list[dict], costs: dict, probe_conditions: int = 5,
                  seeds: int = 2, executor=None, progress=None) -> dict:
    """Spearman correlation between the constants' mean return and their mean capacity
    relative to the best of them, over ``probe_conditions`` of the training conditions."""
    names = list(costs)
    picks = [conditions[i] for i in np.linspace(0, len(conditions) - 1, probe_conditions).astype(int)]
    rel = {n: [] for n in names}
    for cond in picks:
        sc = base.with_fields(**{k: v for k, v in cond.items() if k != "capacity_rps"})
        found = capacity_sweep([(sc, make_policy(n, sc)) for n in names], seeds, 200,
                               executor=executor, progress=progress, min_duration_s=10 * sc.slo_ttft_s)
        top = max(r.capacity for r in found) or 1.0
        for n, r in zip(names, found):
            rel[n].append(r.capacity / top)
    mean_cost = np.array([costs[n].mean() for n in names])
    mean_cap = np.array([np.mean(rel[n]) for n in names])
    return {"spearman": _spearman(-mean_cost, mean_cap), "conditions": len(picks),
            "rows": [{"policy": n, "cost": float(c), "relative_capacity": float(r)}
                     for n, c, r in zip(names, mean_cost, mean_cap)]}


SELECT_Z = 1.96
"""Standard errors by which a fixed choice must beat (or stay within) another for the
teacher picks below: a selection threshold over 4-8 paired episodes, not a reported
interval. The shipped presets' teachers were chosen with it; with Student's t over 4
episodes (3.18) a tight cache of short conversations no longer gets its own teacher
(tests/test_train.py)."""


def teacher_choice(costs: dict, ranking: dict | None = None) -> str:
    """The fixed choice to start from: the lowest mean cost over the paired episodes, or,
    among the choices whose cost ties with it (within :data:`SELECT_Z` paired standard
    errors), the one with the highest capacity in ``ranking`` (:func:`ranking_check`). The
    return is a noisy proxy for capacity: on an L40S's training mix the KV-aware slack rule
    ``time-budget-slack-kv:16`` costs 0.70 against 0.64 for ``time-budget-kv:1``, within the
    interval, and serves 5% more."""
    low = min(costs, key=lambda n: costs[n].mean())
    if not ranking:
        return low
    capacity = {r["policy"]: r["relative_capacity"] for r in ranking["rows"]}
    tied = [n for n in costs
            if n == low or paired_difference(costs[n], costs[low], SELECT_Z).kind == "ties"]
    return max(tied, key=lambda n: (capacity.get(n, 0.0), -costs[n].mean()))


def condition_teachers(base: Scenario, sampler: EpisodeSampler, names: list[str], teacher: str,
                       per_condition: int = 4, seed: int = 0, executor=None,
                       progress=None) -> list[str]:
    """For each of ``sampler``'s conditions, the fixed choice among ``names`` with the lowest
    mean cost on ``per_condition`` episodes of that condition alone, where it beats
    ``teacher`` there (paired, by more than :data:`SELECT_Z` standard errors); ``teacher``
    otherwise. Among the choices that tie with the lowest there, the one with ``teacher``'s
    parameters (``time-budget-slack-kv`` for ``time-budget-slack``: the same rule, holding
    back as the cache fills), so that the teachers disagree only where the condition needs
    it: on an A100 ``time-budget-kv:0.917`` tied with ``time-budget-slack-kv`` on two tight
    caches, and cloning it turned the policy to 0.917 of the target in half of all passes,
    where ``time-budget-slack`` takes 1.

    No one rule serves every condition: among an H100's training conditions, the KV-aware
    rules serve a tight cache of short conversations better than the slack rule, and
    where every choice meets the SLO none beats it (tests/test_train.py). A policy cloned
    from each condition's own best rule has to tell the conditions apart from what it
    observes."""
    names = list(dict.fromkeys([teacher, *names]))
    episodes, owner = [], []
    for i, cond in enumerate(sampler.conditions):
        one = replace(sampler, conditions=(cond,))
        episodes += draw_episodes(base, one, per_condition, seed + 1000 * i)
        owner += [i] * per_condition
    costs = constant_costs(episodes, names, executor=executor, progress=progress)
    owner = np.asarray(owner)
    picks = []
    for i in range(len(sampler.conditions)):
        mine = {n: c[owner == i] for n, c in costs.items()}
        better = [n for n in names if n != teacher
                  and paired_difference(mine[teacher], mine[n], SELECT_Z).kind == "beats"]
        if not better:
            picks.append(teacher)
            continue
        low = min(better, key=lambda n: mine[n].mean())
        tied = [n for n in better
                if n == low or paired_difference(mine[n], mine[low], SELECT_Z).kind == "ties"]
        params = {n: make_policy(n, base).param_values() for n in tied + [teacher]}
        picks.append(min(tied, key=lambda n: (params[n] != params[teacher], mine[n].mean())))
    return picks


def condition_capacities(base: Scenario, conditions: list[dict], names: list[str], seeds: int = 2,
                         num_requests: int = 200, executor=None,
                         progress=None) -> list[list[float]]:
    """For each condition (Scenario fields with their ``capacity_rps``), the capacity under
    its SLO of each fixed choice in ``names`` (requests/s, the mean over ``seeds`` streams,
    searched from the condition's own, each stream lasting at least ten TTFT targets): a
    condition's teacher is the one that serves most (:func:`capacity_pick`).

    Across deployments the member of a rule family that serves moves with the hardware and
    model (the KV-aware deadline rule's TOP 16 on an H100's 8B, TOP 4 on an A100's), and an
    episode's cost at one load misranks them (docs/learning.md, "One policy for every
    deployment"). Capacity is the figure the policy is judged by."""
    starts = [c.get("capacity_rps", 0.0) / base.with_fields(
        **{k: v for k, v in c.items() if k != "capacity_rps"}).rate for c in conditions]
    found = condition_sweeps(base, conditions,
                             lambda sc: [make_policy(n, sc).limit_pass(sc) for n in names],
                             seeds, num_requests, starts, executor, progress)
    return [[r.capacity for r in rs] for rs in found]


def capacity_pick(names: list[str], capacities: list[float], tie: float) -> str:
    """The first of ``names`` whose capacity is within the share ``tie`` of the highest
    (``train.py --teacher-tie``)."""
    top = max(capacities)
    return next(n for n, c in zip(names, capacities) if c >= (1 - tie) * top)


def condition_index(scenario: Scenario, conditions) -> int | None:
    """Which of ``conditions`` (Scenario fields, plus ``capacity_rps``) ``scenario`` was
    drawn from, or None."""
    for i, cond in enumerate(conditions):
        if all(getattr(scenario, k) == v for k, v in cond.items() if k != "capacity_rps"):
            return i
    return None


def _room_task(scenario, workload, best, weights):
    base = make_policy(best, scenario)
    cands = [TimeBudgetPolicy(scenario.slo_itl_s, f) for f in FRACTION_LADDER]
    cands += [TimeBudgetKVPolicy(scenario.slo_itl_s, 1.0), TimeBudgetFewPolicy(scenario.slo_itl_s, 1.0)]
    ref = ReferencePolicy(scenario.slo(), base, cands).limit_pass(scenario)
    return episode_cost(scenario, workload, ref, weights)


def room_check(episodes, best: str, best_costs: np.ndarray, weights=None, executor=None,
               progress=None) -> dict:
    """The reference controller (MPC over the best constant, the fraction ladder and the
    KV-aware rule among its candidates) against the best constant, episode by episode."""
    tasks = [(sc, w, best, weights) for sc, w in episodes]
    ref = np.asarray((executor or LocalExecutor()).map(_room_task, tasks, progress))
    d = best_costs[:len(ref)] - ref
    half = ci95_half(d)
    return {"best_constant": best, "best_cost": float(best_costs[:len(ref)].mean()),
            "reference_cost": float(ref.mean()), "gain": float(d.mean()), "gain_ci95": half,
            "episodes": len(ref)}
