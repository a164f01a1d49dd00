"""The real-engine capacity benchmark's search, turn-taking and report, on fake engines
whose capacities are known (benchmarks/engine_capacity.py; its real runs need vLLM)."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.capacity import load_probes, search_load


def test_the_load_search_brackets_then_bisects_to_its_tolerance():
    asked = []

    def meets(f):
        asked.append(f)
        return f <= 3.7

    found = search_load(meets, start=1.0, step=2.0, rel_tol=0.02)
    assert asked[:3] == [1.0, 2.0, 4.0]  # bracketed between 2 and 4
    assert 3.7 * 0.98 <= found <= 3.7
    assert all(a <= 3.7 for a in asked if a == found)
    assert search_load(lambda f: False, start=1.0, low=0.25) == 0.0  # nothing meets
    assert search_load(lambda f: True, start=1.0, high=8.0) == 8.0  # everything up to the top
    # at most max_probes bisection probes after the bracket
    asked.clear()
    search_load(meets, start=1.0, step=2.0, rel_tol=1e-9, max_probes=3)
    assert len(asked) == 3 + 3


def test_the_generator_and_the_function_search_alike():
    def drive(threshold):
        gen = load_probes(1.3, 1.25, 0.05, 4)
        f = next(gen)
        try:
            while True:
                f = gen.send(f <= threshold)
        except StopIteration as end:
            return end.value

    for threshold in (0.3, 0.9, 1.3, 2.2, 5.0):
        assert drive(threshold) == search_load(lambda f: f <= threshold, 1.3, 1.25, 0.05, 4)


@pytest.fixture
def bench():
    import benchmarks.engine_capacity as bench

    return bench


def test_searches_take_turns_probe_by_probe_and_each_finds_its_capacity(bench):
    """Three fake engines with known capacities: every search ends within its tolerance of
    its own, and no search runs two probes while another still waits for its turn."""
    truth = {("a", 1): 1.7, ("b", 1): 0.6, ("a", 2): 2.9}
    order = []

    def probe(key, factor):
        order.append(key)
        return factor <= truth[key]

    found = bench.round_robin({k: 1.0 for k in truth}, probe, 1.25, 0.05, 4)
    for key, cap in truth.items():
        factor, tried = found[key]
        assert cap * 0.95 <= factor <= cap, key
        assert [k for k in order if k == key] == [key] * len(tried)
    # between two probes of one search, every other search with probes still to come has one
    total = {k: len(found[k][1]) for k in truth}
    last = {}
    for i, key in enumerate(order):
        if key in last:
            between = order[last[key] + 1:i]
            before = {k: order[:last[key] + 1].count(k) for k in truth}
            waiting = [k for k in truth if k != key and before[k] < total[k]]
            assert len(set(between)) == len(between), (key, between)
            assert set(waiting) <= set(between), (key, between)
        last[key] = i
    assert len(set(total.values())) > 1  # the searches end at different times


def test_the_prediction_uses_the_simulator_as_the_search_does(bench):
    """predict() on the simulator: a policy's capacity factor is the one search_load finds
    with the simulator as the engine, and a faster static budget never predicts less than
    a budget of one token per running request would at the same SLO."""
    from envs.scenario import Scenario

    sc = Scenario(hardware="m5-max", model="llama-3-8b-q4", max_num_seqs=16, slo_ttft_s=10.0,
                  slo_itl_s=0.2)
    args = types.SimpleNamespace(streams=1, base_rate=0.05, requests=40, slo_ttft_s=10.0,
                                 slo_itl_s=0.2, workload="mixed")
    got = bench.predict([bench.Policy("static:512", 512), bench.Policy("vllm-default")], sc, 2048, args)
    seed = bench.STREAM_SEEDS[0]
    assert set(got) == {("static:512", seed), ("vllm-default", seed)}
    assert all(f > 0 for f in got.values())
    again = bench.predict([bench.Policy("static:2048", 2048)], sc, 2048, args)
    assert again[("static:2048", seed)] == got[("vllm-default", seed)]  # the default is its budget


def test_a_trace_stream_is_a_window_of_the_trace_at_the_load_asked(bench):
    """The k-th judged stream of the Azure trace is its k-th run of consecutive requests:
    the same arrival gaps up to one factor, which makes the mean rate the one asked; the
    lengths at a quarter, clipped to the model; other loads of one stream are the same
    requests."""
    import numpy as np

    from envs.workload import load_trace

    trace = load_trace("azure_conv_2023")
    w = bench.stream("azure-conv", bench.STREAM_SEEDS[2], 3.0, 50)
    assert len(w) == 50 and w.arrival_s[0] == 0
    assert w.mean_rate == pytest.approx(3.0)
    gaps = np.diff(trace.arrival_s[100:150])
    assert np.allclose(np.diff(w.arrival_s), gaps * (50 / 3.0) / gaps.sum())
    assert list(w.prompt_tokens) == [min(max(round(p / 4), 1), 1536) for p in trace.prompt_tokens[100:150]]
    assert list(w.output_tokens) == [min(max(round(o / 4), 1), 512) for o in trace.output_tokens[100:150]]
    slower = bench.stream("azure-conv", bench.STREAM_SEEDS[2], 1.5, 50)
    assert np.allclose(slower.arrival_s, 2 * w.arrival_s)
    assert list(slower.prompt_tokens) == list(w.prompt_tokens)
    mixed = bench.stream("mixed", bench.STREAM_SEEDS[0], 2.0, 40)
    assert len(mixed) == 40 and max(mixed.prompt_tokens) <= 1100


def test_the_report_pairs_each_side_against_its_own_best_static(bench, tmp_path):
    streams = [100, 101]
    predicted = {"vllm-default|100": 1.0, "vllm-default|101": 1.2, "static:256|100": 2.0,
                 "static:256|101": 2.2, "static:512|100": 1.8, "static:512|101": 2.4,
                 "table:r|100": 2.2, "table:r|101": 2.6}
    measured = {"vllm-default|100": 0.8, "vllm-default|101": 1.0, "static:256|100": 1.6,
                "static:256|101": 2.0, "static:512|100": 1.7, "static:512|101": 2.2,
                "table:r|100": 1.7, "table:r|101": 2.2}
    data = {"meta": {"slo": [2.0, 0.1], "requests": 200, "streams": streams, "base_rate": 2.0,
                     "vllm_default": 2048, "best_static_predicted": 256, "fit": "fit",
                     "rules": {"r": "t.json"}, "search": [1.25, 0.05, 3], "wall_s": 60.0},
            "predicted": predicted, "measured": measured,
            "probes": [{"wall_s": 30.0, "speed_scale": 0.5}, {"wall_s": 30.0}]}
    (tmp_path / "results.json").write_text(json.dumps(data))
    text = bench.report(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| table:r |"))
    # measured: best static is 512 (1.95 req/s x2); the table ties it on both streams
    assert "3.90 (3.40, 4.40)" in row and "+0.0%" in row
    # predicted: best static 256 (mean 4.2 req/s); the table is +10% and +18.2%
    assert "4.80 (4.40, 5.20)" in row
    ratio = next(line for line in text.splitlines() if line.startswith("- table:r / best static"))
    assert "measured 1.000" in ratio and "predicted 1.141" in ratio
    default = next(line for line in text.splitlines() if line.startswith("- best static / vLLM"))
    want = ((1.7 / 0.8 + 2.2 / 1.0) / 2, (2.0 / 1.0 + 2.2 / 1.2) / 2)
    assert f"measured {want[0]:.3f}" in default and f"predicted {want[1]:.3f}" in default
    assert math.isclose(json.loads((tmp_path / "results.json").read_text())["meta"]["wall_s"], 60.0)


def test_a_run_without_vllms_default_reports_the_tables_and_no_default_ratio(bench, tmp_path):
    """``--statics 256 --no-vllm-default`` serves the statics named and no default: the
    report pairs the table against the static, and gives no ratio over a default not run."""
    args = bench.parse(["--statics", "362,256,362", "--no-vllm-default"])
    assert args.statics == [256, 362] and args.no_vllm_default
    assert bench.parse([]).statics == [] and not bench.parse([]).no_vllm_default
    with pytest.raises(SystemExit):
        bench.parse(["--statics", "4096"])
    caps = {"static:256|100": 2.0, "table:r|100": 2.2}
    data = {"meta": {"slo": [2.0, 0.1], "requests": 200, "streams": [100], "base_rate": 1.0,
                     "vllm_default": 2048, "best_static_predicted": 256, "fit": "fit",
                     "rules": {"r": "t.json"}, "search": [1.25, 0.05, 3]},
            "predicted": caps, "measured": caps, "probes": [{"wall_s": 30.0}]}
    (tmp_path / "results.json").write_text(json.dumps(data))
    text = bench.report(tmp_path)
    assert "- table:r / best static: measured 1.100" in text
    assert "vLLM's default" not in text.split("Ratios")[1]


def test_a_policy_failing_at_the_floor_is_reported_below_it_and_bounds_the_ratios(bench, tmp_path):
    """A search that failed at the slowest load probed found 0: the report shows it as
    below the floor, and a ratio over it counts it at the floor, as a bound."""
    assert bench.ratio_of([2.0, 3.0], [1.0, 1.5], 0.5) == (2.0, "")
    assert bench.ratio_of([2.0, 3.0], [0.0, 1.5], 0.5) == ((4.0 + 2.0) / 2, ">")
    assert bench.ratio_of([0.0, 3.0], [1.0, 1.5], 0.5) == ((0.5 + 2.0) / 2, "<")
    assert math.isnan(bench.ratio_of([2.0], [0.0], 0.0)[0])
    assert math.isnan(bench.ratio_of(None, [1.0], 0.5)[0])
    streams = [100, 101]
    both = {"vllm-default|100": 0.0, "vllm-default|101": 0.0, "static:256|100": 2.0,
            "static:256|101": 2.2, "table:r|100": 2.2, "table:r|101": 2.2}
    data = {"meta": {"slo": [2.0, 0.1], "requests": 200, "streams": streams, "base_rate": 1.0,
                     "vllm_default": 2048, "best_static_predicted": 256, "fit": "fit",
                     "rules": {"r": "t.json"}, "search": [1.25, 0.05, 3], "floor": 1.6},
            "predicted": both, "measured": both, "probes": [{"wall_s": 30.0}]}
    (tmp_path / "results.json").write_text(json.dumps(data))
    text = bench.report(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| vllm-default |"))
    assert "<1.60 (<1.60, <1.60)" in row and "-100.0%" in row
    default = next(line for line in text.splitlines() if line.startswith("- best static / vLLM"))
    assert f"measured >{(2.0 + 2.2) / 2 / 1.6:.3f}" in default and "points" not in default
    assert "no load below 1.60 req/s is probed" in text


def test_a_replay_is_given_up_once_enough_values_are_over_the_target():
    """Five requests: p99 of five TTFTs interpolates between the 4th and 5th largest... from
    index floor(0.99 * 4) = 3, so two TTFTs over the target fail it whatever comes after;
    a request still waiting past the target is one of them already."""
    from benchmarks.sim_vs_vllm import SloWatch

    watch = SloWatch([2, 2, 2, 2, 2], slo_ttft_s=1.0, slo_itl_s=0.5)
    assert (watch.need_ttft, watch.need_itl) == (2, 2)
    times = {r: [0.0] for r in "abcde"}
    for r in "abcde":
        watch.add(r, times[r], 2)
    times["a"].append(1.5)  # over
    watch.tokens("a", 1)
    assert not watch.failed(now=0.9)
    assert watch.failed(now=1.2)  # b-e have waited 1.2 s for a first token
    times["b"].append(0.5)
    watch.tokens("b", 1)
    for r in "cde":
        times[r] += [0.4, 0.6]
        watch.tokens(r, 1)
    assert not watch.open.keys() - {"a", "b"}
    assert not watch.failed(now=1.2)  # one TTFT over; a and b are within a gap of 0.5
    assert watch.failed(now=2.1)  # a and b have each waited over 0.5 s for their second token
    times["a"].append(1.9)
    watch.tokens("a", 2, finished=True)
    assert "a" not in watch.open and watch.over_itl == 0
    assert not watch.failed(now=100.0)  # b's gap alone, however long, is one of the two


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0.01, 3),
                          st.lists(st.floats(0.001, 0.4), max_size=6)), min_size=1, max_size=30),
       st.floats(0.2, 2.0), st.floats(0.02, 0.3))
def test_a_replay_given_up_never_meets_its_slo_and_one_let_finish_fails_only_by_interpolation(
        requests, slo_ttft_s, slo_itl_s):
    """Played in time order, the watch says a replay failed only if its final p99s (as the
    benchmark computes them) fail the SLO; at the end it has said so wherever the order
    statistic p99 starts from is over a target."""
    from benchmarks.engine_capacity import replay_meets
    from benchmarks.sim_vs_vllm import SloWatch, summarize

    timelines = []
    for arrival, ttft, gaps in requests:
        timelines.append([arrival, *np.cumsum([arrival + ttft, *gaps]).tolist()])
    final = summarize([t[1] - t[0] for t in timelines],
                      [b - a for t in timelines for a, b in zip(t[1:], t[2:])])
    met = replay_meets({**final, "itl_p99_s": 0.0 if math.isnan(final["itl_p99_s"]) else
                        final["itl_p99_s"]}, slo_ttft_s, slo_itl_s)
    watch = SloWatch([len(t) - 1 for t in timelines], slo_ttft_s, slo_itl_s)
    seen = {i: [t[0]] for i, t in enumerate(timelines)}
    events = sorted({x for t in timelines for x in t})
    said = False
    for now in events + [events[-1] + 10.0]:
        for i, t in enumerate(timelines):
            if t[0] <= now and str(i) not in watch.open and len(seen[i]) == 1:
                watch.add(str(i), seen[i], len(t) - 1)
            if str(i) in watch.open:
                before = len(seen[i])
                seen[i] += [x for x in t[before:] if x <= now]
                if len(seen[i]) > before:
                    watch.tokens(str(i), before)
        said = said or watch.failed(now)
    assert not (said and met)
    for values, target in ((sorted(t[1] - t[0] for t in timelines), slo_ttft_s),
                           (sorted(b - a for t in timelines for a, b in zip(t[1:], t[2:])), slo_itl_s)):
        if values and values[int(np.floor(0.99 * (len(values) - 1)))] > target:
            assert said
    assert not replay_meets({**final, "gave_up_s": 1.0}, 10.0, 10.0)


def test_repredict_redoes_the_simulators_side_on_the_recorded_steps_and_keeps_the_measured(bench, tmp_path):
    """--repredict refits the profile (its jitter included) to the recorded steps, predicts
    every policy of results.json again as predict() does with that profile, and keeps the
    engine's measurements and probes."""
    from envs.profiles import get_hardware, profile_to_toml
    from envs.scenario import Scenario
    from tests.conftest import TOY_HW, TOY_MODEL
    from tests.test_calibrate import write_steps

    write_steps(tmp_path / "vllm-steps.csv", TOY_HW, TOY_MODEL, n=120)
    (tmp_path / "small-llama.toml").write_text(profile_to_toml(TOY_MODEL))
    measured = {"vllm-default|100": 0.8, "static:256|100": 1.6}
    data = {"meta": {"slo": [2.0, 0.1], "requests": 40, "workload": "mixed", "streams": [100],
                     "base_rate": 1.0, "vllm_default": 2048, "best_static_predicted": 64, "fit": "old",
                     "rules": {}, "search": [1.25, 0.05, 3]},
            "predicted": {"vllm-default|100": 9.0, "static:256|100": 9.0}, "measured": measured,
            "ladder_predicted": {}, "probes": [{"wall_s": 3.0, "policy": "static:256"}]}
    (tmp_path / "results.json").write_text(json.dumps(data))
    args = bench.parse(["--out", str(tmp_path)])
    bench.repredict(tmp_path, args)
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["measured"] == measured and got["probes"] == data["probes"]
    assert got["meta"]["fit"].startswith("fit to 120 steps")
    hw = get_hardware(str(tmp_path / "cpu.toml"))
    sc = Scenario(hardware=hw, model=str(tmp_path / "small-llama.toml"), max_num_seqs=16,
                  slo_ttft_s=2.0, slo_itl_s=0.1)
    want = bench.predict([bench.Policy("vllm-default"), bench.Policy("static:256", 256)], sc, 2048,
                         types.SimpleNamespace(streams=1, base_rate=1.0, requests=40, slo_ttft_s=2.0,
                                               slo_itl_s=0.1, workload="mixed"))
    assert got["predicted"] == {f"{n}|{s}": f for (n, s), f in want.items()}
    assert len(got["ladder_predicted"]) > 5 and got["meta"]["best_static_predicted"] in {
        int(k.split("|")[0].split(":")[1]) for k in got["ladder_predicted"]}
    assert (tmp_path / "README.md").read_text().count("| static:256 |") == 1
