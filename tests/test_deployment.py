"""Deployments as a policy sees them: their features (computed alike by the simulator's
observation and the table runtime), tables that carry to other deployments re-priced for
them, and the deployments a policy trained across them is held out of."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.conditions import draw_conditions
from agents.conditions import held_out
from envs.deployment import (FEATURES, HELD_OUT_DEPLOYMENTS, MADE_UP_PART, TRAINING_DEPLOYMENTS,
                             deployment, feature_range, scaled)
from envs.errors import ConfigError
from envs.observation import OBSERVATION_FIELDS, observe
from envs.pricing import Coefficients, chunk_price
from envs.profiles import get_hardware
from envs.scenario import Scenario
from eval.export.cells import scenario_provenance, time_action
from eval.export.rules import rule_table
from policies.table import BudgetTable, TableError
from policies.table_policy import TablePolicy, load_table_policy

FLAT = Coefficients(weights_s=0.008, kv_s_per_token=0.0, token_s=1e-5, pair_s=0.0, exposed=0.0,
                    fixed_s=0.002, serial_s_per_token=0.0)


def test_features_by_hand():
    # One decode: max(8 ms of weights, 1e-5 s x (1 + x) of products) + 2 ms fixed.
    d = deployment(FLAT, ttft_s=2.0, itl_s=0.1, kv_tokens=400_000)
    assert d.decode_floor_vs_itl == pytest.approx(0.010 / 0.1)
    assert d.fixed_share == pytest.approx(0.002 / 0.010)
    assert d.prefill_tokens_per_itl == 9799  # 1e-5 x 9,800 = 98 ms, + 2 ms = 100 ms
    assert d.kv_prompts == pytest.approx(400_000 / (20 * 9799))  # 20 ITL targets in the TTFT's
    assert (d.slo_ttft_s, d.slo_itl_s) == (2.0, 0.1)
    # An ITL target the lightest pass cannot meet: no prefill fits, the cache holds endless prompts.
    slow = deployment(FLAT, ttft_s=2.0, itl_s=0.005, kv_tokens=1000)
    assert slow.prefill_tokens_per_itl == 0 and math.isinf(slow.kv_prompts)
    assert scaled(slow)[3] == 1.0


@settings(max_examples=60, deadline=None)
@given(weights=st.floats(1e-4, 0.1), token=st.floats(1e-7, 1e-3), fixed=st.floats(0, 0.05),
       itl=st.floats(0.01, 1.0))
def test_prefill_tokens_per_itl_is_the_largest_chunk_within_the_target(weights, token, fixed, itl):
    c = FLAT._replace(weights_s=weights, token_s=token, fixed_s=fixed)
    x = deployment(c, 2.0, itl, 10_000).prefill_tokens_per_itl
    if x:
        assert chunk_price(c, 1, 0, x) <= itl
    assert x == 1 << 20 or chunk_price(c, 1, 0, x + 1) > itl
    assert all(0.0 <= v <= 1.0 for v in scaled(deployment(c, 2.0, itl, 10_000)))


@pytest.mark.parametrize("hardware, model", [("h100-sxm", "llama-3-8b"), ("l40s", "llama-3-8b"),
                                             ("h100-sxm", "llama-3-70b-tp4"), (MADE_UP_PART, "llama-3-8b")])
def test_the_observation_carries_the_deployment_the_scenario_describes(hardware, model):
    sc = Scenario(hardware=hardware, model=model, slo_ttft_s=5.0, slo_itl_s=0.15, num_requests=40,
                  per_pass_overhead_s=0.003)
    sim = sc.simulator()
    sim.advance()
    obs = observe(sim.state(), sc.slo())
    assert len(obs) == len(OBSERVATION_FIELDS) == 19
    np.testing.assert_allclose(obs[-4:], np.float32(scaled(sc.deployment())), rtol=1e-6)
    # Another part, the same state counts: the deployment entries tell them apart.
    other = observe(Scenario(num_requests=40).simulator().state(), sc.slo())
    assert not np.allclose(obs[-4:], other[-4:])


def test_a_hardware_spec_changes_a_presets_figures_in_one_string():
    hw = get_hardware(MADE_UP_PART)
    a100 = get_hardware("a100-80g")
    assert hw.hbm_bytes_per_s == pytest.approx(2 * a100.hbm_bytes_per_s)
    assert hw.peak_flops_per_s == pytest.approx(a100.peak_flops_per_s / 2)
    assert hw.overlap == a100.overlap and hw.name == MADE_UP_PART
    for bad, says in (("a100-80g@nope=1", "must list field=value pairs"),
                      ("a100-80g@hbm_bytes_per_s=fast", "must be a number"),
                      ("a100-80g@overlap=2", "hardware.overlap")):
        with pytest.raises(ConfigError, match=says):
            get_hardware(bad)


# --- training across deployments ------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conditions_across_deployments_never_draw_a_held_out_one(seed):
    conds = draw_conditions(Scenario(), 40, seed, TRAINING_DEPLOYMENTS)
    assert conds == draw_conditions(Scenario(), 40, seed, TRAINING_DEPLOYMENTS)  # deterministic
    bases = {(c["hardware"].partition("@")[0], c["model"]) for c in conds}
    assert bases <= set(TRAINING_DEPLOYMENTS) and len(bases) >= 6
    assert not any(held_out(c["hardware"], c["model"]) for c in conds)
    for c in conds:  # each a variant of its preset within the perturbation
        hw, base = get_hardware(c["hardware"]), get_hardware(c["hardware"].partition("@")[0])
        assert 1 / 1.5 - 1e-3 <= hw.hbm_bytes_per_s / base.hbm_bytes_per_s <= 1.5 + 1e-3
        sc = Scenario(**c, num_requests=300)
        assert sc.num_kv_blocks is None or sc.num_kv_blocks <= Scenario(
            hardware=c["hardware"], model=c["model"]).kv_tokens() // 16
        sc.simulator()  # every request fits the cache (a mix too long for it is not drawn)


def test_held_out_deployments_are_held_out_whatever_their_variant():
    for hw, model in HELD_OUT_DEPLOYMENTS:
        assert held_out(hw, model)
    assert held_out("h200@hbm_bytes_per_s=4e12", "mistral-7b")  # the part, with any model
    assert held_out("h100-sxm@peak_flops_per_s=9e14", "llama-3-70b-tp4")
    # The made-up part however it is written: its figures, not its spelling.
    assert held_out("a100-80g@peak_flops_per_s=1.56e14,hbm_bytes_per_s=4078000000000", "mistral-7b")
    assert not held_out("h100-sxm", "llama-3-70b-tp8") and not held_out("a100-80g", "llama-3-70b-tp4")
    assert not held_out("a100-80g@hbm_bytes_per_s=3e12", "llama-3-8b")


def test_the_range_spans_the_deployments_drawn():
    scs = [Scenario(hardware="h100-sxm"), Scenario(hardware="a100-80g", slo_itl_s=0.05)]
    rng = feature_range(sc.deployment() for sc in scs)
    assert list(rng) == list(FEATURES)
    for sc in scs:
        for name, v in sc.deployment().as_dict().items():
            assert rng[name][0] <= v <= rng[name][1]
    assert rng["slo_itl_s"] == [0.05, 0.1]
    # A feature that is not finite (no prefill fits a 5 ms target) is left out of its range.
    slow = deployment(FLAT, ttft_s=2.0, itl_s=0.005, kv_tokens=1000)
    assert "kv_prompts" not in feature_range([slow])
    assert feature_range([slow, scs[0].deployment()])["kv_prompts"] == [scs[0].deployment().kv_prompts] * 2


# --- tables that carry ------------------------------------------------------------------

def _states(sc: Scenario, passes: int = 400):
    """Table inputs before the passes of a simulator run on ``sc``."""
    sim = sc.simulator()
    out = []
    names = ("running_decodes", "waiting_requests", "waiting_prefill_tokens", "kv_usage",
             "decode_context_tokens", "head_prefilled_tokens", "head_remaining_tokens",
             "oldest_wait_s", "last_step_s")
    while sim.advance() and len(out) < passes:
        st_ = sim.state()
        meter = st_.itl_slack(sc.slo_itl_s)
        out.append({**{n: getattr(st_, n) for n in names}, "itl_slow_tokens": meter.slow,
                    "itl_decode_tokens": meter.tokens})
        sim.step(2048)
    return out


@pytest.mark.parametrize("rule", ["time-budget-deadline-kv:4", "time-budget-slack:8"])
def test_a_rule_table_re_priced_is_the_rule_table_exported_for_that_deployment(rule):
    a = Scenario(num_requests=60, rate=6.0)
    b = Scenario(hardware="l40s", slo_ttft_s=5.0, slo_itl_s=0.15, num_requests=60, rate=1.5,
                 per_pass_overhead_s=0.004)
    ta, tb = rule_table(rule, a, a.arrivals()), rule_table(rule, b, b.arrivals())
    moved = ta.repriced(b.simulator_cost(), b.slo_ttft_s, b.slo_itl_s, b.kv_tokens())
    assert moved.features == tb.features
    for e1, e2 in zip(moved.edges, tb.edges):
        assert e1 == pytest.approx(e2)
    assert moved.action.cost == tb.action.cost and moved.action.itl_s == tb.action.itl_s
    states = _states(b)
    assert len(states) > 100
    assert [moved.budget(s) for s in states] == [tb.budget(s) for s in states]
    assert moved.provenance["repriced_from"]["slo"] == {"ttft_s": 2.0, "itl_s": 0.1}


def _carrying_table(sc: Scenario, rng: dict | None, axis: str | None = None) -> BudgetTable:
    features = [{"name": "kv_usage", "edges": [0.8]}]
    fractions = [1.0, 0.5]
    if axis:
        features.append({"name": axis, "edges": [5.0]})
        fractions = [1.0, 2.0, 0.5, 0.25]  # (kv low, axis low), (kv low, axis high), ...
    return BudgetTable({
        "schema_version": 2, "kind": "chunkpilot-budget-table", "action": time_action(sc),
        "features": features, "fractions": fractions, "default_budget": 2048,
        "provenance": {**scenario_provenance(sc),
                       "deployments": {"range": rng, "kv_tokens": sc.kv_tokens()}}})


def test_a_deployment_feature_is_a_constant_of_the_deployment_the_table_serves():
    h100 = Scenario()
    table = _carrying_table(h100, {}, axis="kv_prompts")
    assert "kv_prompts" not in table.needs  # an engine supplies nothing for it
    assert table.action.deployment["kv_prompts"] == pytest.approx(h100.deployment().kv_prompts)
    state = dict(running_decodes=20, decode_context_tokens=20 * 1000, head_prefilled_tokens=0,
                 kv_usage=0.1)
    # h100 + llama-3-8b holds 6 TTFT targets' worth of prompts: above the edge, fraction 2.
    assert h100.deployment().kv_prompts > 5.0 and table.action.fraction(state) == 2.0
    small = Scenario(num_kv_blocks=3000)  # 0.6 targets' worth: below the edge
    moved = table.repriced(small.simulator_cost(), 2.0, 0.1, small.kv_tokens())
    assert moved.action.deployment == small.deployment().as_dict()
    assert moved.action.fraction(state) == 1.0
    data = table.to_dict()
    data["provenance"]["deployments"] = None  # no KV cache to measure the deployment with
    with pytest.raises(TableError, match="deployments.kv_tokens: got None"):
        BudgetTable(data)
    data = {**table.to_dict(), "action": {"kind": "tokens"}, "budgets": [512, 1024, 2048, 4096]}
    del data["fractions"]
    with pytest.raises(TableError, match="kv_prompts is derived by a time_fraction action only"):
        BudgetTable(data)


def test_a_table_outside_its_trained_range_is_refused_unless_allowed(tmp_path, capsys):
    h100 = Scenario()
    d = h100.deployment()
    rng = {name: [v * 0.9, v * 1.1] for name, v in d.as_dict().items()}
    path = tmp_path / "carries.json"
    _carrying_table(h100, rng).save(str(path))
    # Inside: re-priced for the scenario (its SLO pair a hair apart is still inside).
    policy = load_table_policy(str(path), h100.with_fields(slo_itl_s=0.105))
    assert policy.table.action.itl_s == 0.105 and policy.table.provenance["slo"]["itl_s"] == 0.105
    l40s = Scenario(hardware="l40s")
    with pytest.raises(ConfigError, match=r"outside the range of deployments it was made for: decode_floor_vs_itl "
                                          r"0\.238\S* not in \[0\.0548"):
        load_table_policy(str(path), l40s)
    policy = load_table_policy(str(path), l40s, allow_mismatch=True)
    assert "outside the range" in capsys.readouterr().err
    assert isinstance(policy, TablePolicy) and policy.table.action.cost == l40s.simulator_cost()
    # The check command says the same.
    from policies.table.__main__ import main
    assert main(["check", str(path), "--hardware", "l40s", "--model", "llama-3-8b"]) == 2
    assert main(["check", str(path), "--hardware", "h100-sxm", "--model", "llama-3-8b"]) == 0
    assert "carries to hardware h100-sxm" in capsys.readouterr().out


@pytest.mark.parametrize("block, says", [
    ({"range": {"nope": [0, 1]}}, "the features are decode_floor_vs_itl"),
    ({"range": {"kv_prompts": [2, 1]}}, "must be [low, high]: finite numbers, low <= high"),
    ({"range": {"kv_prompts": [2, float("inf")]}}, "must be [low, high]: finite numbers"),
    ({"range": [1, 2]}, "must map features to [low, high]"),
    ({"range": {}, "kv_tokens": -5}, "deployments.kv_tokens: got -5, must be"),
    ([1, 2], "provenance.deployments: must be an object"),
])
@pytest.mark.parametrize("axis", [None, "kv_prompts"])
def test_a_bad_deployments_block_is_a_one_line_error(block, says, axis):
    data = _carrying_table(Scenario(), {}, axis=axis).to_dict()
    data["provenance"]["deployments"] = block
    with pytest.raises(TableError, match=re.escape(says)):
        BudgetTable(data)


def test_the_range_check_has_a_hair_of_slack_at_its_ends():
    sc = Scenario()
    v = sc.deployment().kv_prompts
    table = _carrying_table(sc, {"kv_prompts": [v, v]})
    assert table.outside({"kv_prompts": v * (1 + 1e-9)}) is None
    assert "kv_prompts" in table.outside({"kv_prompts": v * 1.001})
    zero = _carrying_table(sc, {"fixed_share": [0.0, 0.0]})
    assert zero.outside({"fixed_share": 0.0}) is None and zero.outside({"fixed_share": 1e-3})



def _run_across_deployments(actions: str, conditions: list[dict]):
    from types import SimpleNamespace

    args = {"load_low": 0.5, "load_high": 1.5, "episode_s": 20.0, "all_deployments": True}
    return SimpleNamespace(actions=actions, config={
        "args": args, "conditions": conditions,
        "deployments": {"trained": [list(d) for d in TRAINING_DEPLOYMENTS],
                        "range": feature_range(Scenario(**{k: v for k, v in c.items()
                                                           if k != "capacity_rps"}).deployment()
                                               for c in conditions)}})


@pytest.mark.parametrize("actions", ["time", "tokens"])
def test_the_export_of_a_run_across_deployments_draws_on_every_deployment_it_can_carry_to(actions):
    """A run acting in time exports a table that carries, built from every training
    deployment's conditions at their own SLO pairs (the table is re-priced for each); one
    acting in tokens, the serving deployment's table from its conditions alone (the others'
    budgets are tokens of other parts), at the table's SLO."""
    from eval.export.args import ExportArgs
    from eval.export.carry import carries
    from eval.export.record import export_episodes

    conditions = draw_conditions(Scenario(), 40, 0, TRAINING_DEPLOYMENTS)
    conditions = [{**c, "capacity_rps": 1.0} for c in conditions]
    model = _run_across_deployments(actions, conditions)
    serving = Scenario(hardware="a100-80g")
    build, held = export_episodes(model, serving, ExportArgs(run_dir="x", build_episodes=12,
                                                            held_episodes=4))
    drawn = {(sc.hardware.partition("@")[0], sc.model) for sc, _ in build + held}
    assert carries(model) == (actions == "time")
    if actions == "tokens":
        assert drawn == {("a100-80g", "llama-3-8b")}
        assert any("@" in sc.hardware for sc, _ in build)  # the deployment's variants among them
        assert {(sc.slo_ttft_s, sc.slo_itl_s) for sc, _ in build + held} == {(2.0, 0.1)}
    else:
        assert len(drawn) >= 4 and drawn <= set(TRAINING_DEPLOYMENTS)
        slos = {(c["slo_ttft_s"], c["slo_itl_s"]) for c in conditions}
        assert {(sc.slo_ttft_s, sc.slo_itl_s) for sc, _ in held} <= slos
        assert len({(sc.slo_ttft_s, sc.slo_itl_s) for sc, _ in build}) >= 3


