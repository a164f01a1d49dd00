"""Capacity under an SLO: the highest request rate at which p99 TTFT and p99 ITL both
meet their targets (how Sarathi-Serve and DistServe report capacity), with an interval.

Each stream of arrivals (a seeded synthetic stream, or one part of a trace's window;
:meth:`envs.scenario.Scenario.streams`) gets its own capacity, found by bisection on a
load factor that multiplies the scenario's rate (synthetic) or its trace speed-up; the
policy's capacity is the mean over streams with a 95% interval. Every policy sees the
same streams, so two policies are compared stream by stream (:func:`paired_verdict`).

The hindsight-best static budget is searched on a fine ladder, steps of 2^(1/4) from
64 to 16,384 tokens: powers of two first, then the quarter steps within an octave of
the best (:func:`hindsight_static`). Capacity under a p99 target is a cliff, and the
best fixed number often sits between two powers of two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from envs.actions import FINE_LADDER, POWERS_OF_TWO
from envs.scenario import Scenario
from envs.seeds import CAPACITY_SEEDS
from envs.stats import ci95_half
from envs.workload import MAX_RATE
from eval.harness import meets_p99, paired_verdict, serving_of
from eval.parallel import LocalExecutor
from policies.baselines import StaticPolicy
from policies.reference import HORIZON_TTFT, RolloutPolicy, reference_for
from policies.specs import BY_SPEC, make_policy


@dataclass(frozen=True)
class CapacityResult:
    policy: str
    kind: str
    per_stream: tuple[float, ...]
    """Each stream's capacity, requests/s (0 when even the lowest probe fails)."""
    probes: tuple[tuple[int, float, float, float, float, float, float], ...]
    """(stream, load factor, p99 TTFT, p99 ITL, worst gap, share of passes with decodes
    over the ITL target, share of prompt tokens the prefix cache served or NaN without
    prefix caching) of every probe, in the order run."""
    factors: tuple[float, ...] = ()
    """Each stream's capacity as a multiple of the scenario's own load."""
    unbounded: tuple[int, ...] = ()
    """The streams that met the SLO at every load the search tried: their capacity is a
    lower bound (a stream too short for any load to bind)."""
    flattens: str | None = None
    """For a table's flat twin, the name of the table it flattens (what it is measured against)."""
    serving: tuple[str, str] | None = None
    """How an engine serves the policy (``BudgetPolicy.serving``); None for a diagnostic."""

    @property
    def capacity(self) -> float:
        return float(np.mean(self.per_stream)) if self.per_stream else 0.0

    @property
    def ci95(self) -> float:
        return ci95_half(self.per_stream)

    def text(self, digits: int = 2) -> str:
        """The capacity ± its 95% interval; the capacity alone on one stream (no interval);
        ">=" before it where a stream met the SLO at every load tried (a lower bound)."""
        low = ">= " if self.unbounded else ""
        if len(self.per_stream) < 2:
            return f"{low}{self.capacity:.{digits}f}"
        return f"{low}{self.capacity:.{digits}f} ± {self.ci95:.{digits}f}"

    def at_capacity(self) -> tuple[float, float]:
        """(the worst gap, seconds, the largest over the streams; the share of passes with
        decodes slower than the ITL target, averaged over the streams) at each stream's
        capacity: the stalls users feel where the policy is judged. NaN where no stream
        meets the SLO at any load."""
        at = self.probes_at_capacity()
        if not at:
            return math.nan, math.nan
        slow = [pr[5] for pr in at if not math.isnan(pr[5])]  # NaN: no pass with decodes
        return max(pr[4] for pr in at), (float(np.mean(slow)) if slow else math.nan)

    def probes_at_capacity(self) -> list:
        """The probe at each stream's capacity (the last run at that load), for the streams
        that meet the SLO at some load."""
        at = []
        for i, f in enumerate(self.factors):
            found = [pr for pr in self.probes if pr[0] == i and pr[1] == f]
            if f > 0 and found:
                at.append(found[-1])
        return at

    def hit_rate_at_capacity(self) -> float:
        """The share of prompt tokens the prefix cache served at each stream's capacity, the
        mean over the streams (NaN without prefix caching, or where none meets the SLO)."""
        at = [pr[6] for pr in self.probes_at_capacity() if not math.isnan(pr[6])]
        return float(np.mean(at)) if at else math.nan

    def stall_text(self) -> str:
        """The worst gap and the slow-pass share at capacity, as a report's cell."""
        gap, slow = self.at_capacity()
        if math.isnan(gap):
            return "-"
        return f"{gap * 1000:,.0f} ms, {slow:.1%}" if not math.isnan(slow) else f"{gap * 1000:,.0f} ms"

    def as_json(self) -> dict:
        gap, slow = self.at_capacity()
        out = {"capacity_rps": self.capacity, "ci95": self.ci95,
               "per_stream": list(self.per_stream), "kind": self.kind,
               "itl_max_s_at_capacity": None if math.isnan(gap) else gap,
               "slow_pass_share_at_capacity": None if math.isnan(slow) else slow}
        if self.unbounded:
            out["unbounded_streams"] = list(self.unbounded)
        hits = self.hit_rate_at_capacity()
        if not math.isnan(hits):
            out["prefix_hit_rate_tokens_at_capacity"] = hits
        return out


