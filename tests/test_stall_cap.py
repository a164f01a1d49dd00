"""The operator's cap on the longest pass (``--max-pass-itl``, ``Scenario.max_pass_itl``):
every adaptive policy, the environment's actions, the learner's teacher and the tables
honour it; a static budget, the engine's own setting, is not capped; the summaries count
the passes slower than the ITL target next to the worst gap."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.actions import FRACTION_LADDER, capped_budget
from envs.metrics import SLO
from envs.pricing import chunk_price
from envs.scenario import Scenario
from policies.specs import make_policy
from policies.table import BudgetTable, TableError
from tests.conftest import cli, make_sim

A100 = Scenario(hardware="a100-80g", model="llama-3-8b", slo_itl_s=0.05, rate=12.0)


def test_slow_pass_share_counts_passes_with_decodes_over_the_itl_target():
    # Thirty tokens of one user, then a 2,000-token prompt that stalls them for one pass.
    res = make_sim([(0.0, 100, 30), (0.02, 2000, 2)]).run(lambda s: 4096)
    d, dec = res.pass_duration_s, res.pass_decodes
    itl = float(np.median(d[dec > 0]))  # about half the decoding passes are slower
    slow = int(((dec > 0) & (d > itl)).sum())
    assert 0 < slow < int((dec > 0).sum())
    s = res.summary(SLO(1.0, itl))
    assert s["slow_pass_share"] == slow / int((dec > 0).sum())
    assert res.summary(SLO(1.0, float(d.max())))["slow_pass_share"] == 0.0
    assert np.isnan(make_sim([(0.0, 50, 1)]).run(lambda s: 512).summary()["slow_pass_share"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(["time-budget:2", "time-budget-deadline-kv:16", "time-budget-slack:16",
                             "queue-depth", "free-ride"]),
       cap=st.sampled_from([0.25, 1.0, 2.0, 4.0]), seed=st.integers(0, 50))
def test_a_capped_policy_makes_no_pass_with_decodes_over_the_cap(spec, cap, seed):
    """Every pass that carries prefill while anyone decodes is priced within the cap; no
    capped budget is above the policy's own; the capped time-budget rule is the rule at
    the smaller of its fraction and the cap, and a budget the cap does not cut is the
    policy's own."""
    capped_sc = A100.with_fields(max_pass_itl=cap)
    capped, free = make_policy(spec, capped_sc), make_policy(spec, A100)
    assert capped.max_pass_s == pytest.approx(cap * 0.05) and free.max_pass_s is None
    sim = A100.simulator(A100.stream(seed, 51, 7, 40))
    while sim.advance():
        state = sim.state()
        got, own = capped(state), free(state)
        assert got <= own
        if spec == "time-budget:2":
            assert got == make_policy(f"time-budget:{min(2.0, cap)}", A100)(state)
        n = state.running_decodes
        if n and got > n:
            price = chunk_price(state.cost, n, state.decode_context_tokens, got - n,
                                state.head_prefilled_tokens)
            assert price <= cap * 0.05 * (1 + 1e-9)
        if got == own and n:
            assert capped_budget(state, own, cap * 0.05) == own
        sim.step(got)
    res = sim.result()
    stall = (res.pass_prefill_tokens > 0) & (res.pass_decodes > 0)
    assert (res.pass_duration_s[stall] <= cap * 0.05 * (1 + 1e-9)).all()


def test_static_budgets_are_not_capped():
    """A static budget is what a capped controller is measured against: vLLM's own setting."""
    sc = A100.with_fields(max_pass_itl=0.5)
    sim = sc.simulator(sc.stream(0, 1, 7, 30))
    for spec in ("static:8192", "vllm-default"):
        assert make_policy(spec, sc).max_pass_s is None
    while sim.advance():
        state = sim.state()
        assert make_policy("static:8192", sc)(state) == make_policy("static:8192", A100)(state)
        sim.step(512)


def test_the_environment_maps_every_action_within_the_cap():
    from envs.actions import pass_budget
    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler

    env = ChunkBudgetEnv(scenario=A100.with_fields(max_pass_itl=1.0),
                         sampler=EpisodeSampler(episode_requests=40))
    env.reset(seed=3)
    top = len(FRACTION_LADDER) - 1
    steps = 0
    while steps < 60:
        state = env.sim.state()
        if state.running_decodes:
            assert env.budget_for(FRACTION_LADDER[-1]) == pass_budget(state, "time", 1.0, 0.05)
            assert env.budget_for(0.5) == pass_budget(state, "time", 0.5, 0.05)
            steps += 1
        *_, term, trunc, _ = env.step(top)
        if term or trunc:
            env.reset()
    free = ChunkBudgetEnv(scenario=A100, sampler=EpisodeSampler(episode_requests=40))
    free.reset(seed=3)
    while not free.sim.state().running_decodes:
        free.step(top)
    state = free.sim.state()
    assert free.budget_for(16.0) > pass_budget(state, "time", 1.0, 0.05)