class _TableModel:
    """A stand-in for a run across deployments whose policy is a table that carries: at each
    scenario it acts as that table re-priced for it (the fraction of the cell it looks up)."""

    actions, kind, name = "time", "model", "model:carrying"
    config = {"args": {"all_deployments": True}}

    def __init__(self, table: BudgetTable, scenario: Scenario | None = None):
        from policies.table_policy import for_scenario

        self.table, self.slo = table, scenario and scenario.slo()
        self.served = scenario and TablePolicy(for_scenario(table, scenario, True))

    def at(self, scenario):
        return _TableModel(self.table, scenario)

    def reset(self):
        pass

    def action_value(self, state) -> float:
        return self.served.table.action.cells[self.served.cell(state)]

    def budget_for_value(self, state, value) -> int:
        return self.served(state)


def test_a_table_exported_across_deployments_is_the_policy_it_copies_on_each_of_them():
    """A policy whose fractions hang on the deployment (the deadline-KV rule at TOP 4 below
    2,500 prefill tokens per target, at TOP 16 above) recorded on an H100 and on an A100 at
    two SLO pairs: each decision holds its deployment's features and the deadline priced
    with its own cost model, in the H100 table's targets, so that a table built from them
    over the policy's features is, re-priced for each deployment, the policy there, pass
    for pass."""
    from envs.state import DERIVED
    from eval.export.carry import table_policy
    from eval.export.cells import build_table
    from eval.export.features import CARRIED, feature_values
    from eval.export.record import collect
    from eval.export.rules import by_deployment
    from policies.table import SECONDS_FEATURES
    from policies.table_policy import for_scenario

    rules = ["time-budget-deadline-kv:4", "time-budget-deadline-kv:16"]
    h100 = Scenario(num_requests=80, rate=7.0)
    a100 = Scenario(hardware="a100-80g", num_requests=80, rate=1.5)
    loose = a100.with_fields(slo_ttft_s=5.0, slo_itl_s=0.2, rate=2.5)  # 2,560 tokens per target
    fitted = [Scenario(hardware=h, model=m) for h, m in TRAINING_DEPLOYMENTS]
    teacher = by_deployment(rules, "prefill_tokens_per_itl", [2500.0], h100, h100.arrivals(), fitted)
    model = _TableModel(teacher)
    frame = {"ttft_s": 2.0, "itl_s": 0.1}
    state, values = collect(model, [(sc, sc.arrivals()) for sc in (h100, a100, loose)], frame=frame)
    assert set(CARRIED) <= set(state)
    assert set(np.unique(state["prefill_tokens_per_itl"])) == {
        sc.deployment().prefill_tokens_per_itl for sc in (h100, a100, loose)}
    # Each decision's derived and deployment features are what the table re-priced for its
    # deployment computes, every feature in seconds scaled to the table's targets.
    for sc in (h100, a100, loose):
        runtime = for_scenario(teacher, sc, True).action
        own = {"ttft_s": sc.slo_ttft_s, "itl_s": sc.slo_itl_s}
        scale = {n: frame[t] / own[t] for n, t in SECONDS_FEATURES.items()}
        rows = np.flatnonzero(state["prefill_tokens_per_itl"] == sc.deployment().prefill_tokens_per_itl)
        assert len(rows) > 100
        for i in rows[::7]:
            row = {n: state[n][i] / scale.get(n, 1.0) for n in state}  # as the engine reads it
            for n in list(DERIVED) + list(CARRIED):
                assert state[n][i] == pytest.approx(runtime.value(n, row) * scale.get(n, 1.0),
                                                    rel=1e-12), n
    action = time_action(h100)
    prov = {**scenario_provenance(h100), "deployments": {"range": {}, "kv_tokens": h100.kv_tokens()}}
    built = build_table({n: feature_values(n, state, action) for n in teacher.features}, values, 8,
                        prov, action, edges=[list(e) for e in teacher.edges])
    for sc in (h100, a100, loose):
        want, got = table_policy(teacher, sc, True), table_policy(built, sc, True)
        states = _states(sc)
        assert len(states) > 100
        assert [got.table.budget(s) for s in states] == [want.table.budget(s) for s in states]