MAX_PROBE_REQUESTS = 20000


def probe_stream(scenario: Scenario, stream: int, streams: int, num_requests: int, factor: float,
                 min_duration_s: float = 0.0, seed_base: int = CAPACITY_SEEDS):
    """(the scenario at ``factor`` times its load, the arrivals of its stream ``stream``) as
    a capacity search probes them. A synthetic stream lasts at least ``min_duration_s``
    (more requests at higher loads): a short stream at a high rate ends before a loose TTFT
    target can bind."""
    sc = scenario.at_load(factor)
    if min_duration_s and not sc.trace:
        num_requests = int(min(max(num_requests, sc.rate * min_duration_s), MAX_PROBE_REQUESTS))
    return sc, sc.stream(stream, streams, seed_base, num_requests)


def _probe(scenario: Scenario, policy, stream: int, streams: int, num_requests: int,
           factor: float, min_duration_s: float = 0.0,
           seed_base: int = CAPACITY_SEEDS) -> tuple[bool, tuple[float, ...], float]:
    """(meets the SLO, (p99 TTFT, p99 ITL, worst gap, slow-pass share, prefix-cache hit
    rate in tokens), arrival rate in req/s) of one stream at a load (:func:`probe_stream`)."""
    sc, w = probe_stream(scenario, stream, streams, num_requests, factor, min_duration_s, seed_base)
    policy.reset()
    s = sc.simulator(w).run(policy).summary(sc.slo())
    itl = 0.0 if math.isnan(s["itl_p99_s"]) else s["itl_p99_s"]
    rate = sc.rate if not sc.trace else (w.mean_rate if len(w) > 1 else 0.0)
    gap = 0.0 if math.isnan(s["itl_max_s"]) else s["itl_max_s"]
    figures = (s["ttft_p99_s"], itl, gap, s["slow_pass_share"],
               s.get("prefix_hit_rate_tokens", math.nan))
    return meets_slo(sc, s["ttft_p99_s"], itl), figures, rate


def meets_slo(scenario: Scenario, ttft_p99_s: float, itl_p99_s: float) -> bool:
    """Whether a probe's p99 TTFT and p99 ITL meet the scenario's targets."""
    return meets_p99(ttft_p99_s, itl_p99_s, scenario.slo_ttft_s, scenario.slo_itl_s)


BRACKET_STEPS = 24
"""Most loads the bracketing tries each way from its start (2^23 times the scenario's load
and 2^-23 of it in steps of 2): a --rate far from the capacity is still found."""


def stream_capacity(scenario: Scenario, policy, stream: int, streams: int, num_requests: int,
                    rel_tol: float = 0.02, max_probes: int = 16, start: float = 1.0,
                    step: float = 2.0, min_duration_s: float = 0.0, seed_base: int = CAPACITY_SEEDS,
                    progress=None):
    """One stream's (capacity in req/s, load factor, probes): bracket the SLO's boundary by
    dividing or multiplying the load by ``step`` from ``start`` times the scenario's own,
    then bisect to ``rel_tol`` (at most ``max_probes`` bisection probes; :func:`search_load`).
    A stream that meets the SLO at every load tried returns the highest
    (``CapacityResult.unbounded`` flags it); one that meets it at none, 0. Synthetic
    streams are seeded from ``seed_base``; ``progress`` (a bar), where given, counts the
    probes."""
    probes, rates = [], {}

    def meets(factor: float) -> bool:
        ok, figures, rate = _probe(scenario, policy, stream, streams, num_requests, factor,
                                   min_duration_s, seed_base)
        probes.append((stream, factor, *figures))
        rates[factor] = rate
        if progress is not None:
            progress.update(1)
        return ok

    # The loads a scenario accepts: rates (or trace speed-ups) in [1/MAX_RATE, MAX_RATE].
    base = scenario.rate_scale if scenario.trace else scenario.rate
    lo = search_load(meets, start, step, rel_tol, max_probes, 1 / (MAX_RATE * base), MAX_RATE / base)
    return (rates[lo], lo, probes) if lo else (0.0, 0.0, probes)


