"""The evaluation harness on tiny scenarios: identical arrivals, capacity, plots, reports."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from envs.scenario import Scenario
from eval.capacity import capacity
from eval.compare import compare, comparison_figures, comparison_report, workloads_for
from tests.conftest import cli
from policies.baselines import FreeRidePolicy, StaticPolicy

TINY = Scenario(rate=6.0, num_requests=200)


def test_every_policy_sees_identical_arrivals():
    seen = {}

    class Spy(StaticPolicy):
        def __init__(self, tokens, name):
            super().__init__(tokens)
            self.name = name

        def budget(self, state):
            sim = state.simulator
            seen.setdefault(self.name, set()).add(
                (len(sim.workload), float(sim.workload.arrival_s.sum()), int(sim.workload.prompt_tokens.sum())))
            return self.tokens

    cmp = compare(TINY, [Spy(512, "a"), Spy(4096, "b")], seeds=2)
    assert seen["a"] == seen["b"] and len(seen["a"]) == 2  # two streams, the same for both
    for r in cmp.results.values():
        assert [run["requests_total"] for run in r.runs] == [200, 200]
    # The hidden static ladder runs on them too: the powers of two, then the fine ladder's
    # quarter steps within an octave of the best.
    from eval.capacity import FINE_LADDER, quarter_steps_around

    powers = {256, 512, 1024, 2048, 4096, 8192, 16384}
    assert powers <= set(cmp.ladder) <= set(FINE_LADDER)
    def met(b):  # streams on which both p99s meet the SLO, counted here from the summaries
        return sum(r["ttft_p99_s"] <= TINY.slo_ttft_s and r["itl_p99_s"] <= TINY.slo_itl_s
                   for r in cmp.ladder[b].runs)

    best = max(powers, key=lambda b: (met(b), cmp.ladder[b].mean("goodput"), -cmp.ladder[b].mean("ttft_p99_s")))
    assert set(cmp.ladder) - powers == set(quarter_steps_around(best, 256))


def _run(goodput, ttft_p99_s, itl_p99_s, slo=(2.0, 0.1)):
    return {"goodput": goodput, "ttft_p99_s": ttft_p99_s, "itl_p99_s": itl_p99_s,
            "slo_ttft_s": slo[0], "slo_itl_s": slo[1]}


def test_the_fixed_load_ranking_never_names_a_budget_that_breaks_p99_itl():
    from eval.harness import PolicyResult, best_of

    # A budget of 16,384 at light load: every request within its TTFT and TPOT targets
    # (goodput 1.000), and every running user stalled 358 ms whenever a prompt arrives (p99
    # ITL over the 100 ms target on both streams); 2,435 keeps p99 ITL at 90 ms and loses
    # one request in a hundred. The ranking names 2,435.
    ladder = {16384: PolicyResult("static:16384", "static", [_run(1.0, 0.5, 0.358), _run(1.0, 0.6, 0.35)]),
              2435: PolicyResult("static:2435", "static", [_run(0.99, 0.9, 0.09), _run(0.99, 0.8, 0.095)]),
              256: PolicyResult("static:256", "static", [_run(0.7, 2.5, 0.03), _run(0.8, 1.9, 0.03)])}
    assert best_of(ladder) == 2435
    assert [ladder[b].slo_streams() for b in (16384, 2435, 256)] == [0, 2, 1]
    assert ladder[2435].meets_slo and not ladder[256].meets_slo
    # Where none meets the SLO on every stream, the one meeting it on most streams comes first.
    del ladder[2435]
    assert best_of(ladder) == 256
    # A stream whose every output is one token has no ITL to break.
    assert PolicyResult("x", runs=[_run(1.0, 0.5, float("nan"))]).meets_slo


def test_workloads_are_disjoint_from_training_seeds():
    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from envs.seeds import EVAL_SEED_BASE
    a = workloads_for(TINY, 1, None)[0]
    b = TINY.arrivals(EVAL_SEED_BASE)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=20))
    env.reset(seed=0)
    assert not np.array_equal(env.sim.workload.arrival_s[:5], a.arrival_s[:5])


def test_goodput_mean_and_interval_by_hand():
    from eval.harness import PolicyResult
    r = PolicyResult("x", runs=[{"goodput": 0.9}, {"goodput": 0.7}])
    assert r.mean("goodput") == pytest.approx(0.8)
    # t(0.975, 1 df) * sample std / sqrt(n) = 12.706 * 0.1414 / 1.414 = 1.2706
    assert r.ci95("goodput") == pytest.approx(1.2706)


def test_capacity_is_the_boundary_of_the_slo():
    sc = Scenario(rate=4.0, num_requests=150)
    res = capacity(sc, StaticPolicy(2048), seeds=1, num_requests=150)
    passing = [f for _, f, t, i, *_ in res.probes if t <= sc.slo_ttft_s and i <= sc.slo_itl_s]
    failing = [f for _, f, t, i, *_ in res.probes if not (t <= sc.slo_ttft_s and i <= sc.slo_itl_s)]
    assert res.factors == (max(passing),) and res.capacity == pytest.approx(max(passing) * sc.rate)
    assert min(f for f in failing if f > max(passing)) <= max(passing) * 1.05
    # A budget whose every chunk stalls decodes past the ITL target has less capacity.
    worse = capacity(sc, StaticPolicy(16384), seeds=1, num_requests=150)
    assert worse.capacity < res.capacity


def test_report_and_plots_are_written(tmp_path, drawn):
    cmp = compare(TINY.with_fields(num_requests=120), [StaticPolicy(2048), FreeRidePolicy()], seeds=2)
    figures = comparison_figures(cmp, tmp_path, 2, None)
    text = comparison_report(cmp, tmp_path, 2, figures=figures)
    assert text.startswith("# Comparison: TTFT 2 s / ITL 100 ms at 6 req/s\n\n**")
    assert "Best fixed budget at this load" in text and "free-ride" in text
    b, best = cmp.best_static()
    names = {"goodput_by_budget.png", "pareto.png", "latency.png", "budget_timeline.png", "goodput_vs_load.png"}
    assert names <= {p.name for p, _ in figures} and names <= {n for n, _ in drawn}
    for path, caption in figures:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000 and caption
        assert f"![{path.stem}]({path.name})" in text and caption in text
    seen = dict(drawn)
    ladder = seen["goodput_by_budget.png"]
    assert ladder["labels"][0][:2] == ("static budget (tokens)", "goodput (share of requests)")
    assert {"static budgets (fine ladder)", f"best fixed budget: {b:,}"} <= set(ladder["legends"][0])
    assert any(t.startswith("free-ride: ") for t in ladder["legends"][0])
    crossed = "breaks p99 TTFT or ITL on some stream" in ladder["legends"][0]
    assert crossed == any(not r.meets_slo for r in cmp.ladder.values())
    tails = seen["latency.png"]
    assert [lab[0] for lab in tails["labels"]] == ["TTFT (s)", "ITL (s)"]
    assert {"static:2048", "free-ride", "TTFT target: 2 s", "1% (p99)"} <= set(tails["legends"][0])
    assert {"static:2048", "free-ride", "ITL target: 0.1 s", "1% (p99)"} <= set(tails["legends"][1])
    line = seen["budget_timeline.png"]
    assert "the window around the worst gap" in line["labels"][0][2]
    assert "ITL target: 100 ms" in line["legends"][1] and f"static:{b}" in line["legends"][0]
    pareto = seen["pareto.png"]
    assert {"TTFT target: 2 s", "ITL target: 100 ms", "static budgets (labelled)"} <= set(pareto["legends"][0])
    curve = seen["goodput_vs_load.png"]
    assert curve["labels"][0][0].startswith("load, times this comparison's")
    assert (tmp_path / "report.md").read_text() == text


def test_capacity_pictures_show_every_policy_against_the_ladder_and_the_targets(tmp_path, drawn):
    """Capacity against the static budget as shares of the best rung (a policy's line is
    its verdict), a panel per study; the tails, the timeline and the goodput curve name
    every policy, the best fixed budget and the SLO's targets."""
    from eval.capacity import capacity_studies
    from eval.capacity_report import capacity_figures, capacity_report
    from policies.baselines import TimeBudgetPolicy

    sc = TINY.with_fields(num_requests=80)
    (study,) = capacity_studies([(sc, [TimeBudgetPolicy(sc.slo_itl_s)])], 2, 80)
    figures = capacity_figures(study, [TimeBudgetPolicy(sc.slo_itl_s)], tmp_path, 2, 80)
    assert [p.name for p, _ in figures] == ["capacity_by_budget.png", "at_capacity_latency.png",
                                            "at_capacity_budget_timeline.png", "goodput_vs_load.png"]
    seen = dict(drawn)
    b = study.best_budget
    ladder = seen["capacity_by_budget.png"]
    assert ladder["labels"][0][1] == "capacity under the SLO, % of the best fixed budget's"
    v = study.verdict("time-budget")
    assert f"time-budget: {100 * (1 + v.rel):.1f}%" in ladder["legends"][0]
    assert f"best fixed budget: {b:,}" in ladder["legends"][0]
    assert {"time-budget", f"static:{b}", "ITL target: 0.1 s"} <= set(seen["at_capacity_latency.png"]["legends"][1])
    assert {"time-budget", f"static:{b}"} <= set(seen["goodput_vs_load.png"]["legends"][0])
    assert seen["goodput_vs_load.png"]["labels"][0][0] == "load, times the best fixed budget's capacity on each stream"
    text = capacity_report(study, tmp_path, 2, 80, figures=figures)
    assert text.startswith("# Capacity under TTFT 2 s / ITL 100 ms\n\n**")
    assert all(f"![{p.stem}]({p.name})" in text for p, _ in figures)