def test_a_table_that_carries_records_the_range_of_the_deployments_it_was_made_from():
    """Its provenance: every deployment feature a table may bucket, over the deployments
    its decisions came from (each at its own SLO), the serving KV cache, and the run's
    training deployments."""
    from eval.export.carry import trained_range
    from eval.export.features import CARRIED

    h100, a100 = Scenario(), Scenario(hardware="a100-80g", slo_itl_s=0.2)
    run = _run_across_deployments("time", [{"hardware": h, "model": m} for h, m in TRAINING_DEPLOYMENTS])
    block = trained_range(run, h100, [h100, a100, a100])
    assert set(block["range"]) == set(CARRIED) and block["kv_tokens"] == h100.kv_tokens()
    for name in CARRIED:
        values = sorted(getattr(sc.deployment(), name) for sc in (h100, a100))
        assert block["range"][name] == values
    assert block["trained"][1] == "a100-80g + llama-3-8b"


def test_a_table_that_carries_is_judged_on_each_deployment_its_run_trained_on():
    """The export chooses and checks a table that carries on the serving scenario and one
    training condition per other deployment, at its own SLO pair, loaded at the capacity
    measured in training; a run on one deployment, on the serving scenario's variants."""
    from eval.export.carry import judged_scenarios
    from eval.scenarios import final_scenarios

    conditions = [{"hardware": "a100-80g@hbm_bytes_per_s=2e12", "model": "llama-3-8b",
                   "slo_ttft_s": 5.0, "slo_itl_s": 0.2, "rate": 9.0, "capacity_rps": 1.7},
                  {"hardware": "a100-80g", "model": "llama-3-8b", "capacity_rps": 1.5},
                  {"hardware": "h100-sxm", "model": "qwen2.5-32b", "capacity_rps": 0.6},
                  {"hardware": "h100-sxm", "model": "llama-3-8b", "capacity_rps": 6.0}]
    serving = Scenario()
    judged = judged_scenarios(_run_across_deployments("time", conditions), serving)
    assert list(judged) == ["serving", "a100-80g + llama-3-8b", "h100-sxm + qwen2.5-32b"]
    a100 = judged["a100-80g + llama-3-8b"]
    assert a100.hardware == "a100-80g@hbm_bytes_per_s=2e12" and a100.rate == 1.7
    assert (a100.slo_ttft_s, a100.slo_itl_s) == (5.0, 0.2)
    one = _run_across_deployments("tokens", conditions)
    assert list(judged_scenarios(one, serving)) == list(final_scenarios(serving))


