"""Invariants of the simulator over random workloads, budgets and cache sizes (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.cost import PassShape, price
from envs.engine import EngineConfig, Simulator
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL

requests = st.lists(
    st.tuples(st.floats(0, 2.0, allow_nan=False), st.integers(1, 1500), st.integers(1, 120)),
    min_size=1, max_size=30)


@st.composite
def scenarios(draw):
    reqs = sorted(draw(requests))
    bs = 16
    need = max(-(-(p + o) // bs) for _, p, o in reqs)
    blocks = draw(st.integers(need, need * 4))
    cfg = EngineConfig(num_kv_blocks=blocks, max_num_seqs=draw(st.integers(1, 12)),
                       long_prefill_token_threshold=draw(st.sampled_from([0, 0, 64, 300])))
    extra = draw(st.lists(st.sampled_from([0, 1, 16, 100, 512, 4096]), min_size=1, max_size=8))
    return reqs, cfg, extra


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants(scenario):
    reqs, cfg, extra = scenario
    arr, prm, out = zip(*reqs)
    w = Workload.from_arrays(arr, prm, out)
    sim = Simulator(TOY_HW, TOY_MODEL, w, cfg, record_shapes=True)
    i = 0
    while sim.advance():
        sim.audit()
        sim.step(max(sim.num_decodes, 1) + extra[i % len(extra)])
        i += 1
        sim.audit()  # running sums agree with the requests; KV blocks <= capacity
    res = sim.result()
    recomputed = sum(r.recomputed for r in sim.requests)

    # Every request finishes once arrivals stop, with exactly its output tokens.
    assert sim.done and res.finished.all()
    assert [r.generated for r in sim.requests] == list(out)
    # Tokens are conserved: one first token per request, one per decode slot of each
    # pass, one per resumption after a preemption.
    resumes = sum(len(r.resume_gaps) for r in sim.requests)
    assert len(w) + int(res.pass_decodes.sum()) + resumes == sum(out)
    # Every prompt token is prefilled once, plus exactly what preemptions threw away.
    assert int(res.pass_prefill_tokens.sum()) == sum(prm) + recomputed
    # KV blocks in use never exceed the capacity.
    assert res.kv_used_blocks.max() <= cfg.num_kv_blocks
    # No pass exceeds its budget; every pass is priced by the pure function.
    decided = res.pass_budget >= 0
    tokens = res.pass_decodes + res.pass_prefill_tokens
    assert np.all(tokens[decided] <= res.pass_budget[decided])
    expected = [price(sim.roofline, s).total_s for s in sim.shapes]
    np.testing.assert_allclose(sim.pass_durations(), expected, rtol=1e-12)
    # No token before the prompt is prefilled: the first token cannot come sooner than
    # the prompt's own arithmetic alone would take, and never before arrival.
    for r in sim.requests:
        alone = price(sim.roofline, PassShape.of([], [(r.prompt, 0)]))
        assert r.first_token_s - r.arrival >= alone.compute_s * (1 - 1e-12)
        assert r.finish_s >= r.first_token_s
    # Time moves forward.
    assert np.all(np.diff(res.pass_end_s) > 0)


@settings(max_examples=30, deadline=None)
@given(reqs=requests, budget=st.sampled_from([256, 512, 2048]))
def test_fast_and_stepwise_runs_agree(reqs, budget):
    """run() and an explicit advance()/step() loop give identical metrics."""
    arr, prm, out = zip(*sorted(reqs))
    w = Workload.from_arrays(arr, prm, out)
    a = Simulator(TOY_HW, TOY_MODEL, w).run(lambda s: budget).summary()
    sim = Simulator(TOY_HW, TOY_MODEL, w)
    while sim.advance():
        sim.step(budget)
    b = sim.result().summary()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]) or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
