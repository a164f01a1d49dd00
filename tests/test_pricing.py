"""The pricing contract (envs.pricing): hand-computed prices, the closed-form roots against
the price itself, and every other place that prices a pass against it: the roofline's
breakdown, the simulator's unrolled fast paths over many batch shapes (hypothesis), the
table runtime after a JSON round trip, and the calibration fit's formula."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import pricing
from envs.cost import PassShape, Roofline, price
from envs.engine import EngineConfig, Simulator
from envs.pricing import Coefficients
from envs.profiles import get_hardware, get_model
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL
from tests.strategies import engine_workloads

TOY = Coefficients(weights_s=2e-3, kv_s_per_token=256e-12, token_s=2e-5, pair_s=512e-14,
                   exposed=0.5, fixed_s=1e-3, serial_s_per_token=1e-6)
"""TOY_HW x TOY_MODEL's roofline multiplied out, with half the shorter side exposed and a
microsecond per token outside the max (numbers a hand can follow)."""


def test_pass_price_by_hand():
    # 2 decodes of contexts 100 and 300, a 50-token chunk after no prefix (1,275 pairs):
    # memory  = 2e-3 + 256e-12 * (400 + 0 + 2 + 50)            = 2.000115712e-3
    # compute = 2e-5 * 52 + 512e-14 * (400 + 2 + 1275)         = 1.040085862e-3
    # outside = 1e-3 + 1e-6 * 52                               = 1.052e-3
    # total   = memory + 0.5 * compute + outside
    memory, compute, outside = pricing.pass_times(TOY, 2, 400, 50, 0, 1275)
    assert memory == pytest.approx(2.000115712e-3, rel=1e-12)
    assert compute == pytest.approx(1.04e-3 + 512e-14 * 1677, rel=1e-12)
    assert outside == pytest.approx(1.052e-3, rel=1e-12)
    assert pricing.pass_price(TOY, 2, 400, 50, 0, 1275) == pytest.approx(
        memory + 0.5 * compute + outside, rel=1e-12)
    assert pricing.chunk_price(TOY, 2, 400, 50) == pricing.pass_price(TOY, 2, 400, 50, 0, 1275)
    # Compute-bound: the longer side is compute, half of memory adds.
    m, c, o = pricing.pass_times(TOY, 0, 0, 1000, 500, pricing.chunk_attention_pairs(1000, 500))
    assert c > m and pricing.combine(m, c, 0.5, o) == c + 0.5 * m + o


def test_coefficients_round_trip_a_table_s_cost_block():
    cost = TOY.as_dict()
    assert list(cost) == list(pricing.COST_FIELDS)
    assert Coefficients.of(cost) == TOY
    assert Coefficients.of({**cost, "exposed": 1}) == TOY._replace(exposed=1.0)


coefficients = st.builds(
    Coefficients,
    weights_s=st.floats(1e-5, 0.05), kv_s_per_token=st.floats(1e-12, 1e-7),
    token_s=st.floats(1e-8, 1e-4), pair_s=st.floats(1e-15, 1e-9), exposed=st.floats(0, 1),
    fixed_s=st.floats(0, 0.01), serial_s_per_token=st.sampled_from([0.0, 1e-8, 1e-6]))


@settings(max_examples=400, deadline=None)
@given(c=coefficients, n=st.integers(0, 300), ctx_per=st.integers(0, 20000),
       q=st.integers(0, 100000), seconds=st.floats(1e-4, 2.0), cap=st.integers(0, 1 << 16))
def test_chunk_within_is_the_integer_boundary_of_the_price(c, n, ctx_per, q, seconds, cap):
    x = pricing.chunk_within(c, n, n * ctx_per, seconds, q, cap)
    assert 0 <= x <= max(cap, 0)
    if x == 0:
        assert cap <= 0 or pricing.chunk_price(c, n, n * ctx_per, 1, q) > seconds
    else:
        assert pricing.chunk_price(c, n, n * ctx_per, x, q) <= seconds
        assert x == cap or pricing.chunk_price(c, n, n * ctx_per, x + 1, q) > seconds
    budget = pricing.time_budget(c, n, n * ctx_per, q, seconds, cap)
    assert budget == (cap if n == 0 else n + pricing.chunk_within(c, n, n * ctx_per, seconds, q,
                                                                   max(cap - n, 0)))


@settings(max_examples=300, deadline=None)
@given(c=coefficients, n=st.integers(1, 300), ctx_per=st.integers(1, 20000), q=st.integers(0, 60000))
def test_free_ride_chunk_is_the_memory_bound_boundary(c, n, ctx_per, q):
    x = pricing.free_ride_chunk(c, n, n * ctx_per, q)

    def excess(chunk):
        qq = q if chunk else 0
        m, comp, _ = pricing.pass_times(c, n, n * ctx_per, chunk, qq,
                                        pricing.chunk_attention_pairs(chunk, q))
        return comp - m

    if excess(0) > 0:  # the decodes alone are compute-bound: no ride (a prefix's reads
        assert x == 0  # could tip a one-token chunk back to memory-bound; it is not offered)
        return
    if x > 0:
        assert excess(x) <= 0
    assert excess(x + 1) > 0
    assert x <= pricing.free_ride_root(c, n, n * ctx_per, q) + 1


def test_a_pass_reaching_later_requests_reads_their_cached_prefixes_by_hand():
    # 2 decodes (context 400); the head has 30 tokens left after a 100-token prefix; then a
    # request with 200 cached and 40 to prefill, then one with 500 cached and 90 to prefill.
    # A 100-token chunk: the head's 30, the next one's 40, 30 of the last one's.
    # As one chunk after the head's prefix: 100 tokens, 100 * 100 + 5050 pairs, 100 read.
    # The later requests add their prefixes read once (200 + 500) and attended by their
    # tokens in the pass (40 * 200 + 30 * 500 pairs).
    later = ((200, 40), (500, 90))
    got = pricing.chunks_price(TOY, 2, 400, 100, 100, 30, later)
    assert got == pricing.pass_price(TOY, 2, 400, 100, 100 + 700, 10000 + 5050 + 8000 + 15000)
    # Within the head's tokens, or with nothing cached later, the head's chunk alone.
    assert pricing.chunks_price(TOY, 2, 400, 30, 100, 30, later) == pricing.chunk_price(TOY, 2, 400, 30, 100)
    assert pricing.chunks_price(TOY, 2, 400, 100, 100, 30, ((0, 40), (0, 90))) == \
        pricing.chunk_price(TOY, 2, 400, 100, 100)
    # Past the list nothing more is added.
    assert pricing.chunks_price(TOY, 2, 400, 500, 100, 30, later) == \
        pricing.pass_price(TOY, 2, 400, 500, 800, pricing.chunk_attention_pairs(500, 100) + 8000 + 45000)


def test_the_state_budget_is_the_time_budget_without_later_prefixes():
    state = {"running_decodes": 2, "decode_context_tokens": 400, "head_prefilled_tokens": 100,
             "head_remaining_tokens": 30}
    plain = pricing.time_budget(TOY, 2, 400, 100, 0.01, 8192)
    assert plain - 2 > 30  # the head's tokens fit with room to spare
    assert pricing.state_budget(TOY, state, 0.01, 8192) == plain
    assert pricing.state_budget(TOY, dict(state, next_prefills=()), 0.01, 8192) == plain
    assert pricing.state_budget(TOY, dict(state, next_prefills=((0, 5000),)), 0.01, 8192) == plain
    # Cached prefixes behind the head make the pass dearer: a smaller chunk, never below the
    # head's remaining tokens.
    heavy = dict(state, next_prefills=((60000, 50),) * 16)
    assert 2 + 30 <= pricing.state_budget(TOY, heavy, 0.01, 8192) < plain
    assert pricing.state_budget(TOY, dict(state, running_decodes=0), 0.01, 8192) == 8192


@settings(max_examples=300, deadline=None)
@given(c=coefficients, n=st.integers(1, 300), ctx_per=st.integers(0, 20000), q=st.integers(0, 60000),
       remaining=st.integers(1, 5000), seconds=st.floats(1e-4, 2.0), cap=st.integers(1, 1 << 15),
       later=st.lists(st.tuples(st.integers(0, 60000), st.integers(1, 5000)), max_size=16))
def test_the_state_budget_is_the_largest_chunk_the_price_of_every_chunk_allows(
        c, n, ctx_per, q, remaining, seconds, cap, later):
    state = {"running_decodes": n, "decode_context_tokens": n * ctx_per, "head_prefilled_tokens": q,
             "head_remaining_tokens": remaining, "next_prefills": tuple(later)}
    budget = pricing.state_budget(c, state, seconds, cap)
    plain = pricing.time_budget(c, n, n * ctx_per, q, seconds, cap)
    x, room = budget - n, max(cap - n, 0)
    assert x <= plain - n  # cached prefixes only add to the price
    if plain - n <= remaining:  # the head's tokens alone: priced as before
        assert budget == plain
        return
    assert x >= remaining
    assert pricing.chunks_price(c, n, n * ctx_per, x, q, remaining, later) <= seconds
    assert x == room or pricing.chunks_price(c, n, n * ctx_per, x + 1, q, remaining, later) > seconds


def test_prefill_due_by_hand():
    # No decodes, 10 ms passes: the chunk that fits, the queue at that rate, from the wait.
    chunk = pricing.chunk_within(TOY, 0, 0, 0.01, 0, pricing.PREFILL_DUE_CAP)
    assert pricing.prefill_due_s(TOY, 0, 0, 0, 6000, 1.5, 0.01) == pytest.approx(
        1.5 + 6000 * 0.01 / chunk)
    assert pricing.prefill_due_s(TOY, 0, 0, 0, 0, 1.5, 0.01) == 1.5  # nothing to prefill
    assert pricing.prefill_due_s(TOY, 5, 500, 0, 10, 0.0, 1e-4) == math.inf  # not one token fits


def test_combine_over_arrays_is_combine_over_numbers():
    rng = np.random.default_rng(0)
    m, c, o = rng.uniform(0, 1, 50), rng.uniform(0, 1, 50), rng.uniform(0, 1, 50)
    arr = pricing.combine(m, c, 0.3, o, np.maximum, np.minimum)
    assert arr.tolist() == [pricing.combine(*v, 0.3, w) for *v, w in zip(m, c, o)]


@pytest.mark.parametrize("hardware, model", [("h100-sxm", "llama-3-8b"), ("a100-80g", "llama-3-8b"),
                                             ("h100-sxm", "llama-3-70b-tp4"), ("m5-max", "llama-3-8b-q4"),
                                             ("h100-sxm-datasheet", "llama-3-8b")])
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 256), ctx=st.integers(0, 2_000_000), x=st.integers(0, 20000),
       q=st.integers(0, 60000))
def test_the_roofline_breakdown_takes_its_times_from_the_contract(hardware, model, n, ctx, x, q):
    r = Roofline.of(get_hardware(hardware), get_model(model))
    shape = PassShape(n, ctx, x, q if x else 0, pricing.chunk_attention_pairs(x, q))
    cost = price(r, shape)
    assert cost.total_s == pricing.pass_price(r.coefficients(), *shape)
    # The breakdown's named parts add up to what the contract prices outside the max.
    assert cost.outside_s == pytest.approx(cost.overhead_s + cost.elementwise_s + cost.allreduce_s,
                                           rel=1e-12)


# A part whose decode passes cross from memory- to compute-bound as contexts grow (slow
# attention arithmetic), with partial overlap and per-token costs outside the max: every
# branch of the simulator's unrolled price is taken.
CROSSING = replace(TOY_HW, attention_flops_ratio=4e-6, overlap=0.6, elementwise_bytes_per_s=5e11)


@st.composite
def batches(draw):
    workload, cfg = draw(engine_workloads((1, 20), [0.0, 0.0, 0.002, 0.05, 1.0], 3000, 400, 4, 16,
                                          [0, 0, 100, 700]))
    hardware = draw(st.sampled_from([TOY_HW, CROSSING]))
    budgets = draw(st.lists(st.sampled_from([0, 1, 13, 256, 2048, 9000]), min_size=1, max_size=5))
    return workload, cfg, hardware, budgets


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_every_simulated_pass_is_priced_by_the_contract(batch):
    """The simulator prices a pass with prefill in _execute and decode-only stretches as
    arithmetic sequences (or pass by pass where memory and compute cross): every pass,
    whichever path priced it, costs what pass_price says for its recorded shape."""
    workload, cfg, hardware, budgets = batch
    sim = Simulator(hardware, TOY_MODEL, workload, cfg, record_shapes=True)
    i = 0
    while sim.advance():
        sim.step(sim.state().running_decodes + 1 + budgets[i % len(budgets)])
        i += 1
    durations = sim.pass_durations()
    want = np.array([pricing.pass_price(sim.cost, *s) for s in sim.shapes])
    assert len(durations) == len(want) > 0
    np.testing.assert_allclose(durations, want, rtol=1e-11, atol=0)


def test_the_crossing_part_crosses_within_decode_stretches():
    """On CROSSING a long decode stretch starts memory-bound and ends compute-bound (the
    simulator's pass-by-pass branch), which the property above relies on."""
    sim = Simulator(CROSSING, TOY_MODEL, Workload.from_arrays([0.0] * 4, [200] * 4, [600] * 4),
                    EngineConfig(num_kv_blocks=4000), record_shapes=True)
    sim.run(lambda s: 16384)
    bounds = {m > c for m, c, _ in (pricing.pass_times(sim.cost, *s) for s in sim.shapes
                                    if s.prefill_tokens == 0 and s.num_decodes == 4)}
    assert bounds == {True, False}


def test_the_table_runtime_converts_with_the_contract_after_a_json_round_trip():
    import json

    from envs.scenario import Scenario
    from eval.export.cells import scenario_provenance
    from policies.table import BudgetTable

    sc = Scenario(hardware="a100-80g")
    cost = sc.simulator().cost
    data = {"schema_version": 2, "kind": "chunkpilot-budget-table",
            "action": {"kind": "time_fraction", "itl_s": 0.1, "cap": 16384, "cost": cost.as_dict()},
            "features": [{"name": "kv_usage", "edges": [0.5]}], "fractions": [1.0, 0.5],
            "default_budget": 2048, "provenance": scenario_provenance(sc)}
    table = BudgetTable(json.loads(json.dumps(data)))
    assert table.action.cost == cost
    for kv, f in ((0.1, 1.0), (0.9, 0.5)):
        state = dict(running_decodes=30, decode_context_tokens=30 * 2000, head_prefilled_tokens=700,
                     kv_usage=kv)
        assert table.budget(state) == pricing.time_budget(cost, 30, 60000, 700, f * 0.1, 16384)


@pytest.mark.parametrize("hardware, model", [("h100-sxm", "llama-3-8b"), ("h100-sxm", "llama-3-70b-tp4"),
                                             ("m5-max", "llama-3-8b-q4")])
def test_the_calibration_fit_prices_as_the_contract(hardware, model):
    """A profile's figures as a fit (envs.calibrate.fit.fit_of) predict, over the model's
    unit-roofline parts, exactly the price the contract gives from the profile's cost model."""
    from envs.calibrate.fit import fit_of, shape_parts, unit_roofline

    hw, m = get_hardware(hardware), get_model(model)
    rng = np.random.default_rng(1)
    shapes = []
    for _ in range(200):
        n, x, q = int(rng.integers(0, 128)), int(rng.integers(0, 8000)), int(rng.integers(0, 30000))
        shapes.append(PassShape(n, n * int(rng.integers(0, 8000)), x, q if x else 0,
                                pricing.chunk_attention_pairs(x, q)))
    predicted = fit_of(hw).predict(shape_parts(unit_roofline(m), shapes))
    want = [pricing.pass_price(Roofline.of(hw, m).coefficients(), *s) for s in shapes]
    np.testing.assert_allclose(predicted, want, rtol=1e-9)