def test_a_dozen_policies_get_distinct_styles():
    from eval.plots import styles

    st = styles([f"p{i}" for i in range(12)])
    assert len({(s["color"], s["marker"], s["ls"]) for s in st.values()}) == 12
    assert len({s["color"] for s in list(st.values())[:10]}) == 10


def test_compare_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "eval", "compare", "--policies", "static:512,free-ride",
                          "--num-requests", "100", "--seeds", "2", "--workers", "1", "--out", str(tmp_path),
                          "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert {"static:512", "free-ride", "_hindsight_static"} <= set(data)
    assert {"budget", "goodput"} <= set(data["_hindsight_static"])
    assert data["free-ride"]["verdict"].split(" (")[0] in ("beats", "ties", "falls short")
    for key in ("ttft_p99_s", "itl_p99_s", "goodput", "goodput_ci95", "itl_max_s", "smooth_share"):
        assert key in data["static:512"]
    assert (tmp_path / "results.json").exists() and (tmp_path / "report.md").exists()


def test_eval_cli_bad_input():
    out = cli("eval", "compare", "--policies", "best")
    assert out.returncode == 2 and "unknown spec 'best'" in out.stderr and "Traceback" not in out.stderr
    out = cli("eval", "bogus")
    assert out.returncode == 2 and "must be one of compare, capacity, suite" in out.stderr


