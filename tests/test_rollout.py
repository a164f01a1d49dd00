"""The rollout reference over a rule (``rollout:HORIZON_S:RULE``): the room a controller that
sees the future could add to the rule, scored as capacity judges."""

from __future__ import annotations

import pytest

from envs.errors import ConfigError
from envs.scenario import Scenario
from policies.specs import make_policy
from tests.conftest import make_sim

A100 = Scenario(hardware="a100-80g", model="llama-3-8b", slo_ttft_s=1.0, slo_itl_s=0.05)


def test_rollouts_share_the_future_and_leave_the_run_as_it_was():
    """Common random numbers: two rollouts of the same candidate from the same state give
    the same score, and scoring moves nothing in the run it forks."""
    sim = A100.simulator(A100.with_fields(rate=12.0).stream(0, 1, 7, 60))
    ref = make_policy("rollout:2:time-budget-deadline-kv:16", A100)
    for _ in range(40):
        assert sim.advance()
        sim.step(ref(sim.state()))
    assert sim.advance()  # a decision pending: where the reference scores its candidates
    before = (sim.now, sim.pass_index, sim.state().running_decodes, len(sim.waiting))
    for c in (ref.base, *ref.candidates[::5]):
        assert ref.score(sim, c) == ref.score(sim, c)
    assert (sim.now, sim.pass_index, sim.state().running_decodes, len(sim.waiting)) == before


def test_where_a_deviation_helps_the_rollout_takes_it():
    """Passes held to a quarter of the ITL target prefill long prompts too slowly for a 1 s
    TTFT target; the rollout over that rule spends more where a deadline is at stake and
    misses fewer deadlines on the same arrivals, with no more slow tokens beyond 1%."""
    reqs = [(0.0, 100, 400)] * 8 + [(1.0 + 1.5 * i, 6000, 20) for i in range(6)]
    slo = A100.slo()
    runs = {}
    for spec in ("time-budget:0.25", "rollout:3:time-budget:0.25"):
        policy = make_policy(spec, A100)
        res = make_sim(reqs, hardware="a100-80g", model="llama-3-8b").run(policy)
        runs[spec] = (int((res.ttft_s > slo.ttft_s).sum()), res.summary(slo), policy)
    (base_miss, _, _), (ref_miss, ref_s, ref) = runs.values()
    assert base_miss >= 4 and ref_miss < base_miss
    assert ref_s["itl_p99_s"] <= slo.itl_s
    assert set(ref.choices) - {"time-budget:0.25"}  # it deviated


def test_where_nothing_helps_the_rollout_is_its_rule():
    """Lone requests far apart, nothing decoding while a prompt prefills: every candidate
    gives the same budget, the ties go to the rule, and the run is the rule's pass for pass."""
    reqs = [(5.0 * i, 3000, 30) for i in range(4)]
    base = make_sim(reqs, hardware="a100-80g", model="llama-3-8b").run(
        make_policy("time-budget-deadline-kv:16", A100))
    ref = make_policy("rollout:2:time-budget-deadline-kv:16", A100)
    got = make_sim(reqs, hardware="a100-80g", model="llama-3-8b").run(ref)
    assert list(ref.choices) == ["time-budget-deadline-kv:16"]
    assert got.pass_duration_s.tolist() == base.pass_duration_s.tolist()
    assert got.ttft_s.tolist() == base.ttft_s.tolist()