@pytest.mark.parametrize("carry", [True, False])
def test_a_kept_rule_carries_to_any_deployment_where_the_export_carries(carry):
    """Where a run across deployments keeps a rule's table, the table carries to any
    deployment (a rule's cells do not depend on it), not within the run's range; a run on
    one deployment keeps a rule's table for that deployment, as before."""
    from eval.export.args import ExportArgs
    from eval.export.select import kept_table

    sc = Scenario(num_requests=40, rate=6.0)
    rule = rule_table("time-budget-deadline-kv:4", sc, sc.arrivals())
    prov = {**scenario_provenance(sc), "rule": "the model's"}
    if carry:
        prov["deployments"] = {"range": {"prefill_tokens_per_itl": [300.0, 4000.0]},
                               "kv_tokens": sc.kv_tokens()}
    data, _, built = kept_table([], [("time-budget-deadline-kv:4", rule)],
                                (["time-budget-deadline-kv:4"], ["rule"]), {"chosen": 0},
                                ExportArgs(run_dir="x"), prov)
    table = BudgetTable(data)
    assert built == 0 and table.rule_spec() == "time-budget-deadline-kv"  # TOP 4: its default
    assert table.deployment_range == ({} if carry else None)


def test_the_export_notes_a_table_that_carries_but_reads_no_deployment_feature():
    """A learned table made from several deployments that buckets none of their features
    serves each the same cells: the export says so. A rule's table (its cells do not depend
    on the deployment) and a table that buckets a deployment feature get no such note."""
    from eval.export.report import blind_note
    from eval.export.rules import by_deployment

    sc = Scenario(num_requests=40, rate=6.0)
    rule = rule_table("time-budget-deadline-kv:4", sc, sc.arrivals())
    assert rule.deployment_range == {} and blind_note(rule) == []
    data = rule.to_dict()
    data["provenance"]["deployments"]["range"] = {"prefill_tokens_per_itl": [300.0, 4000.0]}
    (note,) = blind_note(BudgetTable(data))
    assert note.startswith("NOTE: the table reads no feature of the deployment") and "--features" in note
    picked = by_deployment(["time-budget-deadline-kv:4", "time-budget-deadline-kv:16"],
                           "prefill_tokens_per_itl", [2900.0], sc, sc.arrivals(),
                           [sc, Scenario(hardware="a100-80g")])
    assert picked.deployment_range and blind_note(picked) == []