def search_load(meets, start: float = 1.0, step: float = 2.0, rel_tol: float = 0.02,
                max_probes: int = 16, low: float = 0.0, high: float = math.inf) -> float:
    """The highest load factor at which ``meets(factor)`` holds (:func:`load_probes`, each
    probe asked of ``meets`` in turn)."""
    probes = load_probes(start, step, rel_tol, max_probes, low, high)
    try:
        factor = next(probes)
        while True:
            factor = probes.send(meets(factor))
    except StopIteration as end:
        return end.value


def load_probes(start: float = 1.0, step: float = 2.0, rel_tol: float = 0.02,
                max_probes: int = 16, low: float = 0.0, high: float = math.inf):
    """The search for the highest load factor that meets the SLO, as a generator: it
    yields the next factor to probe, is sent whether that probe met, and returns the
    factor found. It brackets the boundary by dividing or multiplying by ``step`` from
    ``start`` (at most :data:`BRACKET_STEPS` tries, within [``low``, ``high``]), then
    bisects to ``rel_tol`` (at most ``max_probes`` probes). Where every load tried meets,
    the highest; 0 where none does. A simulated stream's search asks the simulator
    (:func:`stream_capacity`); a real engine's takes turns with other searches, probe by
    probe (``benchmarks/engine_capacity.py``)."""
    lo, hi, factor = None, None, start
    for _ in range(BRACKET_STEPS):  # bracket: lower until it meets, raise until it fails
        factor = min(max(factor, low), high)
        if (yield factor):
            lo = factor
            if hi is not None or factor >= high:
                break
            factor *= step
        else:
            hi = factor
            if lo is not None or factor <= low:
                break
            factor /= step
    if lo is None:
        return 0.0
    hi = hi if hi is not None else lo
    for _ in range(max_probes):  # max_probes bounds the bisection, whatever the bracketing took
        if hi - lo <= rel_tol * hi:
            break
        mid = (lo + hi) / 2
        if (yield mid):
            lo = mid
        else:
            hi = mid
    return lo


def capacity(scenario: Scenario, policy, seeds: int = 5, num_requests: int = 600,
             rel_tol: float = 0.02, max_probes: int = 16, executor=None,
             progress=None) -> CapacityResult:
    """A policy's capacity over ``seeds`` streams (see the module docstring)."""
    return capacities(scenario, [policy], seeds, num_requests, rel_tol, max_probes, executor,
                      progress)[policy.name]


def capacities(scenario: Scenario, policies, seeds: int, num_requests: int, rel_tol: float = 0.02,
               max_probes: int = 16, executor=None, progress=None) -> dict[str, CapacityResult]:
    """Every policy's capacity, each stream's search a task of ``executor``."""
    found = capacity_sweep([(scenario, p) for p in policies], seeds, num_requests, rel_tol,
                           max_probes, executor, progress)
    return {r.policy: r for r in found}


def capacity_sweep(pairs, seeds: int, num_requests: int, rel_tol: float = 0.02,
                   max_probes: int = 16, executor=None, progress=None,
                   starts: list | None = None, min_duration_s: float = 0.0,
                   seed_base: int = CAPACITY_SEEDS) -> list[CapacityResult]:
    """Capacities of (scenario, policy) pairs, in order, every stream's search fanned out
    at once. ``starts`` may give each pair its streams' first load factors (a hint such
    as another policy's capacity), searched then in steps of 1.25 instead of 2.
    ``seed_base``: the synthetic streams' first seed (others than the evaluation's keep a
    choice made on them apart from the figures that judge it)."""
    tasks = []
    for k, (sc, p) in enumerate(pairs):
        for i in range(seeds):
            hint = starts[k][i] if starts and starts[k] and starts[k][i] > 0 else None
            tasks.append((sc, p, i, seeds, num_requests, rel_tol, max_probes,
                          hint or 1.0, 1.25 if hint else 2.0, min_duration_s, seed_base))
    found = (executor or LocalExecutor()).map(stream_capacity, tasks, progress)
    out = []
    for k, (sc, p) in enumerate(pairs):
        runs = found[k * seeds:(k + 1) * seeds]
        unbounded = tuple(i for i, (_, _, probes) in enumerate(runs)
                          if all(meets_slo(sc, t, it) for _, _, t, it, *_ in probes))
        out.append(CapacityResult(p.name, p.kind, tuple(c for c, _, _ in runs),
                                  tuple(pr for _, _, probes in runs for pr in probes),
                                  tuple(f for _, f, _ in runs), unbounded,
                                  getattr(p, "flattens", None), serving_of(p)))
    return out