def test_paired_verdict_by_hand():
    from eval.harness import paired_verdict

    # +10%, +20%, +30%: mean +20% ± t(0.975, 2 df) * 10% / sqrt 3 = 4.303 * 0.05774 = 24.8%:
    # a tie on three streams (the normal 1.96 would have said "beats", ± 11.3%)
    v = paired_verdict([11, 12, 13], [10, 10, 10])
    assert v.kind == "ties" and v.rel == pytest.approx(0.2)
    assert v.half == pytest.approx(0.24844, abs=1e-5)
    v = paired_verdict([11, 12, 13], [10, 10, 10], z=1.96)  # a fixed threshold: 1.96 * 5.774%
    assert v.kind == "beats" and v.half == pytest.approx(0.11316, abs=1e-5)
    # One stream has no interval: +10% there is not judged, neither "beats" nor a tie
    v = paired_verdict([11], [10])
    assert v.kind == "not judged" and v.rel == pytest.approx(0.1) and v.matches
    assert v.cell == "+10.0%, one stream: no interval" and str(v) == "not judged (+10.0%, one stream: no interval)"
    assert paired_verdict([11], [10], z=1.96).kind == "not judged"
    # five streams, +16% to +24%: sd 3.162%, ± 2.776 * 3.162% / sqrt 5 = 3.93%: beats
    v = paired_verdict([11.6, 11.8, 12, 12.2, 12.4], [10] * 5)
    assert v.kind == "beats" and v.half == pytest.approx(0.039256, abs=1e-5)
    v = paired_verdict([9, 11, 10], [10, 10, 10])
    assert v.kind == "ties" and v.rel == pytest.approx(0.0) and v.matches
    v = paired_verdict([8, 8.5, 9], [10, 10, 10])
    assert v.kind == "falls short" and not v.matches
    assert paired_verdict([9.9, 9.85], [10, 10]).matches  # within 2%