def test_a_run_across_deployments_exports_a_named_deployments_own_table():
    """Told a deployment, the export of a run across deployments treats its model as a run
    on that deployment alone: one condition, the serving workload there at the model's
    capacity, so that its table is built, chosen and checked there and does not carry."""
    from types import SimpleNamespace

    from eval.export.args import ExportArgs
    from eval.export.carry import carries, judged_scenarios, on_deployment
    from eval.export.record import export_episodes
    from eval.scenarios import final_scenarios

    class Model(SimpleNamespace):
        def at(self, scenario):
            return Model(**vars(self))

    conditions = [{"hardware": "h100-sxm", "model": "llama-3-8b", "capacity_rps": 6.0}]
    run = Model(actions="time", config={"args": {"all_deployments": True, "load_low": 0.9,
                                                 "load_high": 1.3, "episode_s": 20.0},
                                        "conditions": conditions})
    l40s = Scenario(hardware="l40s", rate=0.55)
    named = on_deployment(run, l40s, 0.55)
    assert carries(run) and not carries(named)
    assert run.config["conditions"] == conditions  # the run itself is untouched
    assert named.config["exported_for"] == "l40s + llama-3-8b"
    build, held = export_episodes(named, l40s, ExportArgs(run_dir="x", build_episodes=6, held_episodes=3))
    assert {(sc.hardware, sc.model) for sc, _ in build + held} == {("l40s", "llama-3-8b")}
    assert all(0.55 * 0.9 <= sc.rate <= 0.55 * 1.3 * 1.001 for sc, _ in held)
    assert list(judged_scenarios(named, l40s)) == list(final_scenarios(l40s))