def quarter_steps_around(budget: int, floor: int) -> list[int]:
    """The fine ladder's rungs within an octave of ``budget`` that are not powers of two."""
    k = FINE_LADDER.index(budget)
    return [FINE_LADDER[j] for j in range(max(k - 3, 0), min(k + 4, len(FINE_LADDER)))
            if FINE_LADDER[j] not in POWERS_OF_TWO and FINE_LADDER[j] >= floor]


def best_rung(results: dict[int, CapacityResult], streams: list[int] | None = None) -> int:
    """The budget of highest mean capacity, over ``streams`` (default all; ties: the
    smaller budget)."""
    def mean(b: int) -> float:
        r = results[b]
        return r.capacity if streams is None else float(np.mean([r.per_stream[j] for j in streams]))

    return max(results, key=lambda b: (mean(b), -b))


@dataclass
class CapacityStudy:
    """One scenario's capacities: the policies asked for, and every fine-ladder static
    budget measured on the way to the hindsight-best one."""

    scenario: Scenario
    policies: dict[str, CapacityResult]
    rungs: dict[int, CapacityResult]

    @property
    def best_budget(self) -> int:
        return best_rung(self.rungs)

    @property
    def best(self) -> CapacityResult:
        return self.rungs[self.best_budget]

    def verdict(self, name: str):
        return paired_verdict(self.policies[name].per_stream, self.best.per_stream)

    def flat_verdicts(self) -> list[tuple[str, str, object]]:
        """(table, its ``table-flat:`` twin, the table against the twin paired stream by
        stream) for each flat twin whose table was measured too: what the table's cells'
        dependence on state is worth on these streams."""
        out = []
        for flat, result in self.policies.items():
            table = result.flattens
            if table in self.policies:
                out.append((table, flat, paired_verdict(self.policies[table].per_stream,
                                                         self.policies[flat].per_stream)))
        return out

    def best_rule(self) -> str | None:
        """The time-budget rule of highest capacity among the policies measured (the one a
        careful user would serve here, picked in hindsight); None where none was."""
        rules = [n for n, r in self.policies.items()
                 if r.kind == "rule" and getattr(BY_SPEC.get(n.split(":")[0]), "acts_in_time", False)]
        return max(rules, key=lambda n: self.policies[n].capacity, default=None)

    def room_verdicts(self) -> list[tuple[str, str, object]]:
        """(rollout reference, the rule it is over, the reference against that rule paired
        stream by stream) for each rollout measured with its rule: the room a controller
        that sees the future finds beyond the rule."""
        out = []
        for name, result in self.policies.items():
            head, _, rest = name.partition(":")
            base = rest.partition(":")[2]
            if head == RolloutPolicy.spec and base in self.policies:
                out.append((name, base, paired_verdict(result.per_stream,
                                                       self.policies[base].per_stream)))
        return out

    @property
    def has_held_out(self) -> bool:
        """Whether there is a held-out pick: it needs another stream to pick on."""
        return len(self.best.per_stream) > 1

    def held_out_static(self) -> tuple[CapacityResult, tuple[int, ...]]:
        """(each stream's capacity under the rung that is best on the other streams, those
        rungs): the fixed number a user could pick from past arrivals, judged on arrivals
        the pick did not see. The hindsight-best rung is picked on the streams it is
        judged on, so noise in a jagged ladder counts in its favour; the difference
        between the two is that pick's luck. (The quarter steps measured are the ones
        around the best rung of all streams: the held-out pick chooses among them.) With
        one stream it is the hindsight pick."""
        n = len(self.best.per_stream)
        if not self.has_held_out:
            return self.best, (self.best_budget,)
        picks = tuple(best_rung(self.rungs, [j for j in range(n) if j != i]) for i in range(n))
        per = [self.rungs[b].per_stream[i] for i, b in enumerate(picks)]
        return CapacityResult("static:held-out", "static", tuple(per), ()), picks

    def held_out_verdict(self, name: str):
        """A policy against :meth:`held_out_static`, paired stream by stream."""
        return paired_verdict(self.policies[name].per_stream, self.held_out_static()[0].per_stream)

    def as_json(self) -> dict:
        out = {n: {**r.as_json(), "verdict": str(self.verdict(n))} for n, r in self.policies.items()}
        for table, flat, v in self.flat_verdicts():
            out[table].setdefault("against_flat", {})[flat] = str(v)
        for ref, rule, v in self.room_verdicts():
            out[ref]["against_rule"] = {rule: str(v), "per_stream": [
                a / b - 1.0 if b > 0 else None for a, b in zip(self.policies[ref].per_stream,
                                                               self.policies[rule].per_stream)]}
        out["_hindsight_static"] = {"budget": self.best_budget, "capacity": self.best.capacity,
                                    "ci95": self.best.ci95}
        held, picks = self.held_out_static()
        out["_held_out_static"] = None if not self.has_held_out else {
            "picks": list(picks), "capacity": held.capacity, "ci95": held.ci95,
            "per_stream": list(held.per_stream)}
        out["_ladder"] = {str(b): r.as_json() for b, r in self.rungs.items()}
        return out