def test_verdicts_are_judged_on_each_stream_s_ratio_whatever_its_scale():
    from eval.harness import paired_verdict

    # Five streams whose capacities differ 10x (1 to 10 req/s). A policy at 0.2x of the
    # reference on every one loses 80% on every one: falls short, -80.0% ± 0.
    ref = [1.0, 10.0, 2.0, 5.0, 8.0]
    v = paired_verdict([0.2 * r for r in ref], ref)
    assert v.kind == "falls short" and v.rel == pytest.approx(-0.8) and v.half == pytest.approx(0.0)
    assert v.streams == 5 and not v.matches
    # 4%, 6%, 5%, 4%, 6% ahead: mean +5%, sd 1% (deviations -1, +1, 0, -1, +1: squares 4 /
    # 4 df), half 2.776 * 1% / sqrt 5 = 1.2415%: beats. In req/s the differences run from
    # 0.04 to 0.6, and their spread (as a share of the mean reference) would read +5.5% ± 5.8%,
    # a tie.
    v = paired_verdict([1.04, 10.6, 2.10, 5.2, 8.48], ref)
    assert v.kind == "beats" and v.rel == pytest.approx(0.05)
    assert v.half == pytest.approx(2.776 * 0.01 / 5 ** 0.5, rel=1e-9)
    # One window losing 10% while a ten-times larger one gains 10%: a tie around 0, where
    # differences in req/s (-0.1, +1.0) would read as a gain of 8% of the mean.
    v = paired_verdict([0.9, 11.0], [1.0, 10.0])
    assert v.kind == "ties" and v.rel == pytest.approx(0.0)


def test_a_policy_on_one_side_of_every_one_of_five_streams_is_judged_so_whatever_the_spread():
    from eval.harness import paired_verdict

    # Mooncake's five windows: the table ahead on each, by 114%, 11%, 12%, 31% and 15%.
    # The spread of the gains puts the interval across zero (+36.9% ± 54.8%), yet every
    # window is ahead: with no difference that happens 1 time in 16.
    ref = [0.166, 0.491, 0.655, 0.254, 0.404]
    v = paired_verdict([0.356, 0.547, 0.733, 0.333, 0.466], ref)
    assert v.kind == "beats" and v.by_sign and v.rel - v.half < 0
    assert v.figure.endswith(", ahead on all 5 streams")
    # Behind on every stream falls short whatever the spread (DESIGN.md section 4).
    v = paired_verdict([0.05, 0.48, 0.64, 0.10, 0.39], ref)
    assert v.kind == "falls short" and v.by_sign
    # Four streams on one side are not enough; nor is one stream level with the reference.
    assert paired_verdict([0.356, 0.547, 0.733, 0.333], ref[:4]).kind == "ties"
    assert paired_verdict([0.356, 0.547, 0.733, 0.333, 0.404], ref).kind == "ties"
    # NaN (nothing finished) on either side leaves that stream out.
    v = paired_verdict([1.1, float("nan"), 1.1], [1.0, 1.0, float("nan")])
    assert v.kind == "not judged" and v.streams == 1 and v.rel == pytest.approx(0.1)