def test_naming_a_deployment_is_refused_in_one_line_where_it_cannot_serve(tmp_path):
    """An unknown part is refused before the run is read; a run on one deployment, which
    knows only its own, and a deployment's feature for a table that does not carry, before
    any simulation (the model's capacity there included)."""
    from types import SimpleNamespace

    from envs.cli import parse
    from eval.export.args import ExportArgs
    from eval.export.cli import check_against_run
    from tests.conftest import cli, refused_in_one_line

    refused_in_one_line(cli("eval", "export", str(tmp_path / "run"), "--out", str(tmp_path / "t.json"),
                            "--hardware", "nope"), "hardware: unknown preset 'nope'")
    one = SimpleNamespace(actions="time", config={"args": {"all_deployments": False}})
    with pytest.raises(ConfigError, match="naming a deployment needs a run across deployments"):
        check_against_run(parse(ExportArgs, ["--run-dir", "x", "--hardware", "l40s"]), one, Scenario())
    across = SimpleNamespace(actions="time", config={"args": {"all_deployments": True}})
    with pytest.raises(ConfigError, match="prefill_tokens_per_itl is a deployment's feature"):
        check_against_run(parse(ExportArgs, ["--run-dir", "x", "--hardware", "l40s", "--features",
                                             "prefill_tokens_per_itl"]), across, Scenario())
    # Traffic of its own only for a deployment named; a bad one named before the run is read.
    refused_in_one_line(cli("eval", "export", str(tmp_path / "run"), "--out", str(tmp_path / "t.json"),
                            "--prompt", "fixed:512"),
                        "prompt: got 'fixed:512', needs a deployment named (--hardware or --model)")
    refused_in_one_line(cli("eval", "export", str(tmp_path / "run"), "--out", str(tmp_path / "t.json"),
                            "--hardware", "l40s", "--burstiness", "0"), "burstiness: got 0")


