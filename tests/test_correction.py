"""The online speed correction of a time-fraction table (policies/table/correction.py):
the running scale by hand, the price of a step's shape against the contract, and closed
loops against fake engines 2x faster, 2x slower, and one whose speed changes midway."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import pricing
from envs.scenario import Scenario
from eval.export.cells import scenario_provenance
from policies.table import BudgetTable
from policies.table.correction import BOUNDS, WARMUP, WINDOW, StepScale, shape_price, weighted_median


def fraction_table(fractions=(1.0,), edges=()) -> tuple[BudgetTable, pricing.Coefficients]:
    """A time-fraction table on the H100's cost model, ITL target 100 ms, cells over the
    running decodes."""
    sc = Scenario(hardware="h100-sxm")
    cost = sc.simulator().cost
    data = {"schema_version": 2, "kind": "chunkpilot-budget-table",
            "action": {"kind": "time_fraction", "itl_s": 0.1, "cap": 16384, "cost": cost.as_dict()},
            "features": [{"name": "running_decodes", "edges": list(edges)}],
            "fractions": list(fractions), "default_budget": 2048, "provenance": scenario_provenance(sc)}
    return BudgetTable(json.loads(json.dumps(data))), cost


def test_the_scale_is_the_median_of_the_window_within_its_bounds():
    s = StepScale(window=5, warmup=3, bounds=(0.5, 3.0))
    assert s.observe(1.0, 2.0) == 1.0  # warming up: the stored model
    assert s.observe(1.0, 4.0) == 1.0
    assert s.observe(1.0, 1.5) == 2.0  # ratios 2, 4, 1.5 priced alike: their median
    s.observe(1.0, 1.0)  # 1, 1.5, 2, 4: the mean of the middle two
    assert s.value == 1.75
    for _ in range(5):  # the window forgets: five ratios of 10, held at the upper bound
        s.observe(0.1, 1.0)
    assert s.value == 3.0 and s.at_bound
    for _ in range(3):  # three of five at 0.2: the median follows
        s.observe(1.0, 0.2)
    assert s.value == 0.5 and s.at_bound
    seen = s.seen
    for priced, measured in ((0.0, 1.0), (1.0, 0.0), (math.nan, 1.0), (1.0, math.inf), (1e-9, 1.0)):
        s.observe(priced, measured)  # nothing to learn from: ignored
    assert s.seen == seen and s.value == 0.5


def test_the_median_weighs_each_ratio_by_its_price():
    """A long pass counts for more than short ones: ratios 0.5 (priced 3 s) and 2.0 (two
    passes of 1 s) have 0.5 as their weighted median; with the weights 1, 1, 1, 1 of
    ratios 1, 2, 3, 4 the median is the mean of the middle two, as unweighted."""
    s = StepScale(window=8, warmup=1)
    s.observe(3.0, 1.5)
    s.observe(1.0, 2.0)
    assert s.observe(1.0, 2.0) == 0.5
    assert weighted_median([(1.0, 0.1), (2.0, 0.1), (3.0, 0.1), (4.0, 0.1)]) == 2.5
    assert weighted_median([(1.0, 1.0), (2.0, 1.0), (3.0, 2.5)]) == 3.0
    assert weighted_median([(1.0, 2.0), (2.0, 1.0), (3.0, 1.0)]) == 1.5


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100.0), st.floats(0.01, 100.0)), min_size=1, max_size=40))
def test_the_weighted_median_splits_the_weight_in_halves(items):
    """At most half the weight lies strictly below the weighted median and at most half
    strictly above it."""
    items = sorted(items)
    m = weighted_median(items)
    total = sum(w for _, w in items)
    assert sum(w for v, w in items if v < m) <= total / 2 * (1 + 1e-9)
    assert sum(w for v, w in items if v > m) <= total / 2 * (1 + 1e-9)


def test_bad_settings_are_refused():
    for kw in (dict(window=0), dict(warmup=0), dict(bounds=(0.0, 2.0)), dict(bounds=(1.5, 2.0)),
               dict(bounds=(0.5, 0.9))):
        with pytest.raises(ValueError):
            StepScale(**kw)


def test_a_step_shape_is_priced_as_the_contract_prices_its_pass():
    _, cost = fraction_table()
    # three decodes with contexts 100, 200, 300; a 512-token chunk after a 1,024 prefix
    steps = [(1, 100, True), (1, 200, True), (1, 300, True), (512, 1024, False)]
    assert shape_price(cost, steps) == pricing.chunk_price(cost, 3, 600, 512, 1024)
    # two chunks: their tokens, prefixes and attention pairs add up
    steps = [(1, 50, True), (100, 0, False), (30, 70, False)]
    pairs = pricing.chunk_attention_pairs(100, 0) + pricing.chunk_attention_pairs(30, 70)
    assert shape_price(cost, steps) == pricing.pass_price(cost, 1, 50, 130, 70, pairs)
    assert shape_price(cost, []) == 0.0


def test_the_scale_divides_the_time_budget():
    """A table served at scale 2 budgets as the same table with half the fractions does."""
    table, _ = fraction_table((1.0, 0.5), edges=[16])
    half, _ = fraction_table((0.5, 0.25), edges=[16])
    for n in (1, 8, 20, 40):
        state = dict(running_decodes=n, decode_context_tokens=n * 1500, head_prefilled_tokens=300)
        assert table.budget(state, 2.0) == half.budget(state)
        assert table.budget(state) == table.budget(state, 1.0)
    assert table.budget(dict(running_decodes=0, decode_context_tokens=0, head_prefilled_tokens=0),
                        3.0) == 16384  # nothing decoding: the cap, whatever the speed


def serve(table: BudgetTable, cost: pricing.Coefficients, speed, steps: int = 400, seed: int = 0,
          correct: bool = True) -> list[tuple[float, float]]:
    """A fake engine whose step takes ``speed(i)`` times the cost model's price of its
    shape, serving a long prompt beside a varying batch of decodes; per step, (its time,
    its time budget: the cell's fraction of the ITL target)."""
    rng = np.random.default_rng(seed)
    scale = StepScale()
    out = []
    for i in range(steps):
        n = int(rng.integers(1, 64))
        ctx = n * int(rng.integers(200, 3000))
        prefix = int(rng.integers(0, 8000))
        state = dict(running_decodes=n, decode_context_tokens=ctx, head_prefilled_tokens=prefix)
        budget = table.budget(state, scale.value if correct else 1.0)
        chunk = budget - n  # the prompt is long: the chunk fills the budget
        shape = [(1, ctx // n, True)] * n + [(chunk, prefix, False)]
        took = speed(i) * pricing.chunk_price(cost, n, ctx - ctx % n, chunk, prefix)
        scale.observe(shape_price(cost, shape), took)
        out.append((took, table.action.fraction(state) * table.itl_s))
    return out


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_after_a_warm_up_steps_take_their_time_budget_on_an_engine_off_its_model(speed):
    """A profile 2x too slow (the engine takes half the price) and 2x too fast: after the
    first window of steps, every step takes its time budget within 10%; without the
    correction every step is off by the factor."""
    table, cost = fraction_table((1.0, 0.6), edges=[24])
    served = serve(table, cost, lambda i: speed)
    ratios = np.array([t / b for t, b in served[WINDOW:]])
    assert np.all(np.abs(ratios - 1) <= 0.10), (ratios.min(), ratios.max())
    plain = np.array([t / b for t, b in serve(table, cost, lambda i: speed, correct=False)])
    assert np.median(plain) == pytest.approx(speed, rel=0.1)


def test_an_engine_whose_speed_changes_midway_is_followed_within_a_window():
    table, cost = fraction_table((1.0, 0.6), edges=[24])
    served = serve(table, cost, lambda i: 0.5 if i < 200 else 2.0)
    ratios = np.array([t / b for t, b in served])
    after = ratios[200 + WINDOW:]
    assert np.all(np.abs(ratios[WINDOW:200] - 1) <= 0.10)
    assert np.all(np.abs(after - 1) <= 0.10), (after.min(), after.max())
    # in between, the median has not yet moved: steps overrun until half the window has
    assert ratios[200] == pytest.approx(4.0, rel=0.1)
    assert np.argmax(np.abs(ratios[200:] - 1) <= 0.10) <= WINDOW // 2 + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-5, 1.0), st.floats(1e-5, 10.0)), min_size=0, max_size=80))
def test_the_scale_stays_within_its_bounds_and_is_a_ratio_it_saw(pairs):
    s = StepScale()
    for priced, measured in pairs:
        s.observe(priced, measured)
    low, high = BOUNDS
    assert low <= s.value <= high
    if len(pairs) < WARMUP:
        assert s.value == 1.0
    else:
        recent = sorted(m / p for p, m in pairs[-WINDOW:])
        assert min(max(recent[0], low), high) <= s.value <= min(max(recent[-1], low), high)
