"""Metrics: exact weighted percentiles, goodput and smoothness on hand-made results."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.metrics import SLO, weighted_percentile
from tests.conftest import make_sim


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.integers(0, 5)), min_size=1,
                     max_size=40),
       q=st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_weighted_percentile_equals_expanded_percentile(data, q):
    values = np.array([v for v, _ in data])
    weights = np.array([w for _, w in data])
    got = weighted_percentile(values, weights, q)
    if weights.sum() == 0:
        assert np.isnan(got).all()
        return
    np.testing.assert_allclose(got, np.percentile(np.repeat(values, weights), q), rtol=1e-12,
                               atol=1e-12)


def test_goodput_and_smoothness_by_hand():
    # Three lone requests on the toy part, far apart: TTFT is one prefill pass each.
    sim = make_sim([(0.0, 100, 3), (5.0, 3000, 3), (10.0, 100, 40)])
    res = sim.run(lambda s: 4096)
    ttft = res.ttft_s
    tpot = res.tpot_s
    # Pick targets that only the first request meets: TTFT under the long prompt's,
    # TPOT under the third request's (its context is the same, but it decodes longer).
    slo = SLO(ttft_s=float(ttft[1]) * 0.99, itl_s=float(tpot[0]) * 1.0000001)
    good = res.meets_slo(slo)
    assert good.tolist() == [bool(ttft[0] <= slo.ttft_s and tpot[0] <= slo.itl_s),
                             False,
                             bool(ttft[2] <= slo.ttft_s and tpot[2] <= slo.itl_s)]
    s = res.summary(slo)
    assert s["goodput"] == pytest.approx(good.mean())
    span = float(res.finish_s.max() - res.arrival_s.min())
    assert s["goodput_rps"] == pytest.approx(good.sum() / span)
    assert s["throughput_tok_s"] == pytest.approx(46 / span)
    assert s["requests_finished"] == 3


def test_itl_statistics_cover_every_token():
    sim = make_sim([(0.0, 100, 5), (0.0, 100, 5)])
    res = sim.run(lambda s: 4096)
    s = res.summary()
    # 2 requests x 4 gaps each, all decode passes identical in shape but growing context.
    decode_passes = res.pass_duration_s[res.pass_decodes > 0]
    samples = np.repeat(decode_passes, res.pass_decodes[res.pass_decodes > 0])
    assert len(samples) == 8
    assert s["itl_p50_s"] == pytest.approx(np.percentile(samples, 50))
    assert s["itl_p99_s"] == pytest.approx(np.percentile(samples, 99))
    assert s["itl_max_s"] == pytest.approx(samples.max())
    assert s["itl_mean_s"] == pytest.approx(samples.mean())
    assert s["stall_passes"] == 0
    assert s["smooth_share"] == 1.0


def test_stalls_are_passes_with_prefill_and_decodes():
    sim = make_sim([(0.0, 100, 30), (0.02, 2000, 2)])
    s = sim.run(lambda st: 4096).summary()
    assert s["stall_passes"] == 1
    assert s["stall_decode_tokens"] == 1
    assert s["stall_itl_max_s"] == pytest.approx(s["itl_max_s"])


def test_single_token_outputs_have_no_tpot():
    res = make_sim([(0.0, 10, 1)]).run(lambda s: 512)
    assert math.isnan(res.tpot_s[0])
    s = res.summary()
    assert s["requests_finished"] == 1 and math.isnan(s["itl_p50_s"])


def test_slo_must_be_positive():
    from envs.errors import ConfigError
    with pytest.raises(ConfigError, match="slo_itl_s"):
        SLO(2.0, 0.0)


def test_t975_by_table_and_expansion():
    from envs.stats import ci95_half, standard_error, t975

    # Student's t 0.975 quantiles from a statistics table
    for df, t in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (19, 2.093), (30, 2.042),
                  (40, 2.021), (60, 2.000), (120, 1.980)):
        assert t975(df) == pytest.approx(t, abs=1e-3), df
    assert t975(10 ** 9) == pytest.approx(1.95996, abs=1e-5)  # the normal quantile
    assert all(t975(d) > t975(d + 1) for d in range(1, 200))  # narrows with more streams
    with pytest.raises(ValueError, match="df: got 0"):
        t975(0)
    # 5 values 1..5: sd 1.5811, half 2.776 * 1.5811 / sqrt 5 = 1.9630
    assert ci95_half([1, 2, 3, 4, 5]) == pytest.approx(1.9630, abs=1e-4)
    assert ci95_half([3.0]) == 0.0 and ci95_half([]) == 0.0
    assert standard_error([1, 2, 3, 4, 5]) == pytest.approx(0.70711, abs=1e-5)