def test_a_named_deployments_table_is_made_on_the_traffic_given():
    """``--arrival``/``--burstiness``/``--prompt``/``--output`` replace those of the run's
    serving workload for a deployment named; every other field stays the run's, and the
    part's overhead and KV cache are its own."""
    from envs.cli import parse
    from eval.export.args import ExportArgs
    from eval.export.cli import named_serving

    run = Scenario(arrival="gamma", burstiness=0.5, prompt="short-long", per_pass_overhead_s=0.004,
                   num_kv_blocks=900, slo_ttft_s=3.0)
    as_run = named_serving(parse(ExportArgs, ["--run-dir", "x", "--hardware", "l40s"]), run)
    assert as_run == run.with_fields(hardware="l40s", per_pass_overhead_s=None, num_kv_blocks=None)
    given = named_serving(parse(ExportArgs, ["--run-dir", "x", "--hardware", "l40s", "--arrival",
                                             "poisson", "--prompt", "fixed:512"]), run)
    assert given == as_run.with_fields(arrival="poisson", prompt="fixed:512")
    assert given.burstiness == 0.5 and given.slo_ttft_s == 3.0


@pytest.mark.parametrize("flags, across, says", [
    (["--features", "kv_usage,prefill_tokens_per_itl"], False,
     "prefill_tokens_per_itl is a deployment's feature: it needs a run across deployments"),
    (["--refine-streams", "2"], True, "needs a run on one deployment: a table that carries"),
])
def test_an_export_refuses_what_its_run_cannot_give(flags, across, says):
    """A deployment's feature needs a run across deployments; a refinement on the serving
    scenario alone, a run on one deployment (a table that carries is chosen across them)."""
    from types import SimpleNamespace

    from envs.cli import parse
    from eval.export.args import ExportArgs
    from eval.export.cli import check_against_run

    run = SimpleNamespace(actions="time", config={"args": {"all_deployments": across}})
    args = parse(ExportArgs, ["--run-dir", "x", *flags])
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_against_run(args, run, Scenario())
    check_against_run(parse(ExportArgs, ["--run-dir", "x"]), run, Scenario())  # the same run, plainly