def test_streams_where_the_reference_serves_nothing_are_counted_apart_never_divided_by():
    from eval.harness import NOT_JUDGED, paired_verdict

    # Both serve nothing on the last stream: left out, the rest judged as ratios.
    v = paired_verdict([1.1, 2.2, 3.3, 0.0], [1.0, 2.0, 3.0, 0.0])
    assert v.kind == "beats" and v.rel == pytest.approx(0.1) and v.streams == 3 and v.neither == 1
    # The reference serves nothing where the policy serves: no ratio; counted, and named.
    v = paired_verdict([1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.0])
    assert v.kind == "ties" and v.only_policy == 1 and v.streams == 3
    assert "1 stream where only the policy serves" in v.figure
    # Nowhere does the reference serve: the policy serving on two streams or more beats it,
    # on one it is not judged, and nothing served anywhere ties.
    v = paired_verdict([0.5, 0.7, 0.0], [0.0, 0.0, 0.0])
    assert v.kind == "beats" and v.only_policy == 2 and v.neither == 1 and v.matches
    assert v.figure == "serves 2 streams where the reference serves nothing"
    assert paired_verdict([0.5, 0.0], [0.0, 0.0]).kind == NOT_JUDGED
    v = paired_verdict([0.0, 0.0], [0.0, 0.0])
    assert v.kind == "ties" and v.figure == "neither serves on any stream"
    # The policy serving nothing where the reference serves is a loss of 100% there.
    v = paired_verdict([0.0, 0.0, 0.0], [1.0, 5.0, 2.0])
    assert v.kind == "falls short" and v.rel == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="same streams"):
        paired_verdict([1.0, 2.0], [1.0])


def test_costs_are_compared_by_their_differences():
    from eval.harness import paired_difference

    # Episode costs on one scale, zero where an episode met every target: differences
    # -1, -2, -3 (mean -2, sd 1, half 4.303 / sqrt 3 = 2.484): a tie; at 1.96 standard
    # errors (1.132) the first is cheaper.
    v = paired_difference([0.0, 1.0, 2.0], [1.0, 3.0, 5.0])
    assert v.kind == "ties" and v.rel == pytest.approx(-2.0) and v.half == pytest.approx(2.4843, abs=1e-4)
    assert paired_difference([0.0, 1.0, 2.0], [1.0, 3.0, 5.0], z=1.96).kind == "falls short"
    assert paired_difference([0.0, 0.0], [0.0, 0.0]).kind == "ties"


def test_a_table_against_its_flattened_twin_by_hand(tmp_path):
    """What a table's cells are worth, by hand: table:T at 1.1, 1.2, 1.0 req/s against
    table-flat:T at 1.0 on three streams is +10.0% (sd 0.1, t(0.975, 2 df) = 4.303 times
    0.1 / sqrt 3: ± 24.8%), a tie; table:U at 1.1 on every stream against table-flat:0.5:U
    at 1.0 beats it by +10.0% ± 0.0%. A flattened table without its table beside it, and
    any other pair, says nothing. The capacity report, its JSON and the suite's counts say
    the same."""
    from envs.scenario import Scenario
    from eval.capacity import CapacityResult, CapacityStudy
    from eval.capacity_report import capacity_report
    from eval.suite import flat_counts

    def res(name, *per, flattens=None):
        return CapacityResult(name, "table", per, (), flattens=flattens)

    # The pairs come from what each flat twin says it flattens, not from its name.
    pols = {"table:T": res("a", 1.1, 1.2, 1.0), "table-flat:T": res("b", 1.0, 1.0, 1.0, flattens="table:T"),
            "table:U": res("c", 1.1, 1.1, 1.1),
            "table-flat:0.5:U": res("d", 1.0, 1.0, 1.0, flattens="table:U"),
            "table-flat:V": res("e", 2.0, 2.0, 2.0, flattens="table:V"),
            "static:512": res("f", 0.5, 0.5, 0.5)}
    study = CapacityStudy(Scenario(), pols, {1000: CapacityResult("s", "static", (1.0, 1.0, 1.0), ())})
    found = [(t, f, v.kind, round(v.rel, 4), round(v.half, 4)) for t, f, v in study.flat_verdicts()]
    assert found == [("table:T", "table-flat:T", "ties", 0.1, 0.2484),
                     ("table:U", "table-flat:0.5:U", "beats", 0.1, 0.0)]
    text = capacity_report(study, tmp_path, 3, 100)
    assert "- table:T against table-flat:T: +10.0% ± 24.8%, ties" in text
    assert "- table:U against table-flat:0.5:U: +10.0% ± 0.0%, beats" in text
    assert "table-flat:V:" not in text
    data = study.as_json()
    assert data["table:T"]["against_flat"] == {"table-flat:T": "ties (+10.0% ± 24.8%)"}
    assert data["table:U"]["against_flat"] == {"table-flat:0.5:U": "beats (+10.0% ± 0.0%)"}
    assert "table-flat:V" not in json.dumps({k: v for k, v in data.items() if k != "table-flat:V"})
    other = CapacityStudy(Scenario(), {"table:T": res("a", 0.9, 0.9, 0.9),
                                       "table-flat:T": res("b", 1.0, 1.0, 1.0, flattens="table:T")},
                          study.rungs)
    assert flat_counts(["s1", "s2"], [study, other]) == [
        "- table:T against table-flat:T (what its cells' dependence on state is worth): ties in 1 "
        "(s1 +10.0% ± 24.8%); falls short in 1 (s2 -10.0% ± 0.0%)",
        "- table:U against table-flat:0.5:U (what its cells' dependence on state is worth): beats in 1 "
        "(s1 +10.0% ± 0.0%)"]
    no_flat = CapacityStudy(Scenario(), {"static:512": pols["static:512"]}, study.rungs)
    assert flat_counts(["s"], [no_flat]) == [] and "cells are worth" not in capacity_report(no_flat, tmp_path, 3, 100)