def test_the_teacher_is_capped_too():
    from agents.setup import teacher_actions
    from envs.observation import OBSERVATION_FIELDS

    rng = np.random.default_rng(0)
    raw = rng.uniform(0, 1, size=(200, len(OBSERVATION_FIELDS))).astype(np.float32)
    free = teacher_actions("time-budget-deadline-kv:16", FRACTION_LADDER, raw)
    capped = teacher_actions("time-budget-deadline-kv:16", FRACTION_LADDER, raw, max_pass=1.0)
    one = int(np.argmin(np.abs(np.log(FRACTION_LADDER))))  # the rung nearest 1
    assert (free > one).any() and (free <= one).any()
    assert (capped == np.minimum(free, one)).all()
    # The clone reads the cap from its episodes' scenarios, with a teacher per condition too.
    from types import SimpleNamespace

    from agents.setup import _teacher_actions_by_env

    scs = [A100.with_fields(max_pass_itl=1.0)] * len(raw)
    venv = SimpleNamespace(get_attr=lambda name: scs)
    spec = "time-budget-deadline-kv:16"
    assert (_teacher_actions_by_env(venv, raw, spec, FRACTION_LADDER, None, []) == capped).all()
    conds = [dict(hardware="a100-80g", capacity_rps=1.0)]
    assert (_teacher_actions_by_env(venv, raw, "time-budget:1", FRACTION_LADDER, [spec], conds)
            == capped).all()


def test_a_rule_s_table_under_a_cap_is_the_capped_rule_and_says_so(tmp_path):
    from eval.export.rules import rule_table
    from policies.table_policy import TablePolicy

    sc = A100.with_fields(max_pass_itl=2.0)
    made = rule_table("time-budget-deadline-kv:16", sc, sc.stream(0, 1, 7, 60))
    assert made.action.max_fraction == 2.0 and max(made.action.cells) <= 2.0
    assert made.fidelity["rule_check"]["differ"] == 0
    path = tmp_path / "t.json"
    made.save(str(path))
    again = BudgetTable.load(str(path))
    assert again.action.max_fraction == 2.0
    assert "no pass over 2 times the ITL target while anyone decodes" in again.describe()
    assert "rule's exact table under a cap of 2 times the ITL target: a rule" in again.origin()
    assert "while anyone decodes" in again.provenance["rule"]
    # A cap in the file binds whatever the cells say.
    data = json.loads(path.read_text())
    data["fractions"] = [16.0] * len(data["fractions"])
    data["action"]["max_fraction"] = 1.0
    table, rule = TablePolicy(BudgetTable(data)), make_policy("time-budget:1", A100)
    from eval.table_use import TableTrace
    assert TableTrace(table).used(16.0) == 1.0  # what the reports say the table spends
    half = TablePolicy(BudgetTable(data)).limit_pass(sc.with_fields(max_pass_itl=0.5))
    assert TableTrace(half).used(16.0) == 0.5
    sim = sc.simulator(sc.stream(1, 2, 7, 40))
    while sim.advance():
        state = sim.state()
        assert table(state) == rule(state)
        sim.step(rule(state))
    for bad in (0, 17, "x", -1):
        data["action"]["max_fraction"] = bad
        with pytest.raises(TableError, match=r"action.max_fraction: got .*must be a number in \(0, 16\]") as err:
            BudgetTable(data)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [
    ("eval", "capacity", "--max-pass-itl", "100"),
    ("eval", "compare", "--max-pass-itl", "0"),
    ("eval", "suite", "--max-pass-itl", "0.1", "--scenarios", "laptop"),
    ("train.py", "--max-pass-itl", "-1"),
    ("eval", "export", "--run-dir", "nowhere", "--max-pass-itl", "20"),
])
def test_a_cap_out_of_range_is_one_line_and_exit_2(argv):
    out = cli(*argv)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_pass_itl" in lines[0] and "16" in lines[0], out.stderr


def test_a_token_budget_run_refuses_a_cap_it_could_not_ship():
    out = cli("train.py", "--actions", "tokens", "--max-pass-itl", "4")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: max_pass_itl: got 4.0, needs --actions time (a token table cannot hold a cap on "
        "the pass's time)"], out.stderr


def test_capacity_reports_the_stalls_at_each_stream_s_capacity():
    """The worst gap (largest over the streams) and the slow-pass share (their mean) are
    those of each stream's run at the load its capacity was found at."""
    from eval.capacity import capacity, probe_stream

    sc = A100.with_fields(max_pass_itl=1.0)
    res = capacity(sc, make_policy("time-budget-deadline-kv:16", sc), seeds=2, num_requests=80)
    gaps, slow = [], []
    for i, f in enumerate(res.factors):
        at, w = probe_stream(sc, i, 2, 80, f)
        s = at.simulator(w).run(make_policy("time-budget-deadline-kv:16", sc)).summary(at.slo())
        gaps.append(s["itl_max_s"])
        slow.append(s["slow_pass_share"])
    assert res.at_capacity() == (max(gaps), pytest.approx(np.mean(slow)))
    assert res.as_json()["itl_max_s_at_capacity"] == max(gaps)
    assert res.stall_text() == f"{max(gaps) * 1000:,.0f} ms, {np.mean(slow):.1%}"
    from eval.report import scenario_line
    assert scenario_line(sc).endswith("no pass over 1 times the ITL target while anyone decodes "
                                      "(static budgets are not capped)")
    assert "no pass over" not in scenario_line(A100)


def test_the_reference_rolls_out_and_serves_under_the_cap():
    """The MPC reference (a diagnostic) is capped like any adaptive policy, and scores its
    candidates as they would serve: under the cap."""
    from policies.reference import reference_for

    sc = A100.with_fields(max_pass_itl=1.0, num_requests=30)
    ref = make_policy("reference:8192:1:0.5", sc)
    assert ref.max_pass_s == pytest.approx(0.05)
    assert reference_for(sc, 8192).max_pass_s == pytest.approx(0.05)  # the reports' and checks' own
    res = sc.simulator(sc.stream(0, 1, 7, 30)).run(ref)
    stall = (res.pass_prefill_tokens > 0) & (res.pass_decodes > 0)
    assert stall.any() and (res.pass_duration_s[stall] <= 0.05 * (1 + 1e-9)).all()