def capacity_studies(jobs: list[tuple[Scenario, list]], seeds: int, num_requests: int,
                     executor=None, progress=None, **kwargs) -> list[CapacityStudy]:
    """For each (scenario, policies): every policy's capacity and the fine-ladder search
    for the hindsight-best static budget. The policies and the powers of two of every
    scenario are one fan-out; the quarter steps around each scenario's best, a second."""
    def sweep(pairs):
        return capacity_sweep(pairs, seeds, num_requests, executor=executor, progress=progress,
                              **kwargs) if pairs else []

    # (job, scenario, policy, whether it is a ladder rung)
    pairs = [(j, sc, p, False) for j, (sc, ps) in enumerate(jobs) for p in ps]
    pairs += [(j, sc, StaticPolicy(b), True) for j, (sc, _) in enumerate(jobs)
              for b in POWERS_OF_TWO if b >= sc.max_num_seqs]
    studies = [CapacityStudy(sc, {}, {}) for sc, _ in jobs]
    for (j, _, p, rung), r in zip(pairs, sweep([(sc, p) for _, sc, p, _ in pairs])):
        if rung:
            studies[j].rungs[p.tokens] = r
        else:
            studies[j].policies[p.name] = r
    fine = [(j, st.scenario, StaticPolicy(b)) for j, st in enumerate(studies)
            for b in quarter_steps_around(st.best_budget, st.scenario.max_num_seqs)]
    for (j, _, p), r in zip(fine, sweep([(sc, p) for _, sc, p in fine])):
        studies[j].rungs[p.tokens] = r
    for st in studies:
        st.rungs = dict(sorted(st.rungs.items()))
    return studies


def add_references(studies: list[CapacityStudy], seeds: int, num_requests: int, executor=None,
                   progress=None, **kwargs) -> None:
    """Each study's reference controller, its capacity searched from its base's, added to
    ``study.policies``: the rollout over the study's best rule (``rollout:HORIZON:RULE``,
    a horizon of :data:`HORIZON_TTFT` TTFT targets) where a time-budget rule was measured,
    else MPC over the hindsight-best static budget (``reference:BUDGET``)."""
    refs, starts = [], []
    for st in studies:
        rule = st.best_rule()
        if rule is None:
            refs.append(reference_for(st.scenario, st.best_budget))
            starts.append(list(st.best.factors))
        else:
            refs.append(make_policy(f"{RolloutPolicy.spec}:{HORIZON_TTFT * st.scenario.slo_ttft_s:g}:{rule}",
                                    st.scenario))
            starts.append(list(st.policies[rule].factors))
    found = capacity_sweep([(st.scenario, r) for st, r in zip(studies, refs)], seeds, num_requests,
                           executor=executor, progress=progress, starts=starts, **kwargs)
    for st, r in zip(studies, found):
        st.policies[r.policy] = r