def test_trained_trace_overlap_is_said():
    from eval.compare import training_overlap

    class Learned(StaticPolicy):
        config = {"args": {"trace": "azure_conv_2023"}}

    p = Learned(2048)
    p.name = "model:x"
    early = Scenario(trace="azure_conv_2023", window_start_s=100.0)
    late = Scenario(trace="azure_conv_2023", window_start_s=3000.0)
    assert "overlaps its training arrivals" in training_overlap(p, early)
    assert "after its training window" in training_overlap(p, late)
    assert training_overlap(StaticPolicy(2048), early) is None


def test_suite_lines_by_hand():
    """Two scenarios by hand: one where the hindsight pick (1,500: 1.03) leads the held-out
    one (1,500 on stream 0, 2,000 on the others: 0.83), and one no budget serves. The
    policy at 1.0 everywhere is 1/0.9 - 1 = +11.1% and 1/1.1 - 1 = -9.1% twice against the
    first pick, per stream: -2.4% (sd 11.66%), and 20% over the second. Intervals: t(0.975,
    2 df) = 4.303 times the standard error (0.1155 / sqrt 3 for the pick: 0.29; 11.66% /
    sqrt 3 for the policy: 29.0%)."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.capacity import CapacityResult, CapacityStudy
    from eval.suite import capacity_table, job_counts, use_counts

    def res(name, *per):
        return CapacityResult(name, "static", per, ())

    rungs = {1000: res("a", 1.0, 1.0, 1.0), 1500: res("b", 0.9, 1.1, 1.1), 2000: res("c", 1.3, 0.8, 0.8)}
    studies = [CapacityStudy(Scenario(), {"p": res("p", 1.0, 1.0, 1.0)}, rungs),
               CapacityStudy(Scenario(), {"p": res("p", 0.0, 0.0, 0.0)}, {1000: res("a", 0.0, 0.0, 0.0)})]
    cmps = [SimpleNamespace(results={"p": None})] * 2
    table = capacity_table(["s1", "s0"], ["p"], cmps, studies)
    assert table[2] == "| s1 | 1500: 1.03 ± 0.29 | 0.83 ± 0.14 (1500/2000) | 1.00 ± 0.00 (-2.4% ± 29.0%, ties) |"
    assert table[3].startswith("| s0 | 1000: 0.00 ± 0.00 | 0.00 ± 0.00 (1000) | 0.00 ± 0.00")
    assert job_counts(["s1", "s0"], ["p"], cmps, studies) == [
        "- p: within 2% of the hindsight static in 1 of 2 scenarios and of the held-out pick in 2; "
        "beats the hindsight static in 0; more than 2% below it in s1 -2.4%"]
    # One stream: no interval and no held-out pick, in the cells and the counts
    one = [CapacityStudy(Scenario(), {"p": res("p", 1.1)}, {1000: res("a", 1.0), 2000: res("c", 0.5)})]
    (row,) = capacity_table(["s"], ["p"], cmps[:1], one)[2:]
    assert row == "| s | 1000: 1.00 | n/a (one stream) | 1.10 (+10.0%, one stream: no interval) |"
    assert job_counts(["s"], ["p"], cmps[:1], one) == [
        "- p: within 2% of the hindsight static in 1 of 1 scenarios and of the held-out pick in 0; "
        "beats the hindsight static in 0"]
    from agents.summary import job_lines

    assert "Job 2 (beat it beyond the interval, where the dynamics give room): not judged: one stream" in "\n".join(
        job_lines({"s": CapacityStudy(Scenario(), {"p": res("p", 1.1), "time-budget": res("t", 1.0)},
                                      {1000: res("a", 1.0)})}, "p"))
    uses = [{"p": {"streams": 3, "used_5pct": 1, "budgets_5pct": 3}}, {"p": {"streams": 0, "used_5pct": 0}}]
    (line,) = use_counts(["s1", "s0"], ["p"], cmps, uses)
    assert line.startswith("- p at its capacity: at least 3 token-budget bins (2^(1/4)) each in 5% of "
                           "the passes it decides in 1 of 1 scenarios; at least 3 of its cell values "
                           "in 0; no capacity in s0;")
    assert use_counts(["s1", "s0"], ["p"], cmps, [{}, {}]) == []


def test_the_reference_is_the_rollout_over_the_best_time_budget_rule(tmp_path, monkeypatch):
    """The suite's reference rests on the time-budget rule of highest capacity among those
    measured (not a static, not a rule outside the family, not a table), and is judged
    against it stream by stream in the report, its JSON and the suite's lines; without a
    time-budget rule it is MPC over the best static."""
    from envs.scenario import Scenario
    from eval import capacity as cap
    from eval.capacity import CapacityResult, CapacityStudy
    from eval.capacity_report import capacity_report
    from eval.suite import room_lines

    def res(name, kind, *per):
        return CapacityResult(name, kind, per, ())

    pols = {"time-budget": res("time-budget", "rule", 1.0, 1.0),
            "time-budget-deadline-kv": res("time-budget-deadline-kv", "rule", 1.2, 1.1),
            "queue-depth": res("queue-depth", "rule", 3.0, 3.0),
            "table:T": res("table:T", "table", 2.0, 2.0), "static:512": res("static:512", "static", 2.5, 2.5)}
    rungs = {1000: CapacityResult("static:1000", "static", (1.0, 1.0), (), factors=(1.0, 1.0))}
    study = CapacityStudy(Scenario(), dict(pols), rungs)
    assert study.best_rule() == "time-budget-deadline-kv"
    built = []

    def sweep(pairs, seeds, num_requests, executor=None, progress=None, starts=None, **kw):
        built.extend((p.name, s) for (_, p), s in zip(pairs, starts))
        return [res(p.name, p.kind, 1.32, 1.1) for _, p in pairs]

    monkeypatch.setattr(cap, "capacity_sweep", sweep)
    cap.add_references([study], 2, 100)
    name = "rollout:10:time-budget-deadline-kv"  # five TTFT targets of 2 s
    assert built == [(name, [])] and name in study.policies
    (ref, rule, v), = study.room_verdicts()
    assert (ref, rule, v.kind, round(v.rel, 4)) == (name, "time-budget-deadline-kv", "ties", 0.05)
    assert f"- {name} against time-budget-deadline-kv: {v.cell}" in capacity_report(study, tmp_path, 2, 100)
    assert study.as_json()[name]["against_rule"]["per_stream"] == pytest.approx([0.1, 0.0])
    assert room_lines(["s"], [study]) == [
        "- the rollout reference (sees the future) against the best rule it is over: ties in 1 "
        f"(s {v.figure} over time-budget-deadline-kv)"]
    plain = CapacityStudy(Scenario(), {"static:512": pols["static:512"]}, rungs)
    assert plain.best_rule() is None
    built.clear()
    cap.add_references([plain], 2, 100)
    assert built == [("reference:1000", [1.0, 1.0])] and plain.room_verdicts() == []