@pytest.mark.parametrize("spec, needle", [
    ("rollout:10", "wrong number of arguments: rollout:HORIZON_S:RULE"),
    ("rollout:x:time-budget", "HORIZON_S seconds"),
    ("rollout:10:static:2048", "RULE must be a rule or a table, not static"),
    ("rollout:10:reference:2048", "RULE must be a rule or a table, not reference"),
    ("rollout:10:time-budgte", "did you mean"),
])
def test_bad_rollout_specs_are_one_line(spec, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        make_policy(spec, A100)
    assert "\n" not in str(err.value)


# --- sampled futures: the rollout blind to the stream's own future ------------------------


def _advanced(sc: Scenario, spec: str, passes: int = 40):
    sim = sc.simulator(sc.with_fields(rate=12.0).stream(0, 1, 7, 120))
    policy = make_policy(spec, sc)
    policy.reset()
    for _ in range(passes):
        assert sim.advance()
        sim.step(policy(sim.state()))
    assert sim.advance()
    return sim, policy


def test_a_fork_given_the_stream_s_own_future_runs_as_a_plain_fork():
    """``fork(future=...)`` with this stream's own requests is the plain fork, pass for
    pass; with another future, the requests still to come are that future's from now on,
    and the simulator forked is untouched."""
    sim, rule = _advanced(A100, "time-budget-deadline-kv:16")
    own, plain = sim.fork(future=sim.workload), sim.fork()
    for f in (own, plain):
        while f.advance():
            f.step(rule(f.state()))
    assert own.now == plain.now and own.pass_index == plain.pass_index
    assert own.finished == plain.finished
    other = A100.with_fields(rate=3.0).stream(0, 1, 99, 120)
    k = sim._next_arrival
    g = sim.fork(future=other)
    later = other.arrival_s[other.arrival_s >= sim.now]
    assert g.workload.arrival_s[:k].tolist() == sim.workload.arrival_s[:k].tolist()
    assert g.workload.arrival_s[k:].tolist() == later.tolist()
    assert len(sim.workload) == 120 and sim._next_arrival == k


def test_sampled_stretches_are_one_horizon_long_and_miss_the_horizon_to_come():
    """Each stretch's arrivals lie in [now, now + horizon) and come from a place in the
    stream away from the next horizon, so the rollout cannot read the arrivals about to come."""
    sim, ref = _advanced(A100, "rollout-sampled:3:2:time-budget-deadline-kv:16", passes=60)
    a, now, h = sim.workload.arrival_s, sim.now, ref.horizon_s
    coming = set(a[(a >= now) & (a < now + h)].round(9).tolist())
    for _ in range(20):
        w = ref.stretch(sim)
        assert ((w.arrival_s >= now) & (w.arrival_s < now + h)).all()
        if coming and len(w):
            assert w.arrival_s.round(9).tolist() != sorted(coming)


def test_sampled_rollouts_share_their_stretches_and_leave_the_run_as_it_was():
    """Within a re-plan every candidate meets the same sampled stretches (common random
    numbers): the same candidate scores the same twice, and scoring moves nothing."""
    sim, ref = _advanced(A100, "rollout-sampled:2:2:time-budget-deadline-kv:16")
    before = (sim.now, sim.pass_index, len(sim.waiting))
    for c in (ref.base, *ref.candidates[::6]):
        assert ref.score(sim, c) == ref.score(sim, c)
    assert (sim.now, sim.pass_index, len(sim.waiting)) == before


def test_with_nothing_to_gain_the_sampled_rollout_is_its_rule():
    reqs = [(5.0 * i, 3000, 30) for i in range(4)]
    base = make_sim(reqs, hardware="a100-80g", model="llama-3-8b").run(
        make_policy("time-budget-deadline-kv:16", A100))
    ref = make_policy("rollout-sampled:2:2:time-budget-deadline-kv:16", A100)
    got = make_sim(reqs, hardware="a100-80g", model="llama-3-8b").run(ref)
    assert list(ref.choices) == ["time-budget-deadline-kv:16"]
    assert got.ttft_s.tolist() == base.ttft_s.tolist()


@pytest.mark.parametrize("spec, needle", [
    ("rollout-sampled:2:time-budget", "wrong number of arguments"),
    ("rollout-sampled:0:2:time-budget", "FUTURES"),
    ("rollout-sampled:x:2:time-budget", "FUTURES"),
])
def test_bad_sampled_rollout_specs_are_one_line(spec, needle):
    with pytest.raises(ConfigError) as err:
        make_policy(spec, A100)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_fork_given_each_request_s_own_output_runs_as_a_plain_fork():
    """``fork(outputs=...)`` with the requests' own lengths is the plain fork; with other
    lengths the requests in flight finish after those, never before their next token."""
    sim, rule = _advanced(A100, "time-budget-deadline-kv:16")
    live = sim.generated_so_far()
    assert live and all(g >= 0 for g in live.values())
    by_rid = {r.rid: r for r in [*sim.waiting, *sim.prefilling, *sim._decodes.values()]}
    own = sim.fork(outputs={rid: by_rid[rid].output for rid in live})
    plain = sim.fork()
    for f in (own, plain):
        while f.advance():
            f.step(rule(f.state()))
    assert own.now == plain.now and own.pass_index == plain.pass_index
    decoding = len(sim._decodes)
    assert decoding
    short = sim.fork(outputs={rid: 1 for rid in live})  # raised to one token more each
    short.step(rule(short.state()))  # every decode in flight samples its last token
    assert short.finished == sim.finished + decoding
    assert len(sim._decodes) == decoding  # the simulator forked is untouched


def test_sampled_output_lengths_are_longer_than_what_each_request_has_generated():
    sim, ref = _advanced(A100, "rollout-sampled:2:2:time-budget-deadline-kv:16", passes=80)
    live = sim.generated_so_far()
    for _ in range(5):
        drawn = ref.outputs(sim)
        assert drawn.keys() == live.keys()
        assert all(drawn[rid] > g for rid, g in live.items())