def test_a_rule_family_picked_by_the_deployment_is_each_members_table_where_it_serves():
    """``eval export --rule A,B --by FEATURE:EDGE``: re-priced for a deployment below the
    edge the table budgets every pass as A's table exported there, above it as B's."""
    from eval.export.rules import by_deployment

    rules = ["time-budget-deadline-kv:4", "time-budget-deadline-kv:16"]
    h100 = Scenario(num_requests=60, rate=6.0)
    fitted = [Scenario(hardware=h, model=m) for h, m in TRAINING_DEPLOYMENTS]
    table = by_deployment(rules, "prefill_tokens_per_itl", [2500.0], h100, h100.arrivals(), fitted)
    assert table.features[-1] == "prefill_tokens_per_itl" and table.cells == 2 * 56
    assert table.rule_spec() is None and "rules, not a learned policy" in table.origin()
    lo, hi = table.deployment_range["prefill_tokens_per_itl"]
    assert lo == min(sc.deployment().prefill_tokens_per_itl for sc in fitted) and hi > 4000
    for sc, member in ((Scenario(hardware="l40s", num_requests=60, rate=1.5), rules[0]),  # 1,298
                       (Scenario(hardware="h200", num_requests=60, rate=6.0), rules[1])):  # 4,125
        moved = table.repriced(sc.simulator_cost(), 2.0, 0.1, sc.kv_tokens())
        own = rule_table(member, sc, sc.arrivals())
        states = _states(sc)
        assert [moved.budget(s) for s in states] == [own.budget(s) for s in states]


@pytest.mark.parametrize("flags, says", [
    (["--by", "nope:1"], "by: got 'nope', must be a deployment feature"),
    (["--by", "kv_prompts:3:2"], "must be FEATURE:EDGE[:EDGE...] with increasing finite numbers"),
    (["--by", "kv_prompts:nan"], "with increasing finite numbers"),
    (["--by", "kv_prompts:2:3"], "must name 3 rules, one per bucket of kv_prompts (2 edges)"),
])
def test_a_bad_by_is_refused_in_one_line(tmp_path, flags, says):
    from tests.conftest import cli, refused_in_one_line

    refused_in_one_line(cli("eval", "export", "--rule", "time-budget-deadline-kv:4,time-budget-deadline-kv:16",
                            *flags, "--num-requests", "40", "--out", str(tmp_path / "t.json")), says)
    assert not (tmp_path / "t.json").exists()
