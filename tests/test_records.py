"""Compact records: the pass log in blocks, finished requests in columns, summaries read in
chunks. Every figure must equal what full per-pass and per-request arrays give."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.engine
from envs import records
from envs.engine import EngineConfig, Request, Simulator
from envs.metrics import chunked_weighted_percentile, weighted_percentile
from envs.records import FinishedRequest
from envs.workload import SyntheticSpec
from tests.conftest import TOY_HW, TOY_MODEL

PRESSURE = SyntheticSpec(rate=40, num_requests=400, prompt="uniform:50:1500", output="uniform:5:200")


def run(workload, budget=512, blocks=500, **kwargs):
    sim = Simulator(TOY_HW, TOY_MODEL, workload, EngineConfig(num_kv_blocks=blocks, max_num_seqs=24),
                    **kwargs)
    return sim, sim.run(lambda s: budget)


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of a few records and chunks of a few passes, so that short runs exercise every
    boundary: flushes mid-run, runs split across chunks, kv carried across chunks."""
    monkeypatch.setattr(envs.engine, "FLUSH_VALUES", 4 * 7)
    monkeypatch.setattr(records, "CHUNK_PASSES", 37)


def test_blocked_records_give_the_same_results_as_one_block(tiny_blocks):
    w = PRESSURE.build(1)
    _, res = run(w)
    assert res.total_preemptions > 0 and len(res.history.runs) > 10
    assert res.history.passes > 5 * records.CHUNK_PASSES
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs.engine, "FLUSH_VALUES", 10**9)
        mp.setattr(records, "CHUNK_PASSES", 10**9)
        _, ref = run(w)
        expected = ref.summary()
        full = {k: getattr(ref, k) for k in ("pass_duration_s", "pass_end_s", "pass_decodes",
                                               "pass_prefill_tokens", "pass_budget", "kv_used_blocks",
                                               "max_gap_s", "first_token_s", "resume_gaps_s")}
    got = res.summary()
    assert got.keys() == expected.keys()
    for k in got:
        if k in ("itl_mean_s", "kv_usage_mean"):  # sums of chunk sums: the last bits may differ
            assert got[k] == pytest.approx(expected[k], rel=1e-12)
        else:  # percentiles, maxima, counts: exactly
            assert same(got[k], expected[k]), (k, got[k], expected[k])
    for k, arr in full.items():
        np.testing.assert_array_equal(getattr(res, k), arr, err_msg=k)


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(1, 40), st.floats(1e-3, 1.0), st.sampled_from([0.0, 1e-4, 3e-3]),
                               st.integers(0, 9)), min_size=1, max_size=40),
       ranges=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 60)), min_size=1, max_size=20),
       block=st.integers(1, 7))
def test_range_max_equals_the_maximum_of_expanded_passes(runs, ranges, block):
    log = records.PassLog()
    for i, r in enumerate(runs):
        log.runs.extend(r)
        if i % block == block - 1:
            log.flush()
    history = log.history()
    dur, _ = log.pass_records()
    lo = np.array([min(a, history.passes - 1) for a, _ in ranges])
    hi = np.minimum(lo + np.array([n for _, n in ranges]), history.passes)
    got = history.range_max(lo, hi)
    np.testing.assert_array_equal(got, [dur[a:b].max() for a, b in zip(lo, hi)])


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.integers(0, 5)), min_size=1,
                     max_size=60),
       q=st.lists(st.floats(0, 100), min_size=1, max_size=4), parts=st.integers(1, 5))
def test_chunked_percentiles_equal_the_one_pass_ones(data, q, parts):
    values = np.array([v for v, _ in data])
    weights = np.array([w for _, w in data], dtype=np.int64)
    cuts = np.array_split(np.arange(len(values)), parts)

    def source():
        for idx in cuts:
            yield values[idx], weights[idx]

    np.testing.assert_array_equal(chunked_weighted_percentile(source, q), weighted_percentile(values, weights, q))


def test_requests_are_live_objects_then_compact_records():
    w = SyntheticSpec(rate=20, num_requests=60, prompt="uniform:50:500", output="uniform:2:40").build(0)
    sim = Simulator(TOY_HW, TOY_MODEL, w, EngineConfig(num_kv_blocks=400, max_num_seqs=8))
    for _ in range(25):
        assert sim.advance()
        sim.step(256)
    live = [r for r in sim.requests if isinstance(r, Request)]
    done = [r for r in sim.requests if isinstance(r, FinishedRequest)]
    assert live and done and len(live) + len(done) == len(sim.requests)
    assert all(sim.requests[r.pos] is r for r in live)  # the engine's own objects
    assert [r.arrival for r in sim.requests] == sorted(r.arrival for r in sim.requests)
    for r in done:
        assert r.generated == r.output and r.finish_s >= r.first_token_s >= r.arrival
    res = sim.run(lambda s: 256)
    assert len(res.max_gap_s) == 60 and res.finished.all()
    assert sim.requests[-1] == sim.requests[59] and sim.requests[:2] == [sim.requests[0], sim.requests[1]]


def test_a_finished_request_costs_a_few_hundred_bytes():
    """The records a run keeps: the pass log's blocks and the finished requests' columns."""
    w = SyntheticSpec(rate=6, num_requests=3000).build(3)
    sim = Simulator("h100-sxm", "llama-3-8b", w)
    sim.run(lambda s: 2048)
    log = sim.log
    kept = (sum(b.nbytes for b in log._runs.blocks) + sum(b.nbytes for b in log._prefill.blocks)
            + sum(b.nbytes for b in log._idle.blocks))
    book = sim.requests
    kept += len(book) * records.COLUMNS.itemsize + sum(b.nbytes for b in book._resumes.blocks)
    assert not book._live and kept / len(book) < 300


def test_forks_keep_only_live_requests():
    w = SyntheticSpec(rate=20, num_requests=100).build(0)
    sim = Simulator("h100-sxm", "llama-3-8b", w, EngineConfig(num_kv_blocks=2500, max_num_seqs=32))
    for _ in range(80):
        sim.advance()
        sim.step(1024)
    f = sim.fork()
    assert len(f.requests) == len(sim.requests.live())
    assert [r.rid for r in f.requests] == [r.rid for r in sim.requests.live()]
    assert all(f.requests[i].pos == i for i in range(len(f.requests)))


def test_summary_only_matches_the_full_summary_and_keeps_nothing(tiny_blocks):
    from envs.metrics import SLO

    w = PRESSURE.build(2)
    slo = SLO(0.5, 0.05)
    _, res = run(w)
    full = res.summary(slo)
    sim, streamed = run(w, summary_only=slo)
    got = streamed.summary()
    assert got.keys() == full.keys()
    for k in got:
        if k.endswith(("_p50_s", "_p90_s", "_p99_s")):  # log-bucketed: within 0.05%
            assert got[k] == pytest.approx(full[k], rel=5e-4), k
        elif k.endswith("_mean_s") or k == "kv_usage_mean":  # summed batch by batch
            assert got[k] == pytest.approx(full[k], rel=1e-12), k
        else:
            assert same(got[k], full[k]), (k, got[k], full[k])
    # What it keeps does not grow with the run: no request columns, a few recent blocks.
    assert not sim.requests._blocks and sim.log._dropped > 0
    total_runs = sum(len(b) for b in res.history.runs)
    assert len(sim.log._runs) < total_runs / 10
    with pytest.raises(IndexError, match="summary-only"):
        sim.requests[0]
    with pytest.raises(ValueError, match="summarises under"):
        streamed.summary(SLO(2.0, 0.1))
