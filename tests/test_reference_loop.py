"""The simulator against an independent plain loop (``benchmarks/reference_loop.py``):
where the KV cache never runs out and no chunk is capped, both give every request the
same first-token and finish times, and every pass the same duration and decodes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.reference_loop import simulate as plain_loop
from envs.engine import EngineConfig, Simulator
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL

requests = st.lists(
    st.tuples(st.floats(0, 3.0, allow_nan=False), st.integers(1, 3000), st.integers(1, 200)),
    min_size=1, max_size=40)


def both(reqs, budget: int, max_num_seqs: int):
    arr, prm, out = (list(c) for c in zip(*sorted(reqs)))
    w = Workload.from_arrays(arr, prm, out)
    # Enough blocks for every request at once: nothing is ever preempted.
    blocks = sum(-(-(p + o) // 16) for p, o in zip(prm, out))
    cfg = EngineConfig(num_kv_blocks=blocks, max_num_seqs=max_num_seqs)
    sim = Simulator(TOY_HW, TOY_MODEL, w, cfg)
    res = sim.run(lambda state: budget)
    return sim, res, plain_loop(arr, prm, out, sim.cost, budget, max_num_seqs)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, budget=st.sampled_from([1, 16, 100, 512, 2048, 8192]),
       max_num_seqs=st.integers(1, 16))
def test_simulator_matches_the_plain_loop(reqs, budget, max_num_seqs):
    budget = max(budget, max_num_seqs)  # a static budget must fit every running decode
    sim, res, (first, finish, durations, decodes) = both(reqs, budget, max_num_seqs)
    assert sum(r.preemptions for r in sim.requests) == 0
    np.testing.assert_allclose([r.first_token_s for r in sim.requests], first, rtol=1e-9)
    np.testing.assert_allclose([r.finish_s for r in sim.requests], finish, rtol=1e-9)
    np.testing.assert_allclose(sim.pass_durations(), durations, rtol=1e-9)
    np.testing.assert_array_equal(res.pass_decodes, decodes)


def test_a_hand_case_two_requests_share_one_pass():
    # Two prompts of 100 and 50 tokens arrive together under a 200-token budget: one pass
    # prefills both, both sample their first token at its end, then decode together.
    sim, res, (first, finish, durations, decodes) = both([(0.0, 50, 2), (0.0, 100, 3)], 200, 4)
    assert decodes == [0, 2, 1]  # pass 0 prefills; pass 1 decodes both; pass 2 the longer
    # The toy cost model: weights 2 ms, 2.56e-10 s per KV token read or written, 20 us per
    # token, 5.12e-12 s per attention pair, no overlap, 1 ms fixed. Pass 0 is compute-bound:
    # 150 tokens and 50*51/2 + 100*101/2 = 6325 pairs. Passes 1 and 2 are memory-bound,
    # their decodes reading 50 + 100 and then 101 tokens of context.
    assert durations == pytest.approx([150 * 2e-5 + 6325 * 5.12e-12 + 0.001,
                                       0.002 + (150 + 2) * 2.56e-10 + 0.001,
                                       0.002 + (101 + 1) * 2.56e-10 + 0.001], rel=1e-12)
    assert first[0] == first[1] == durations[0]
    assert finish[0] == durations[0] + durations[1]
    assert finish[1] == sum(durations)
    assert [r.first_token_s for r in sim.requests] == first
