"""The learned controller's pieces: the numpy actor, observation normalisation, time-fraction
tables (the runtime converts exactly as the simulator), export and its fidelity."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.pricing import chunk_within
from eval.export.cells import build_table, scenario_provenance
from policies import table as runtime
from policies.table import BudgetTable


def time_table(fractions_by_kv, sc, edges=(0.5, 0.8)):
    cost = sc.simulator().cost.as_dict()
    return BudgetTable({"schema_version": 2, "kind": "chunkpilot-budget-table",
                        "action": {"kind": "time_fraction", "itl_s": sc.slo_itl_s, "cap": 16384,
                                   "cost": cost},
                        "features": [{"name": "kv_usage", "edges": list(edges)}],
                        "fractions": list(fractions_by_kv), "default_budget": 16384,
                        "provenance": scenario_provenance(sc)})


def test_time_fraction_table_looks_up_then_converts():
    from envs.scenario import Scenario

    sc = Scenario()
    t = time_table([1.0, 0.5, 0.25], sc)
    assert t.needs == {"kv_usage", "running_decodes", "decode_context_tokens", "head_prefilled_tokens"}
    cost = sc.simulator().cost
    state = dict(running_decodes=40, decode_context_tokens=40 * 1500, head_prefilled_tokens=2000)
    for kv, f in ((0.2, 1.0), (0.6, 0.5), (0.9, 0.25)):
        want = 40 + chunk_within(cost, 40, 60000, f * sc.slo_itl_s, 2000, cap=16384 - 40)
        assert t.budget({**state, "kv_usage": kv}) == want
    assert t.budget({**state, "running_decodes": 0, "kv_usage": 0.1}) == 16384  # nothing decoding
    # The JSON round trip keeps the kind, the coefficients and the cells.
    again = BudgetTable(t.to_dict())
    assert again.action.cells == t.action.cells and again.action.cost == t.action.cost


@pytest.mark.parametrize("change, message", [
    ({"fractions": [1.0, 30.0, 0.5]}, "fractions: every cell must be a number in (0, 16]"),
    ({"fractions": [1.0, 0.5]}, "fractions: must list 3 cells"),
    ({"action": {"kind": "time_fraction", "itl_s": 0.1, "cap": 16384, "cost": {"weights_s": 1}}},
     "action.cost.kv_s_per_token: got None, must be a finite number >= 0 (seconds)"),
    ({"action": {"kind": "time_fraction", "itl_s": 0.1, "cap": 16384, "cost": 3}},
     "action.cost: must be an object holding weights_s"),
    ({"action": {"kind": "time_fraction", "itl_s": -1, "cap": 16384}}, "action.itl_s"),
])
def test_bad_time_fraction_tables_are_one_line_errors(change, message):
    from envs.scenario import Scenario

    data = time_table([1.0, 0.5, 0.25], Scenario()).to_dict()
    if "action" in change and "cost" not in change["action"]:
        change["action"]["cost"] = data["action"]["cost"]
    data.update(change)
    with pytest.raises(runtime.TableError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BudgetTable(data)


def test_export_builds_a_table_that_reproduces_a_state_dependent_policy():
    """A policy that shrinks its time budget as the KV cache fills: the exported table
    finds the feature and agrees with it on held-out decisions."""
    from envs.scenario import Scenario
    from eval.export.cells import action_spec, agreement
    from eval.export.features import feature_values, pick_features

    rng = np.random.default_rng(0)

    def states(n):
        return {name: rng.random(n) * scale for name, scale in
                (("kv_usage", 1.0), ("running_decodes", 200), ("waiting_requests", 30),
                 ("waiting_prefill_tokens", 1e5), ("decode_context_tokens", 1e6),
                 ("head_prefilled_tokens", 1e4), ("head_remaining_tokens", 1e4),
                 ("oldest_wait_s", 3.0), ("last_step_s", 0.1))}

    def rule(s):
        return np.where(s["kv_usage"] < 0.5, 1.0, np.where(s["kv_usage"] < 0.8, 0.5, 0.25))

    build, held = states(3000), states(1000)

    class Model:
        actions = "time"

    sc = Scenario()
    action = action_spec(Model(), sc)
    prov = scenario_provenance(sc)
    names, score = pick_features((build, rule(build)), (held, rule(held)), 8, 3, prov, action)
    assert names[0] == "kv_usage" and score > 0.94  # quantile edges straddle the 0.8 threshold
    t = build_table({n: feature_values(n, build, action) for n in names}, rule(build), 8,
                    prov, action)
    assert agreement(t, {n: feature_values(n, held, action) for n in names}, rule(held)) > 0.94
    assert set(t.action.cells) == {1.0, 0.5, 0.25}


def test_numpy_actor_and_normalisation_match_the_model(tmp_path):
    """The learned policy acts with a numpy copy of the network on normalised observations,
    as the trained model does through SB3 and VecNormalize."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from policies.learned import UNSEEN_VAR, NumpyActor, ObsNorm

    venv = VecNormalize(DummyVecEnv([lambda: ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))]),
                        norm_obs=True, norm_reward=True)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, verbose=0)
    model.learn(128)
    actor, norm = NumpyActor.of(model), ObsNorm.of(venv)
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))
    obs, _ = env.reset(seed=3)
    seen = np.asarray(norm.var) >= UNSEEN_VAR
    assert seen.sum() >= 8 and not seen[-4:].any()  # one deployment: its entries never varied
    for _ in range(40):
        want = int(model.predict(norm(obs), deterministic=True)[0])
        assert actor.act(norm(obs)) == want
        assert np.allclose(norm(obs)[seen], venv.normalize_obs(obs)[seen], atol=1e-6)
        assert not norm(obs)[~seen].any()
        obs, _, term, _, _ = env.step(want)
        if term:
            obs, _ = env.reset()


def test_step_overhead_shortens_the_chunk_a_time_fraction_allows():
    from envs.scenario import Scenario

    sc = Scenario()
    t = time_table([1.0, 0.5, 0.25], sc)
    state = dict(running_decodes=40, decode_context_tokens=40 * 1500, head_prefilled_tokens=0,
                 kv_usage=0.1)
    plain = t.budget(state)
    slower = BudgetTable(t.to_dict()).with_step_overhead(0.01).budget(state)
    cost = t.action.cost._replace(fixed_s=t.action.cost.fixed_s + 0.01)
    assert slower == 40 + chunk_within(cost, 40, 60000, 0.1, 0, 16384 - 40) < plain
    data = {k: v for k, v in t.to_dict().items() if k != "fractions"}
    tokens = BudgetTable({**data, "action": {"kind": "tokens"}, "budgets": [1, 2, 3],
                          "default_budget": 1})
    assert tokens.with_step_overhead(0.01) is tokens


def test_export_report_says_when_the_policy_is_constant(capsys, tmp_path):
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export.report import report

    for cells, constant in (([1.0, 1.0, 1.0], True), ([1.0, 0.5, 0.25], False)):
        path = str(tmp_path / "t.json")
        data = time_table(cells, Scenario()).to_dict()
        data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0}
        BudgetTable(data).save(path)
        report(BudgetTable.load(path), 1.0, SimpleNamespace(out=path))
        out = capsys.readouterr().out
        assert ("NOTE: every cell holds 1: the policy does not depend on the state here; it is "
                "the time-budget rule at 1 (time-budget:1)" in out) == constant, out


def test_export_report_warns_of_goodput_lost_only_where_the_model_serves(capsys, tmp_path):
    """A table 20% short of its model's goodput beyond the interval is warned about; not
    where the model itself serves at most a tenth of requests (a matter of which few)."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export.report import report

    for model_goodput, warned in ((0.5, True), (0.05, False)):
        path = str(tmp_path / "t.json")
        data = time_table([1.0, 0.5, 0.25], Scenario()).to_dict()
        data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0,
                            "goodput": {"serving": {"rate_rps": 8.0, "streams": 5, "verdict": "falls short",
                                                    "model_goodput": model_goodput, "loss": 0.2,
                                                    "loss_ci95": 0.05,
                                                    "table_goodput": 0.8 * model_goodput}}}
        BudgetTable(data).save(path)
        report(BudgetTable.load(path), 1.0, SimpleNamespace(out=path))
        err = capsys.readouterr().err
        assert ("WARNING: at the serving load the table falls short" in err) == warned, err


def test_export_report_warns_of_capacity_lost_and_says_when_noise_cannot_tell(capsys, tmp_path):
    """A capacity loss over 1% is warned about on every scenario where it is: as the
    table's when it falls short beyond the interval, as not told from noise on the
    fidelity's streams when the interval spans it (with how to measure more); none at 1%
    or less."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export.report import report

    def capacity(loss, ci, verdict):
        return {"model_capacity_rps": 1.0, "table_capacity_rps": 1 - loss, "loss": loss,
                "loss_ci95": ci, "verdict": verdict}

    path = str(tmp_path / "t.json")
    noise = ("loses 13.0% of the model's capacity on tight KV cache (more than 1%, but ± 26.0%: "
             "5 streams cannot tell it from noise); --fidelity-seeds N")
    short = ("loses 6.0% of the model's capacity on serving (more than 1%); use more buckets or "
             "features, or serve the model")
    for caps, said in [({"serving": capacity(0.02, 0.05, "ties"), "tight KV cache": capacity(0.13, 0.26, "ties")},
                        [noise, "loses 2.0% of the model's capacity on serving"]),
                       ({"serving": capacity(0.06, 0.03, "falls short"),
                         "tight KV cache": capacity(0.13, 0.26, "ties")}, [short, noise]),
                       ({"serving": capacity(0.05, 0.0, "not judged")},
                        ["loses 5.0% of the model's capacity on serving (more than 1% on one stream, "
                         "not judged); --fidelity-seeds N"]),
                       ({"serving": capacity(0.01, 0.03, "ties")}, [])]:
        data = time_table([1.0, 0.5, 0.25], Scenario()).to_dict()
        data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0,
                            "capacity": caps}
        BudgetTable(data).save(path)
        report(BudgetTable.load(path), 1.0, SimpleNamespace(out=path, fidelity_seeds=5))
        err = capsys.readouterr().err
        assert all(line in err for line in said) and err.count("WARNING") == len(said), err


def test_export_measures_a_table_against_its_flat_twin(capsys, tmp_path):
    """flat_check: the KV-aware deadline rule's table under KV pressure against itself with
    the fraction it takes most (1, from its use at capacity) in every cell, on the same
    streams: the twin's capacities are time-budget:1's (the flat table is that rule), and
    the verdict is the paired one of the table's capacities against them. A token table,
    one fraction everywhere, or no pass decided: nothing to measure. The report says the
    figures, and when no scenario gains, that the one-line rule serves as well."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from envs.seeds import CAPACITY_SEEDS
    from eval.capacity import capacity_sweep
    from eval.export.fidelity import flat_check
    from eval.export.report import report
    from eval.export.rules import rule_table
    from eval.harness import paired_verdict
    from policies.specs import make_policy
    from policies.table_policy import TablePolicy

    sc = Scenario(hardware="h100-sxm", model="llama-3-8b", rate=6.0, num_kv_blocks=6000)
    table = rule_table("time-budget-deadline-kv", sc, sc.stream(0, 1, 7, 60))
    args = SimpleNamespace(fidelity_requests=80, workers=1)
    mine = capacity_sweep([(sc, TablePolicy(table))], 2, 80, seed_base=CAPACITY_SEEDS)[0].per_stream
    rps = np.array([mine])
    use = {"passes": 100, "shares": {"1": 0.7, "0.25": 0.2, "4": 0.1}}
    found = flat_check(table, {"kv": sc}, use, rps, args)
    rule = capacity_sweep([(sc, make_policy("time-budget:1", sc))], 2, 80, seed_base=CAPACITY_SEEDS)[0]
    got = found["scenarios"]["kv"]
    v = paired_verdict(mine, rule.per_stream)
    assert found["fraction"] == 1.0 and got["flat_capacity_rps"] == rule.capacity
    assert (got["gain"], got["gain_ci95"], got["verdict"]) == (v.rel, v.half, v.kind)
    assert got["table_capacity_rps"] == pytest.approx(np.mean(mine))
    assert flat_check(time_table([1.0, 1.0, 1.0], sc), {"kv": sc}, use, rps, args) == {}
    assert flat_check(table, {"kv": sc}, {"passes": 0, "shares": {}}, rps, args) == {}
    path = str(tmp_path / "t.json")
    for gains, note in ((("beats", 0.1), ("ties", 0.01)), False), ((("ties", 0.01),), True):
        data = time_table([1.0, 0.5, 0.25], Scenario()).to_dict()
        flat = {"fraction": 4.0, "scenarios": {
            f"s{i}": {"table_capacity_rps": 1.1, "flat_capacity_rps": 1.0, "gain": g,
                      "gain_ci95": 0.05, "verdict": k} for i, (k, g) in enumerate(gains)}}
        data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0,
                            "against_flat": flat}
        BudgetTable(data).save(path)
        report(BudgetTable.load(path), 1.0, SimpleNamespace(out=path, fidelity_seeds=2))
        out = capsys.readouterr().out
        assert ("what its cells are worth: against itself with 4 of the ITL target, the fraction "
                "it takes most, in every cell (table-flat:4:PATH): s0 1.100 against 1.000 req/s") in out
        assert ("NOTE: nowhere does the table serve more than its flat twin" in out) == note


# --- the p99 ITL slack ---------------------------------------------------------------------

SLACK_REQUESTS = [(0.0, 60, 3000)] * 6 + [(0.5 * i, 6000, 20) for i in range(1, 30)]
"""Six long generations and a long prompt every half second: passes over the target slow
a few tokens each, so the slack is spent and regained."""


def _slack_sim():
    from tests.conftest import make_sim

    return make_sim(SLACK_REQUESTS, hardware="a100-80g", model="llama-3-8b")


def _spend_run(sim, itl_s=0.1, until_s=None):
    """Serve ``sim`` with the slack rule (up to 8x the target), reading the count each pass."""
    from policies.baselines import TimeBudgetSlackPolicy

    rule = TimeBudgetSlackPolicy(itl_s, top=8.0)
    while sim.advance() and (until_s is None or sim.now < until_s):
        sim.step(rule(sim.state()))
    return sim


def test_slack_count_is_the_whole_log_without_decay():
    """With an unbounded window the simulator's count is the pass log's: every decode token,
    and those whose pass exceeded the ITL target."""
    from envs.slack import ItlSlackMeter, SlackCounter

    sim = _spend_run(_slack_sim())
    counter = SlackCounter(0.1, meter=ItlSlackMeter(tau_s=1e18))
    counter.update(sim.log, sim.now)
    assert counter.meter.slow == sim.log.tokens_over_since(0, 0.1)[0] > 0
    assert counter.meter.tokens == sim.log.tokens_over_since(0, -1.0)[0] > 0


def test_summary_only_runs_and_forks_keep_the_slack_count(monkeypatch):
    """A summary-only simulator lets old passes go (here every few runs); the count is taken
    before they go, so it matches a full run's. A fork starts from its parent's count."""
    from envs.engine import EngineConfig, Simulator
    from envs.metrics import SLO
    from envs.workload import Workload

    monkeypatch.setattr("envs.engine.FLUSH_VALUES", 40)
    reqs = sorted([(0.3 * i, 60, 300) for i in range(100)] + [(0.5 * i + 0.1, 6000, 20) for i in range(60)])
    arr, prm, out = zip(*reqs)
    w = Workload.from_arrays(arr, prm, out)
    full = _spend_run(Simulator("a100-80g", "llama-3-8b", w, EngineConfig()))
    lean = _spend_run(Simulator("a100-80g", "llama-3-8b", w, EngineConfig(), summary_only=SLO(2.0, 0.1)))
    assert lean.log._dropped > 0
    a, b = full.itl_slack(0.1), lean.itl_slack(0.1)
    assert (a.slow, a.tokens) == pytest.approx((b.slow, b.tokens), rel=1e-9)
    half = _spend_run(_slack_sim(), until_s=8.0)
    before = half.itl_slack(0.1).tokens
    half.step(half.state().running_decodes)  # a pass the parent's count has not read yet
    mark = half._slack[0.1].mark
    child = half.fork().itl_slack(0.1)
    assert half._slack[0.1].mark == mark  # forking reads nothing into the parent's count
    now = half.itl_slack(0.1)
    assert (child.slow, child.tokens) == (now.slow, now.tokens) and now.tokens > before


def test_engine_slack_count_by_hand():
    """An engine's count (envs.slack.StepSlack): each completed step adds its decodes, and
    to the slow tokens when it took longer than the ITL target; the steps since the last
    reading are dated at the reading, and the counts decay with the window between
    readings; idle time between steps slows no one."""
    import math

    from envs.slack import SLACK_TAU_S, StepSlack

    c = StepSlack(itl_s=0.1, now_s=0.0)
    c.step_done(0.05, 3)  # on time
    c.step_done(0.2, 2)  # slow: its 2 decodes waited 200 ms
    m = c.read(0.25)
    assert (m.slow, m.tokens) == (2, 5)  # dated now: no decay yet
    m = c.read(5.0)  # 4.75 s idle: nothing added, both decay
    keep = math.exp(-4.75 / SLACK_TAU_S)
    assert (m.slow, m.tokens) == pytest.approx((2 * keep, 5 * keep))
    c.step_done(0.3, 0)  # a slow step with nothing decoding slows no one
    m = c.read(4.0)  # a clock that steps back adds no decay
    assert (m.slow, m.tokens) == pytest.approx((2 * keep, 5 * keep))


@pytest.mark.parametrize("teacher", ["time-budget-slack", "time-budget-slack-kv"])
def test_observation_and_teacher_read_the_slack(teacher):
    """The observation's itl_slack entry is the count's passes on a log scale, and the
    slack teachers' clone targets equal their rules' choices in every state (the KV-aware
    one also reads the KV usage: with a small cache it keeps from spending as the cache
    fills)."""
    import math

    from agents.setup import teacher_actions
    from envs.actions import FRACTION_LADDER
    from envs.metrics import SLO
    from envs.observation import SLACK_INDEX, observe
    from envs.slack import SLACK_PASSES_TOP
    from policies.baselines import TimeBudgetSlackKVPolicy, TimeBudgetSlackPolicy
    from tests.conftest import make_sim

    kv_aware = teacher.endswith("-kv")
    sim = make_sim(SLACK_REQUESTS, budget_blocks=2000 if kv_aware else None,
                   hardware="a100-80g", model="llama-3-8b")
    rule = (TimeBudgetSlackKVPolicy if kv_aware else TimeBudgetSlackPolicy)(0.1, top=4.0)
    spent = kept = held_by_kv = 0
    while sim.advance():
        n, kv = sim.state().running_decodes, sim.state().kv_usage
        passes = sim.itl_slack(0.1).passes(n)
        obs = observe(sim.state(), SLO(2.0, 0.1))
        assert obs[SLACK_INDEX] == pytest.approx(
            min(math.log1p(passes) / math.log1p(SLACK_PASSES_TOP), 1.0), abs=1e-6)
        want = rule.fraction_at(n, passes, kv)
        got = FRACTION_LADDER[int(teacher_actions(teacher, FRACTION_LADDER, obs[None, :])[0])]
        assert got == pytest.approx(want, rel=0.05)  # the nearest rung of the ladder
        spent, kept = spent + (want > 1), kept + (want <= 1)
        held_by_kv += bool(n and passes >= 1 and want <= 1)
        sim.step(rule(sim.state()))
    assert spent and kept
    assert bool(held_by_kv) == kv_aware


@pytest.mark.parametrize("teacher", ["time-budget-deadline", "time-budget-deadline-kv"])
def test_observation_and_teacher_read_when_the_queue_is_due(teacher):
    """The observation's prefill_due_vs_ttft entry is the deadline rule's projection over
    four TTFT targets, and the t4 teacher's clone targets equal the rule's choices in every
    state: it holds the slack back while the queue is due early, and spends it when it is
    due late. u4, its KV-aware form, on a cache the pairs of long prompts fill: it also
    steps its fraction down as usage climbs, and holds the slack back above 75%."""
    from agents.setup import teacher_actions
    from envs.actions import FRACTION_LADDER
    from envs.metrics import SLO
    from envs.observation import DUE_INDEX, observe
    from envs.pricing import prefill_due_s
    from policies.baselines import TimeBudgetDeadlineKVPolicy, TimeBudgetDeadlinePolicy
    from tests.conftest import make_sim

    kv_aware = teacher.endswith("-kv")
    lone = [(3.0 * i, 6000, 20) for i in range(1, 10)]  # each due within 0.5 s
    pairs = [(30.0 + 5.0 * i, 12000, 20) for i in range(4) for _ in range(2)]  # due after 1.6 s
    sim = make_sim([(0.0, 60, 3000)] * 6 + lone + pairs, budget_blocks=2400 if kv_aware else None,
                   hardware="a100-80g", model="llama-3-8b")
    rule = (TimeBudgetDeadlineKVPolicy if kv_aware else TimeBudgetDeadlinePolicy)(0.1, 2.0, top=4.0)
    spent = held = throttled = 0
    while sim.advance():
        state = sim.state()
        n = state.running_decodes
        due = prefill_due_s(sim.cost, n, state.decode_context_tokens, state.head_prefilled_tokens,
                            state.waiting_prefill_tokens, state.oldest_wait_s, 0.1)
        obs = observe(sim.state(), SLO(2.0, 0.1))
        assert obs[DUE_INDEX] == pytest.approx(min(due / 2.0 / 4, 1.0), abs=1e-6)
        late = rule.spend(state)
        assert late == (due > 1.6)
        want = rule.fraction_at(n, sim.itl_slack(0.1).passes(n) if late else 0.0, state.kv_usage)
        got = FRACTION_LADDER[int(teacher_actions(teacher, FRACTION_LADDER, obs[None, :])[0])]
        assert got == pytest.approx(want, rel=0.05)
        spent += want > 1
        held += bool(n and sim.itl_slack(0.1).passes(n) >= 1 and not late)
        throttled += want < 1
        sim.step(rule(state))
    assert spent and held
    assert bool(throttled) == kv_aware


def test_a_table_over_the_slack_spends_it_as_the_engine_counts_it():
    """A time-fraction table bucketing itl_slack_passes: 4x the target with slack for a pass,
    1x without; the runtime derives the feature from the engine's two counts."""
    from envs.scenario import Scenario

    sc = Scenario()
    data = time_table([1.0, 4.0], sc, edges=(1.0,)).to_dict()
    data["features"] = [{"name": "itl_slack_passes", "edges": [1.0]}]
    t = BudgetTable(data)
    assert {"itl_slow_tokens", "itl_decode_tokens", "running_decodes"} <= t.needs
    cost = sc.simulator().cost
    base = dict(running_decodes=10, decode_context_tokens=10 * 600, head_prefilled_tokens=0)
    spend = 10 + chunk_within(cost, 10, 6000, 4 * sc.slo_itl_s, 0, cap=16384 - 10)
    keep = 10 + chunk_within(cost, 10, 6000, sc.slo_itl_s, 0, cap=16384 - 10)
    # 0.008 * 5000 - 25 = 15 tokens of slack: one pass of 10 decodes fits; 0.008 * 2000 - 25 < 0
    assert t.budget({**base, "itl_slow_tokens": 25, "itl_decode_tokens": 5000}) == spend
    assert t.budget({**base, "itl_slow_tokens": 25, "itl_decode_tokens": 2000}) == keep
    with pytest.raises(runtime.TableError, match="is derived by a time_fraction action only"):
        BudgetTable({**data, "action": {"kind": "tokens"}, "budgets": [512, 4096]})


@pytest.mark.parametrize("spec, features, cells", [
    ("time-budget:0.8", ["running_decodes"], [0.8]),
    ("time-budget-slack:16", ["itl_slack_passes"], [1.0, 16.0]),
    ("time-budget-deadline", ["itl_slack_passes", "prefill_due_s"], [1.0, 1.0, 1.0, 4.0]),
    ("time-budget-p99:0.5", ["itl_slack_passes"], [0.5, 1.0])])
def test_a_rule_table_is_the_rule_at_every_pass(spec, features, cells):
    """``python -m eval export --rule`` writes a time-fraction table over the slack (one
    pass or more) and the prefill queue's due time (past 0.8 of the TTFT target), which
    makes the rule's budget at every pass of a run its own check never saw: lone 6K
    prompts, then pairs of 12K prompts that make the deadline rule spend the slack. The
    runtime derives both features from the engine's counts exactly as the rule reads the
    simulator; its due-time edge sits one float above the threshold, as the rule compares
    strictly."""
    from envs.scenario import Scenario
    from eval.export.rules import rule_table
    from policies.specs import make_policy
    from policies.table_policy import TablePolicy
    from tests.conftest import make_sim

    sc = Scenario(hardware="a100-80g", model="llama-3-8b")
    made = rule_table(spec, sc, sc.stream(0, 1, 7, 60))
    assert made.features == tuple(features) and list(made.action.cells) == cells
    check = made.fidelity["rule_check"]
    assert check["differ"] == 0 and check["passes"] > 60 and check["requests"] == 60
    assert sum(check["passes_per_cell"]) <= check["passes"]
    assert list(made.visited) == [c > 0 for c in check["passes_per_cell"]]
    if "prefill_due_s" in features:
        assert made.edges[1][0] == math.nextafter(0.8 * sc.slo_ttft_s, math.inf)
    table = TablePolicy(BudgetTable(made.to_dict()))  # and through JSON
    rule = make_policy(spec, sc)
    lone = [(3.0 * i, 6000, 20) for i in range(1, 10)]
    pairs = [(30.0 + 5.0 * i, 12000, 20) for i in range(4) for _ in range(2)]
    sim = make_sim([(0.0, 60, 3000)] * 6 + lone + pairs, hardware="a100-80g", model="llama-3-8b")
    spent = above_half = 0
    while sim.advance():
        state = sim.state()
        want = rule(state)
        assert table(state) == want
        spent += want > make_policy("time-budget:1", sc)(state)
        above_half += want > make_policy("time-budget:0.5", sc)(state)
        sim.step(want)
    assert spent or "slack" not in spec and "deadline" not in spec
    assert above_half or "p99" not in spec  # the p99 rule's table reaches its top cell


def test_a_flattened_table_is_the_time_budget_rule_at_every_pass(tmp_path):
    """``table-flat[:FRACTION]:PATH`` (the ablation that says what a table's cells are
    worth): the deadline rule's table with 1 in every cell budgets every pass of a run
    that makes the rule spend its slack as time-budget:1 does, at 0.5 as time-budget:0.5
    does; the rule's own table (1 or 4 in its cells) never asks for less, and more where
    it spends. The
    table it came from is left as it was, and the flat copy claims no fidelity. A path
    whose first part is a number takes the fraction in front of it. A token table, a
    fraction outside (0, 16], an empty fraction or no path are refused naming the field."""
    from envs.errors import ConfigError
    from envs.scenario import Scenario
    from eval.export.rules import rule_table
    from policies.specs import make_policy
    from policies.table_policy import TablePolicy, load_table_policy
    from tests.conftest import make_sim

    sc = Scenario(hardware="a100-80g", model="llama-3-8b")
    made = rule_table("time-budget-deadline", sc, sc.stream(0, 1, 7, 60))
    path = tmp_path / "deadline.json"
    made.save(str(path))
    (tmp_path / "2:t.json").write_text(path.read_text())
    flat = make_policy(f"table-flat:{path}", sc)
    half = make_policy(f"table-flat:0.5:{path}", sc)
    odd = make_policy(f"table-flat:1:{tmp_path}/2:t.json", sc)
    assert set(flat.table.action.cells) == {1.0} and set(half.table.action.cells) == {0.5}
    assert set(odd.table.action.cells) == {1.0}
    assert list(BudgetTable.load(str(path)).action.cells) == [1.0, 1.0, 1.0, 4.0]
    assert "every cell at 1 of the ITL target" in flat.table.provenance["rule"]
    assert flat.table.fidelity == {} and all(flat.table.visited)
    # A flat twin says which table it flattens (what a report pairs it with); a table does not.
    assert flat.name == f"table-flat:{path}" and flat.flattens == f"table:{path}"
    assert half.flattens == f"table:{path}" and not hasattr(make_policy(f"table:{path}", sc), "flattens")
    assert odd.flattens == f"table:{tmp_path}/2:t.json" and flat.diagnostic and half.kind == "table"
    auto = make_policy("table-flat:0.25:auto", Scenario())
    assert auto.flattens == "table:auto" and set(auto.table.action.cells) == {0.25}
    assert load_table_policy(str(path), sc, flat=0.5).name == f"table-flat:0.5:{path}"
    rule, table = make_policy("time-budget:1", sc), TablePolicy(made)
    at_half = make_policy("time-budget:0.5", sc)
    pairs = [(30.0 + 5.0 * i, 12000, 20) for i in range(4) for _ in range(2)]
    sim = make_sim([(0.0, 60, 3000)] * 6 + pairs, hardware="a100-80g", model="llama-3-8b")
    spent = passes = 0
    while sim.advance():
        state = sim.state()
        want = rule(state)
        assert flat(state) == want and half(state) == at_half(state) and table(state) >= want
        spent += table(state) > want
        passes += 1
        sim.step(want)
    assert spent and passes > 50
    tokens = BudgetTable({"schema_version": 2, "kind": "chunkpilot-budget-table",
                          "action": {"kind": "tokens"},
                          "features": [{"name": "kv_usage", "edges": [0.5]}], "budgets": [512, 256],
                          "default_budget": 512, "provenance": scenario_provenance(sc)})
    tokens.save(str(tmp_path / "tokens.json"))
    with pytest.raises(ConfigError, match="action.kind: got 'tokens', flattening needs a table "
                                          "of time fractions"):
        make_policy(f"table-flat:{tmp_path / 'tokens.json'}", sc)
    for bad in ("0", "17", "16.5", "0.0"):
        with pytest.raises(ConfigError, match=r"FRACTION of the ITL target must lie in \(0, 16\]"):
            make_policy(f"table-flat:{bad}:{path}", sc)
    with pytest.raises(ConfigError, match="an empty FRACTION"):
        make_policy(f"table-flat::{path}", sc)
    with pytest.raises(ConfigError, match="no PATH"):
        make_policy("table-flat:2:", sc)
    with pytest.raises(runtime.TableError, match=r"fraction: got 0, must be a number in \(0, 16\]"):
        made.flattened(0)


def test_the_kv_aware_deadline_rule_is_a_table_at_every_pass():
    """time-budget-deadline-kv as a table over the slack, the due time and KV usage (its
    own steps as edges, the slack spent only in the bucket below 75%): the rule's budget at
    every pass of a run on a cache that pairs of 12K-token prompts fill, which neither its
    export's check stream nor the rule's spending saw alone."""
    from envs.scenario import Scenario
    from eval.export.rules import rule_table
    from policies.baselines import KVSteps
    from policies.specs import make_policy
    from policies.table_policy import TablePolicy
    from tests.conftest import make_sim

    sc = Scenario(hardware="a100-80g", model="llama-3-8b", num_kv_blocks=3000)
    made = rule_table("time-budget-deadline-kv", sc, sc.stream(0, 1, 7, 60))
    steps = KVSteps()
    assert made.features == ("itl_slack_passes", "prefill_due_s", "kv_usage")
    assert made.edges[2] == (0.75, *steps.edges)
    k = len(steps.edges) + 2
    cells = list(made.action.cells)
    assert cells[:k] == [1.0, 1.0, *steps.fractions[1:]] and cells[:3 * k] == cells[:k] * 3
    assert cells[3 * k:] == [4.0, 1.0, *steps.fractions[1:]]  # late, slack, below 75%: the top
    table = TablePolicy(BudgetTable(made.to_dict()))
    rule = make_policy("time-budget-deadline-kv", sc)
    lone = [(3.0 * i, 6000, 20) for i in range(1, 10)]
    pairs = [(30.0 + 5.0 * i, 12000, 20) for i in range(4) for _ in range(2)]
    sim = make_sim([(0.0, 60, 3000)] * 6 + lone + pairs, budget_blocks=2400,
                   hardware="a100-80g", model="llama-3-8b")
    fractions = set()
    while sim.advance():
        state = sim.state()
        want = rule(state)
        assert table(state) == want
        fractions.add(steps.fraction_at(state.kv_usage))
        sim.step(want)
    assert len(fractions) >= 3  # the run crosses several of the steps


def test_export_measures_what_a_table_does_at_capacity():
    """table_use drives the table on each scenario's streams at the given loads and pools
    the passes it decides (decodes running): the shares per cell value sum to one over as
    many passes as the streams' traces hold, and under KV pressure the KV-aware deadline
    rule's table uses its steps. A token-budget table is measured the same way."""
    from envs.scenario import Scenario
    from envs.seeds import CAPACITY_SEEDS
    from eval.capacity import probe_stream
    from eval.export.rules import rule_table
    from eval.table_use import _trace_task, table_use

    sc = Scenario(hardware="h100-sxm", model="llama-3-8b", rate=6.0, num_kv_blocks=6000)
    table = rule_table("time-budget-deadline-kv", sc, sc.stream(0, 1, 7, 60))
    factors = np.array([[1.0, 1.5, 0.0]])
    use = table_use(table, {"kv": sc}, factors, 120, CAPACITY_SEEDS)
    assert use["streams"] == 2  # a stream with no capacity (factor 0) is left out
    traces = []
    for i, f in enumerate(factors[0][:2]):
        at, workload = probe_stream(sc, i, 3, 120, f)
        traces.append(_trace_task(at, table, workload))
    assert use["passes"] == sum(len(values) for values, _, _ in traces) > 0
    assert all(d > 0 for _, _, ds in traces for d in ds)  # nothing-decoding passes left out
    assert sum(use["shares"].values()) == pytest.approx(1.0)
    assert sum(v > 0 for v in use["shares"].values()) >= 3  # the full fraction and KV steps
    assert use["shares"]["1"] < 1.0
    assert use["used_5pct"] == sum(v >= 0.05 for v in use["shares"].values())
    assert sum(use["budget_shares"].values()) == pytest.approx(1.0)
    assert sum(r["share"] for r in use["by_decodes"]) == pytest.approx(1.0)
    tokens = BudgetTable({"schema_version": 2, "kind": "chunkpilot-budget-table",
                          "action": {"kind": "tokens"},
                          "features": [{"name": "running_decodes", "edges": [16]}],
                          "budgets": [4096, 1024], "visited": [1, 1], "default_budget": 1024,
                          "provenance": scenario_provenance(sc)})
    by_tokens = table_use(tokens, {"kv": sc}, factors, 120, CAPACITY_SEEDS)
    assert set(by_tokens["shares"]) == {"1024", "4096"} and by_tokens["passes"] > 0
    assert sum(by_tokens["shares"].values()) == pytest.approx(1.0)


@given(st.floats(0.0, 1.0))
def test_kv_steps_round_the_linear_ramp_up_to_the_ladder(kv):
    """KVSteps by hand: 1 below 75% KV usage, 0.25 from 95% on, and in between the
    linear ramp 0.25 + 0.75 * (0.95 - kv) / 0.2 rounded up to the next rung of the action
    ladder (the first step, to 0.917, at 0.95 - 0.667 / 0.75 * 0.2 = 0.7721)."""
    from envs.actions import FRACTION_LADDER
    from policies.baselines import KVSteps

    steps = KVSteps()
    assert steps.edges[0] == pytest.approx(0.95 - (0.917 - 0.25) / 0.75 * 0.2)
    assert steps.edges[-1] == pytest.approx(0.95) and list(steps.edges) == sorted(steps.edges)
    ramp = min(max(0.25 + 0.75 * (0.95 - kv) / 0.2, 0.25), 1.0)
    got = steps.fraction_at(kv)
    rungs = [r for r in FRACTION_LADDER if 0.25 <= r <= 1.0]
    assert got in rungs and got >= ramp - 1e-9
    assert not [r for r in rungs if ramp + 1e-9 < r < got]  # no rung between the ramp and it
    if kv < 0.75:
        assert got == 1.0
    if kv >= 0.95:
        assert got == 0.25


def test_rule_export_writes_a_table_the_runtime_accepts_and_refuses_other_rules(tmp_path):
    """The CLI end to end: the deadline rule for an A100 is a table ``python -m
    policies.table check`` accepts for that hardware and model; a rule no table holds
    exactly is a one-line error naming the field, and nothing is written."""
    import json

    from tests.conftest import cli

    out = tmp_path / "t.json"
    done = cli("eval", "export", "--rule", "time-budget-deadline:16", "--hardware", "a100-80g", "--out",
               str(out), "--csv", str(tmp_path / "t.csv"), "--num-requests", "100")
    assert done.returncode == 0, done.stderr
    assert "the same budget as time-budget-deadline:16 at all" in done.stdout
    assert "of the scenario's 100-request stream; passes with decodes running, per cell:" in done.stdout
    data = json.loads(out.read_text())
    assert data["fractions"] == [1.0, 1.0, 1.0, 16.0] and data["provenance"]["hardware"]["name"] == "a100-80g"
    check = cli("policies.table", "check", str(out), "--hardware", "a100-80g", "--model", "llama-3-8b")
    assert check.returncode == 0, check.stdout + check.stderr
    # A fixed cost per pass is priced into the table's cost block and recorded beside it.
    slow = tmp_path / "slow.json"
    done = cli("eval", "export", "--rule", "time-budget-deadline:16", "--hardware", "a100-80g", "--out",
               str(slow), "--num-requests", "100", "--per-pass-overhead-s", "0.003")
    assert done.returncode == 0, done.stderr
    fixed = {json.loads(f.read_text())["action"]["cost"]["fixed_s"] for f in (out, slow)}
    assert max(fixed) - min(fixed) == pytest.approx(0.003)
    assert json.loads(slow.read_text())["provenance"]["hardware"]["per_pass_overhead_s"] == 0.003
    show = cli("policies.table", "show", str(slow))
    assert "a100-80g (priced with 3 ms per pass) + llama-3-8b" in show.stdout
    # It says it is a rule, never "algo ppo", and what its check against the rule found.
    assert "what it is: the time-budget-deadline:16 rule's exact table: a rule, not a learned policy" in show.stdout
    assert "algo" not in show.stdout and "the time-budget-deadline:16 rule exactly" in show.stdout
    assert re.search(r"checked against the rule at [\d,]+ passes: 0 differ", show.stdout)
    for rule in ("time-budget-kv", "static:2048", "time-budget-deadline:0.5"):
        bad = cli("eval", "export", "--rule", rule, "--out", str(tmp_path / "no.json"))
        assert bad.returncode == 2 and bad.stderr.startswith("error: rule: got")
        assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "no.json").exists()


def test_export_picks_the_slack_feature_a_rare_long_pass_hangs_on():
    """A policy at 1 or 0.917 of the target by KV usage, and 16 times it on the 5% of
    decisions with slack for a pass: the rare long pass decides capacity, so the export
    picks the slack first (agreement alone would pick KV usage, which moves more cells)."""
    from envs.scenario import Scenario
    from envs.slack import slack_passes
    from eval.export.cells import action_spec
    from eval.export.features import pick_features

    rng = np.random.default_rng(1)

    def states(n):
        tokens = rng.uniform(0, 1e4, n)
        slow = np.where(rng.random(n) < 0.05, 0.0, 0.008 * tokens + 1)  # 5%: slack to spend
        return {"kv_usage": rng.random(n), "running_decodes": rng.integers(1, 40, n).astype(float),
                "itl_slow_tokens": slow, "itl_decode_tokens": tokens,
                "decode_context_tokens": rng.uniform(0, 1e6, n)}

    def rule(s):
        passes = np.array([slack_passes(a, b, int(c)) for a, b, c in
                           zip(s["itl_slow_tokens"], s["itl_decode_tokens"], s["running_decodes"])])
        return np.where(passes >= 1, 16.0, np.where(s["kv_usage"] > 0.5, 0.917, 1.0))

    class Model:
        actions = "time"

    sc = Scenario()
    build, held = states(4000), states(1000)
    names, score = pick_features((build, rule(build)), (held, rule(held)), 8, 3,
                                 scenario_provenance(sc), action_spec(Model(), sc))
    assert names[0] == "itl_slack_passes" and "kv_usage" in names and score > 0.9


def test_export_adds_two_features_that_matter_only_together():
    """A long pass where exactly one of two conditions holds (the head has waited long,
    the last step was slow): neither quantity alone tells anything, so single-feature
    forward selection stops at KV usage; the export tries the pair and keeps both."""
    import itertools

    from envs.scenario import Scenario
    from eval.export.cells import action_spec
    from eval.export.features import pick_features

    def states(repeat):  # every combination equally often: no feature helps by chance
        grid = np.array(list(itertools.product([0.2, 0.8], [0.5, 2.5], [0.02, 0.08])) * repeat)
        return {"kv_usage": grid[:, 0], "oldest_wait_s": grid[:, 1], "last_step_s": grid[:, 2]}

    def rule(s):
        one = (s["oldest_wait_s"] > 1.5) != (s["last_step_s"] > 0.05)
        return np.where(s["kv_usage"] > 0.5, 0.25, 4.0) * np.where(one, 4.0, 1.0)

    class Model:
        actions = "time"

    sc = Scenario()
    action = action_spec(Model(), sc)
    build, held = states(500), states(125)
    names, score = pick_features((build, rule(build)), (held, rule(held)), 8, 3,
                                 scenario_provenance(sc), action)
    assert names[0] == "kv_usage" and set(names[1:]) == {"oldest_wait_s", "last_step_s"}
    assert score == 1.0
    names, score = pick_features((build, rule(build)), (held, rule(held)), 8, 2,
                                 scenario_provenance(sc), action)
    assert names == ["kv_usage"] and score == 0.5  # no room for the pair


def test_export_checks_the_table_at_the_serving_load(monkeypatch, capsys, tmp_path):
    """The fidelity at load replays the final scenarios at their own rate: a table that is
    its model's rule matches it stream for stream and draws no warning; one that takes a
    quarter of the target in every pass falls short past capacity, and the report warns;
    one stream is not judged."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export import fidelity, report, select
    from policies.baselines import TimeBudgetPolicy

    sc = Scenario(rate=12.0, num_requests=80)
    monkeypatch.setattr(select, "policy_for", lambda model, s: TimeBudgetPolicy(s.slo_itl_s, 1.0))
    args = SimpleNamespace(fidelity_seeds=6, fidelity_requests=80, workers=1, out=str(tmp_path / "t.json"))

    def reported(cells, fid):
        data = time_table(cells, sc).to_dict()
        data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0,
                            "goodput": fid}
        BudgetTable(data).save(args.out)
        report.report(BudgetTable.load(args.out), 1.0, args)
        return capsys.readouterr()

    same = fidelity.load_fidelity(None, time_table([1.0, 1.0, 1.0], sc), sc, args)
    assert set(same) == {"serving", "+3 ms per pass", "tight KV cache"}
    for f in same.values():
        assert f["rate_rps"] == 12.0 and f["streams"] == 6 and f["verdict"] == "ties"
        assert f["model_goodput"] == f["table_goodput"] and f["loss"] == 0.0
    out = reported([1.0, 1.0, 1.0], same)
    assert "goodput on serving at 12 req/s: model" in out.out and "WARNING" not in out.err
    low = fidelity.load_fidelity(None, time_table([0.25, 0.25, 0.25], sc), sc, args)
    for f in low.values():
        assert f["table_goodput"] < f["model_goodput"] and f["verdict"] == "falls short"
        # judged stream by stream: the mean of the per-stream ratios, kept in the record
        ratios = np.divide(f["table_per_stream"], f["model_per_stream"])
        assert f["loss"] == pytest.approx(1 - ratios.mean()) and len(ratios) == f["streams"]
    f = low["serving"]
    out = reported([0.25, 0.25, 0.25], low)
    assert (f"goodput on serving at 12 req/s: model {f['model_goodput']:.3f}, table "
            f"{f['table_goodput']:.3f} ({-f['loss']:+.1%}") in out.out
    assert "WARNING: at the serving load the table falls short of the model's goodput" in out.err
    one = fidelity.load_fidelity(None, time_table([0.25, 0.25, 0.25], sc), sc,
                               SimpleNamespace(fidelity_seeds=1, fidelity_requests=80, workers=1))
    assert all(f["verdict"] == "not judged" and f["loss"] is None for f in one.values())
    out = reported([0.25, 0.25, 0.25], one)
    assert "not judged" in out.out and "goodput" not in out.err
    assert fidelity.load_fidelity(None, None, sc, SimpleNamespace(fidelity_seeds=0)) == {}


def test_export_aggregates_the_states_its_table_leads_to(monkeypatch):
    """DAgger: each round's table, over a feature the model ignores, drives the same
    episodes; every state it leads to is added after the model's own decisions, with the
    model's label (not the table's); the closed loop visits states the model's did not;
    the next table is built on all of them. With no rounds the table is built from the
    model's decisions alone."""
    from types import SimpleNamespace

    from envs.actions import pass_budget
    from envs.scenario import Scenario
    from eval.export import cells, dagger, record

    class Rule:
        """A model stand-in: a quarter of the target once three requests wait, else four times."""

        name, kind = "rule", "learned"

        def __init__(self, sc):
            self.slo = sc.slo()

        def reset(self):
            pass

        def action_value(self, state):
            return 0.25 if state.waiting_requests >= 3 else 4.0

        def budget_for_value(self, state, v):
            return pass_budget(state, "time", v, self.slo.itl_s)

    monkeypatch.setattr(record, "policy_for", lambda model, s: Rule(s))
    sc = Scenario(rate=10.0, num_requests=120)
    episodes = ([(sc, sc.stream(0, 1, 5))], [(sc, sc.stream(0, 1, 6))])
    own = tuple(record.collect(None, eps) for eps in episodes)
    action = cells.action_spec(SimpleNamespace(actions="time"), sc)
    prov = scenario_provenance(sc)

    def run(rounds):
        args = SimpleNamespace(dagger_rounds=rounds, buckets=4)
        return dagger.dagger_rounds(None, episodes, own, ["running_decodes"], args, prov, action)

    (only,) = run(0)
    assert only.features == ["running_decodes"] and only.build[1].tolist() == own[0][1].tolist()
    rounds = run(2)
    assert rounds[0].table.to_dict() == only.table.to_dict()
    for before, r in zip(rounds, rounds[1:]):
        n = len(before.build[1])
        assert len(r.build[1]) > n and len(r.held[1]) > len(before.held[1])
        np.testing.assert_array_equal(r.build[1][:n], before.build[1])  # kept, then added to
        led = {k: v[n:] for k, v in r.build[0].items()}
        np.testing.assert_array_equal(r.build[1][n:], np.where(led["waiting_requests"] >= 3, 0.25, 4.0))
        # The table drove: the queues it led to are not the model's.
        assert set(led["waiting_requests"]) != set(own[0][0]["waiting_requests"])
        # Each visited cell holds the most frequent label over every decision so far.
        cells = np.array([r.table.cell([x]) for x in r.build[0]["running_decodes"]])
        for c in np.unique(cells):
            labels, counts = np.unique(r.build[1][cells == c], return_counts=True)
            assert r.table.action.cells[c] == labels[np.argmax(counts)]


def test_export_keeps_the_round_that_keeps_most_of_its_model(monkeypatch):
    """Round choice on hand-made figures (scenario, stream, model then rounds): the round
    with the highest mean of the capacity and goodput it keeps of the model's is kept, the
    earliest on a tie; goodput that cannot tell the rounds apart leaves the choice to
    capacity; a table that serves nothing (NaN) scores 0, not a skipped stream; streams
    where the model serves nothing are left out."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export import select

    def choose(goodput, capacity):
        monkeypatch.setattr(select, "goodput_runs", lambda *a, **k: np.asarray(goodput, dtype=float))
        rps = np.asarray(capacity, dtype=float)
        monkeypatch.setattr(select, "capacity_runs", lambda *a, **k: select.CapacityRuns(rps, rps / 2))
        return select.select_round(None, [None] * (len(goodput[0][0]) - 1), Scenario(),
                                   SimpleNamespace(fidelity_requests=80, workers=1, select_streams=3))

    same = [[[2.0, 2.0, 2.0, 2.0]] * 3]
    # Round 1 keeps 0.9 of the model's goodput where round 0 keeps 0.5 and round 2 0.85.
    found = [[[0.8, 0.40, 0.72, 0.68], [0.6, 0.30, 0.54, 0.51], [0.7, 0.35, 0.63, 0.60]]]
    got = choose(found, same)
    assert got["chosen"] == 1 and got["streams"] == 3
    assert got["goodput_kept"] == pytest.approx([0.5, 0.9, 0.85], abs=0.01)
    assert got["capacity_kept"] == [1.0, 1.0, 1.0]
    # Goodput far below capacity is the model's for every round: capacity decides.
    full = [[[1.0, 1.0, 1.0]] * 3]
    assert choose(full, [[[0.6, 0.60, 0.57], [0.5, 0.50, 0.48], [0.7, 0.70, 0.69]]])["chosen"] == 0
    assert choose(full, [[[0.6, 0.57, 0.60], [0.5, 0.48, 0.50], [0.7, 0.69, 0.70]]])["chosen"] == 1
    # Equal on both: the earliest round.
    assert choose(full, [[[0.6, 0.6, 0.6]] * 3])["chosen"] == 0
    # Where the model serves a few requests in a hundred, goodput does not judge: a table
    # "keeping" 150% of it there does not outweigh the capacity it loses.
    few = [[[0.03, 0.045, 0.035]] * 3]
    got = choose(few, [[[0.5, 0.47, 0.51]] * 3])
    assert got["chosen"] == 1 and "goodput_kept" not in got
    assert got["capacity_kept"] == pytest.approx([0.94, 1.02])
    # A round that serves nothing on a stream where the others do is not rewarded for it.
    found = [[[0.8, 0.72, math.nan], [0.6, 0.54, 0.6], [0.7, 0.63, 0.7], [math.nan, 0.1, 0.9]]]
    got = choose(found, [[[1.0, 1.0, 1.0]] * 4])
    assert got["chosen"] == 0 and got["streams"] == 4 and got["goodput_kept"][1] < 0.7
    assert choose([[[math.nan, 0.5, 0.9]]], [[[0.0, 0.5, 0.9]]]) == {"chosen": 0, "streams": 0}
    assert select.select_round(None, [None], Scenario(), None) == {"chosen": 0}
    # --select-streams: that many streams per scenario for both measures.
    asked = []
    monkeypatch.setattr(select, "goodput_runs", lambda *a, **k: asked.append(a[3]) or np.ones((3, 7, 3)))
    monkeypatch.setattr(select, "capacity_runs",
                        lambda *a, **k: asked.append(a[3]) or select.CapacityRuns(*[np.ones((3, 7, 3))] * 2))
    got = select.select_round(None, [None] * 2, Scenario(),
                              SimpleNamespace(fidelity_requests=80, workers=1, select_streams=7))
    assert asked == [7, 7] and got["streams"] == 21


def test_export_lays_out_capacities_by_scenario_stream_and_policy(monkeypatch):
    """``capacity_runs`` returns (scenario, stream, policy) with the model first, whatever
    order the sweep runs its pairs in, capacities and load factors alike, and passes its
    seed base to the sweep."""
    from eval.capacity import CapacityResult
    from eval.export import select

    seen = {}

    def sweep(pairs, seeds, num_requests, executor=None, progress=None, seed_base=None):
        seen["seed_base"] = seed_base
        # Each result encodes its pair: scenario s, policy p (0: model), stream i.
        return [CapacityResult(str(k), "x", tuple(100 * (k // 3) + 10 * (k % 3) + i for i in range(seeds)), (),
                               tuple(-(100 * (k // 3) + 10 * (k % 3) + i) for i in range(seeds)))
                for k in range(len(pairs))]

    monkeypatch.setattr(select, "capacity_sweep", sweep)
    monkeypatch.setattr(select, "policy_for", lambda model, sc: "model")
    monkeypatch.setattr(select, "table_policy", lambda t, sc, carry: t)
    got = select.capacity_runs(None, ["t1", "t2"], {"a": "A", "b": "B"}, 4, 123, 50, 1, "x")
    assert got.rps.shape == got.factors.shape == (2, 4, 3) and seen["seed_base"] == 123
    for s in range(2):
        for i in range(4):
            assert got.rps[s, i].tolist() == [100 * s + 10 * p + i for p in range(3)]
            assert got.factors[s, i].tolist() == [-(100 * s + 10 * p + i) for p in range(3)]


def test_capacity_streams_come_from_the_seed_base_asked_for(monkeypatch):
    """A capacity search draws its synthetic streams from ``seed_base`` (the evaluation's
    by default), so that a choice made on some streams is judged on others."""
    from envs.scenario import Scenario
    from envs.seeds import CAPACITY_SEEDS
    from eval.capacity import capacity_sweep
    from policies.baselines import StaticPolicy

    drawn = []
    stream = Scenario.stream

    def spy(self, i, n, seed_base, num_requests=None):
        drawn.append(seed_base + i)
        return stream(self, i, n, seed_base, num_requests)

    monkeypatch.setattr(Scenario, "stream", spy)
    sc = Scenario(rate=2.0)
    capacity_sweep([(sc, StaticPolicy(2048))], 2, 30, max_probes=3)
    assert set(drawn) == {CAPACITY_SEEDS, CAPACITY_SEEDS + 1}
    drawn.clear()
    capacity_sweep([(sc, StaticPolicy(2048))], 2, 30, max_probes=3, seed_base=555)
    assert set(drawn) == {555, 556}


def test_export_report_names_the_round_kept(capsys, tmp_path):
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export import report

    data = time_table([1.0, 0.5, 0.25], Scenario()).to_dict()
    data["fidelity"] = {"build_decisions": 100, "held_out_decisions": 50, "agreement": 1.0}
    rules = ["round 0", "round 1", "round 2", "time-budget-deadline:4"]
    for dagger, line in [({"rounds": 2, "chosen": 1, "streams": 9, "goodput_kept": [0.62, 0.99, 0.97],
                           "capacity_kept": [0.95, 1.0, 1.01]},
                          "kept: the table of round 1 among round 0, round 1, round 2 (the model's "
                          "figures each keeps, in that order, on 9 streams of their own: capacity "
                          "95.0%, 100.0%, 101.0%; goodput at load 62.0%, 99.0%, 97.0%; kept: the "
                          "highest mean of the shares, the earliest on a tie)"),
                         ({"rounds": 2, "chosen": 0, "streams": 0}, "kept: the table of round 0 among "
                          "round 0, round 1, round 2 (no stream"),
                         ({"rounds": 2, "chosen": 1, "streams": 9, "capacity_kept": [0.95, 1.03, 1.01]},
                          "capacity 95.0%, 103.0%, 101.0%; goodput at load not judged: the model "
                          "serves at most 10% of requests within the SLO there;"),
                         ({"rounds": 2, "candidates": rules, "chosen": 3, "streams": 9,
                           "capacity_kept": [0.95, 1.0, 1.01, 1.04], "goodput_kept": [1, 1, 1, 1]},
                          "3 cells over kv_usage; the time-budget-deadline:4 rule's, exactly: "
                          "time_fraction 1, 0.5, 0.25; made in 1 s)"),
                         ({"rounds": 0, "chosen": 0}, None)]:
        data["provenance"] = {**data["provenance"], "dagger": dagger}
        BudgetTable(data).save(tmp_path / "t.json")
        report.report(BudgetTable.load(tmp_path / "t.json"), 1.0, SimpleNamespace(out="t.json"))
        out = capsys.readouterr().out
        assert (line in out) if line else "kept:" not in out
        # A kept rule says it is one, and where to measure whether a learned table could do better.
        assert ("NOTE: the table is the time-budget-deadline:4 rule's, a rule and not a learned "
                "policy" in out) == (dagger["chosen"] == 3)
        assert ("--room` records it in the table" in out) == (dagger["chosen"] == 3)


def test_export_finds_cells_as_the_runtime_looks_them_up():
    """The export's vectorised cell index and votes agree with the runtime's one-decision
    lookup (bisect) and with a count by hand, on values at, between and beyond the edges."""
    from eval.export.cells import cell_modes, cells_of

    rng = np.random.default_rng(3)
    from envs.scenario import Scenario

    data = {**time_table([1.0] * 3, Scenario()).to_dict(), "fractions": [1.0] * 12, "visited": [1] * 12}
    data["features"] = [{"name": "kv_usage", "edges": [0.2, 0.5, 0.8]},
                        {"name": "running_decodes", "edges": [4.0, 16.0]}]
    t = BudgetTable(data)
    kv = np.concatenate([rng.random(300), [0.2, 0.5, 0.8, -1.0, 2.0, math.nan]])
    dec = np.concatenate([rng.integers(0, 30, 300).astype(float), [4.0, 16.0, 0.0, 3.0, 99.0, 5.0]])
    cells = cells_of(t, {"kv_usage": kv, "running_decodes": dec}, len(kv))
    assert cells.tolist() == [t.cell([a, b]) for a, b in zip(kv, dec)]
    values = rng.choice([0.25, 1.0, 4.0], len(kv))
    modes, counts = cell_modes(cells, values, 12, [4, 3])
    for c in range(12):
        picked = values[cells == c]
        assert counts[c] == len(picked)
        if len(picked):
            vals, n = np.unique(picked, return_counts=True)
            assert modes[c] == vals[np.argmax(n)]


def test_export_features_may_carry_their_own_edges():
    """``--features name:e1:e2`` fixes that feature's edges; a name alone takes the edges
    where the model's choice changes; bad names and edges are one-line errors."""
    from envs.errors import ConfigError
    from eval.export.features import feature_specs

    assert feature_specs("itl_slack_passes:1:2.5, prefill_due_s:6:8:10,last_step_s") == (
        ["itl_slack_passes", "prefill_due_s", "last_step_s"],
        {"itl_slack_passes": [1.0, 2.5], "prefill_due_s": [6.0, 8.0, 10.0]})
    for spec, message in [("prefill_due_s:8:6", "prefill_due_s's edges must be increasing"),
                          ("prefill_due_s:x", "prefill_due_s's edges must be increasing"),
                          ("prefill_due_s:nan", "edges must be increasing numbers"),
                          ("prefill_due_s:", "edges must be increasing numbers"),
                          ("kv_usage:" + ":".join(str(i) for i in range(40)), "at most 31"),
                          ("bogus:1", "must name quantities among"),
                          ("kv_usage,kv_usage:0.5", "names kv_usage twice"),
                          ("", "must name quantities among")]:
        with pytest.raises(ConfigError, match=message):
            feature_specs(spec)


def test_export_features_may_name_a_rule_for_its_tables():
    """A rule a table holds exactly stands for its table's features at its own edges, for
    the table's SLO: the deadline-KV rule's are the slack at one pass, the prefill queue due
    past 0.8 of the TTFT target (strictly: one float above) and the KV throttle's steps;
    a rule no table holds, or a feature named twice through one, is a one-line error."""
    import math

    from envs.errors import ConfigError
    from envs.scenario import Scenario
    from eval.export.features import feature_specs
    from policies.baselines import DEADLINE_MARGIN, KVSteps

    for ttft in (2.0, 10.0):
        names, fixed = feature_specs("time-budget-deadline-kv:16, prefill_tokens_per_itl:1000:2900",
                                     Scenario(slo_ttft_s=ttft))
        assert names == ["itl_slack_passes", "prefill_due_s", "kv_usage", "prefill_tokens_per_itl"]
        due = fixed["prefill_due_s"][0]
        assert due > DEADLINE_MARGIN * ttft and math.nextafter(due, 0) == DEADLINE_MARGIN * ttft
        assert fixed["itl_slack_passes"] == [1.0]
        assert fixed["kv_usage"] == [0.75, *KVSteps(1.0).edges] and len(fixed["kv_usage"]) == 13
        assert fixed["prefill_tokens_per_itl"] == [1000.0, 2900.0]
    assert feature_specs("time-budget-deadline:4")[0] == ["itl_slack_passes", "prefill_due_s"]
    assert feature_specs("time-budget-deadline : 4") == feature_specs("time-budget-deadline:4")
    for spec, message in [("time-budget-kv", "move their fraction continuously"),
                          ("time-budget-deadline-kv,kv_usage", "names kv_usage twice"),
                          ("time-budget-deadline,time-budget-deadline-kv", "names itl_slack_passes twice"),
                          ("time-budget-deadline:x", "TOP multiple"),
                          ("time-budget:0.5", "one cell: it reads no quantity")]:
        with pytest.raises(ConfigError, match=message):
            feature_specs(spec)
    with pytest.raises(ConfigError, match="time-budget-slack") as err:
        feature_specs("time-budget-deadline-kvv")
    assert "time-budget[" not in str(err.value)  # offered only where it can be taken


def test_the_export_takes_a_rules_edges_at_the_tables_slo(monkeypatch):
    """``export_run`` reads ``--features`` for the scenario it exports for: a rule's due
    time is 0.8 of that scenario's TTFT target, not of the default one."""
    from types import SimpleNamespace

    import eval.export as export
    from envs.scenario import Scenario
    from eval.export.args import ExportArgs

    seen = []

    def spy(spec, serving=None):
        seen.append(export_features(spec, serving))
        return seen[-1]

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    export_features = export.feature_specs
    monkeypatch.setattr(export, "feature_specs", spy)
    monkeypatch.setattr(export, "export_episodes", stop)
    with pytest.raises(Stop):
        export.export_run(SimpleNamespace(actions="time"), Scenario(slo_ttft_s=10.0),
                          ExportArgs(run_dir="x", rules="none", features="time-budget-deadline-kv"))
    assert seen[0][1]["prefill_due_s"][0] == pytest.approx(8.0)


def test_export_refines_cells_where_closed_loop_capacity_says(monkeypatch):
    """The refinement starts from the table that serves most on its streams, among the
    rounds' and one built from the model's decisions at its capacity on each of those
    streams; it tries in each cell the values the model takes in at least 1% of its
    decisions, and keeps a value only where the mean capacity rises by more than
    REFINE_GAIN. On a made-up capacity (16 in cell 2 +5%, in cell 1 +0.4%, in cell 0 -3%;
    4, taken in 0.5% of the decisions, would add 20% anywhere) only cell 2 changes."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.capacity import CapacityResult
    from eval.export import cells, dagger, refine

    def cap(cells):
        c = 1.0 + 0.05 * (cells[2] == 16) + 0.004 * (cells[1] == 16) - 0.03 * (cells[0] == 16)
        return c + 0.2 * (4.0 in cells)

    seen, model_factor = [], [0.0]

    scenarios = []

    def sweep(pairs, streams, num_requests, executor=None, progress=None, seed_base=None):
        seen.append(seed_base)
        scenarios.append([repr(sc) for sc, p in pairs if p is pairs[0][1]])
        out = []
        for sc, p in pairs:
            if p == "model":
                out.append(CapacityResult("m", "learned", (1.0,) * streams, (),
                                          (model_factor[0],) * streams))
            else:
                out.append(CapacityResult("t", "table", table_caps(sc, p.table, streams), ()))
        return out

    def table_caps(sc, table, streams):  # under a tight cache 16 in cell 2 loses 40%
        tight = sc.num_kv_blocks is not None and table.action.cells[2] == 16
        return tuple(cap(table.action.cells) * (1 + 0.1 * i) * (0.6 if tight else 1.0)
                     for i in range(streams))

    def looked_up(table, scs, n, *a):  # every cell read on every stream
        return ([set(range(len(table.action.cells)))] * (n * len(scs)),
                np.asarray([c for sc in scs for c in table_caps(sc, table, n)]))

    values = np.array([1.0] * 895 + [16.0] * 100 + [4.0] * 5)
    at_capacity = {"running_decodes": np.array([1.0, 2.0, 30.0, 40.0]), "budget": np.ones(4)}
    monkeypatch.setattr(refine, "capacity_sweep", sweep)
    monkeypatch.setattr(refine, "cells_looked_up", looked_up)
    monkeypatch.setattr(refine, "policy_for", lambda model, sc: "model")
    monkeypatch.setattr(refine, "collect",
                        lambda model, eps: (at_capacity, np.array([1.0, 1.0, 16.0, 16.0])))
    sc = Scenario()
    prov = {**scenario_provenance(sc), "rule": "r"}
    action = cells.time_action(sc)

    def round_(cells):
        data = {"schema_version": runtime.SCHEMA_VERSION, "kind": runtime.KIND, "action": action,
                "features": [{"name": "running_decodes", "edges": [4.0, 16.0]}],
                "fractions": cells, "default_budget": 512, "provenance": prov}
        return dagger.Round(BudgetTable(data), ["running_decodes"], ({}, values), ({}, values))

    rounds = [round_([16.0, 1.0, 1.0]), round_([1.0, 1.0, 1.0])]
    args = SimpleNamespace(refine_streams=3, fidelity_requests=80, workers=1, buckets=4,
                           refine_on="serving", run_dir=None)
    got = refine.refine_table(None, rounds, sc, args, prov, action)  # the model serves nothing
    assert list(got.table.action.cells) == [1.0, 1.0, 16.0]
    assert ("from round 1's table (cells also from the states the tables of the first 1 DAgger "
            "round(s) led to), 1 cell(s) changed") in got.table.provenance["rule"]
    assert got.table.provenance["refined_cells"] == [2]
    assert set(seen) == {refine.TABLE_REFINE_SEEDS}
    model_factor[0] = 1.0  # its decisions at capacity: 1 in cells 0-1, 16 in cell 2, kept as is
    got = refine.refine_table(None, rounds, sc, args, prov, action)
    assert list(got.table.action.cells) == [1.0, 1.0, 16.0]
    assert ("from the model's decisions at its capacity, 0 cell(s) changed"
            in got.table.provenance["rule"])
    # A token-budget run: its cells stay whole numbers of tokens.
    model_factor[0] = 0.0
    tokens = {k: v for k, v in round_([1.0, 1.0, 1.0]).table.to_dict().items() if k != "fractions"}
    tokens = {**tokens, "action": {"kind": "tokens"}, "budgets": [1, 1, 1]}
    token_values = np.array([1] * 900 + [16] * 100)
    got = refine.refine_table(None, [dagger.Round(BudgetTable(tokens), ["running_decodes"],
                                            ({}, token_values), ({}, token_values))],
                        sc, args, prov, None)
    assert got.table.action.kind == "tokens" and list(got.table.action.cells) == [1, 1, 16]
    assert got.table.provenance["refined_cells"] == [2]
    # Refined on the serving scenario and its variants: every table on each of the three,
    # the capacities pooled over their streams. Cell 2's 16 gains 5% on two and loses 40%
    # on the third, so it stays; the model's decisions at capacity come from all three.
    scenarios.clear()
    probed = []
    monkeypatch.setattr(refine, "probe_stream",
                        lambda sc, i, n, r, f, seed_base: probed.append(sc) or (sc, None))
    model_factor[0] = 1.0
    got = refine.refine_table(None, rounds, sc, SimpleNamespace(**{**vars(args), "refine_on": "final"}),
                        prov, action)
    assert list(got.table.action.cells) == [1.0, 1.0, 1.0]
    assert set(map(len, scenarios)) == {3} and all(len(set(s)) == 3 for s in scenarios)
    assert len(probed) == 9 and len({repr(p) for p in probed}) == 3
    assert "and each of its variants" in got.table.provenance["rule"]


def test_a_killed_cell_search_resumes_where_it_stopped(tmp_path):
    """The cell search writes its place after every cell; killed midway and started again
    on the same cells, values and streams it goes on from there and ends where an unbroken
    search ends, with fewer sweeps; a place saved for other cells, or a corrupt file, is
    ignored; the file goes when the search ends."""
    from eval.export import refine

    def search(progress, kill_at=None, reads=False):
        calls = []

        def capacities(tables, label, where):
            calls.append(label)
            if kill_at is not None and len(calls) == kill_at:
                raise KeyboardInterrupt
            return np.asarray([[1.0 + 0.05 * t.count(16.0) - 0.02 * t.count(4.0)] * len(where)
                               for t in tables])

        def looked_up(cells):  # every cell read on every stream
            return [set(range(4))] * 4, np.full(4, 1.0 + 0.05 * cells.count(16.0) - 0.02 * cells.count(4.0))

        cells = [1.0, 1.0, 4.0, 1.0]
        changed = refine.search_cells(cells, [1.0, 4.0, 16.0], np.ones(4), capacities, 4,
                                      lambda c: list(c), progress, looked_up if reads else None)
        return cells, changed, calls

    whole = search(None)
    assert whole[:2] == ([16.0, 16.0, 16.0, 16.0], [0, 1, 2, 3])
    progress = str(tmp_path / "refine_progress.json")
    with pytest.raises(KeyboardInterrupt):
        search(progress, kill_at=3)
    assert json.loads(Path(progress).read_text())["cell"] == 2
    resumed = search(progress)
    assert resumed[:2] == whole[:2] and len(resumed[2]) == len(whole[2]) - 2
    assert not Path(progress).exists()
    for junk in ('{"key": "other", "sweep": 1, "cell": 3}', "{not json", "[1, 2]"):
        Path(progress).write_text(junk)
        assert search(progress) == whole
    # The same with the cells each stream reads: the sets are taken again on resuming.
    with pytest.raises(KeyboardInterrupt):
        search(progress, kill_at=3, reads=True)
    assert search(progress, reads=True)[:2] == whole[:2] and not Path(progress).exists()


def test_a_cell_a_table_does_not_read_on_a_stream_cannot_change_its_capacity_there():
    """cells_looked_up finds, stream by stream, the cells a table reads in its capacity
    searches, with the capacities capacity_sweep finds; the sets differ by stream (a tight
    cache reaches high KV usage), a value changed in a cell leaves the capacity of every
    stream that does not read it as it was (the simulator is deterministic), and the
    refinement's measure on some streams is the full sweep's on those."""
    from agents.summary import final_scenarios
    from envs.scenario import Scenario
    from eval.capacity import capacity_sweep
    from eval.export import refine
    from eval.parallel import LocalExecutor
    from policies.table_policy import TablePolicy

    scs = list(final_scenarios(Scenario(rate=4.0)).values())
    data = {**time_table([1.0] * 3, scs[0]).to_dict(), "fractions": [1.0] * 12, "visited": [1] * 12}
    data["features"] = [{"name": "running_decodes", "edges": [2.0, 8.0, 24.0]},
                        {"name": "kv_usage", "edges": [0.3, 0.6]}]

    def make(cells):
        return BudgetTable({**data, "fractions": list(cells)})

    def caps(cells):
        found = capacity_sweep([(sc, TablePolicy(make(cells))) for sc in scs], 1, 80, seed_base=4242)
        return np.asarray([c for r in found for c in r.per_stream])

    base = caps([1.0] * 12)
    seen, found = refine.cells_looked_up(make([1.0] * 12), scs, 1, 80, 4242)
    assert len(seen) == 3 and len({frozenset(c) for c in seen}) > 1 and np.array_equal(found, base)
    changed = 0
    for cell in range(12):
        other = caps([16.0 if c == cell else 1.0 for c in range(12)])
        unread = [k for k in range(3) if cell not in seen[k]]
        assert np.array_equal(other[unread], base[unread]), cell
        changed += not np.array_equal(other, base)
    assert changed  # a cell it reads does change it
    runs = refine.RefineStreams(scs, 2, 80, LocalExecutor())  # streams numbered scenario by scenario
    full = runs.capacities([make([16.0] * 12)], "x")
    assert np.array_equal(runs.capacities([make([16.0] * 12)], "x", [1, 2, 5]), full[:, [1, 2, 5]])


def test_the_cell_search_measures_a_cell_only_where_the_table_reads_it():
    """The cell search measures each cell only on the streams whose set holds it, none
    where no stream reads it, takes the sets again after a change, and checks their
    capacities against the current ones: a mismatch measures every cell on every
    stream."""
    from eval.export import refine

    measured, visits = [], []

    def capacities(tables, label, where):  # cell 1 set to 4 gains 20% on stream 1
        measured.append((label.split("cell ")[1].split("/")[0], list(where)))
        return np.asarray([[1.0 + 0.2 * (t[1] == 4.0 and k == 1) for k in where] for t in tables])

    def looked_up(cells):  # cell 0 read on both streams, cell 1 on stream 1, cell 2 on none
        visits.append(list(cells))
        return [{0}, {0, 1}], np.asarray([1.0, 1.2 if cells[1] == 4.0 else 1.0])

    cells = [1.0, 1.0, 1.0]
    assert refine.search_cells(cells, [1.0, 4.0], np.ones(2), capacities, 2, list,
                               looked_up=looked_up) == [1]
    assert cells == [1.0, 4.0, 1.0]  # +20% on the one stream that reads it: +10% in the mean
    assert measured == [("1", [0, 1]), ("2", [1]), ("1", [0, 1]), ("2", [1])]
    assert visits == [[1.0, 1.0, 1.0], [1.0, 4.0, 1.0]]
    measured.clear()
    cells = [1.0, 1.0, 1.0]
    refine.search_cells(cells, [1.0, 4.0], np.full(2, 1.1), capacities, 2, list,
                        looked_up=looked_up)  # capacities that do not match: everything measured
    assert measured == [("1", [0, 1]), ("2", [0, 1]), ("3", [0, 1])]


def test_refined_table_not_kept_is_written_to_the_run_directory(tmp_path):
    """A refinement's table is written to the run directory when the choice keeps another
    (not beside --out: the presets' is tables/), with the choice's figures, and loads with
    the same cells."""
    from envs.scenario import Scenario
    from eval.export import cells, refine

    assert refine.refined_path("runs/x") == str(Path("runs/x/refined_table.json"))
    sc = Scenario()
    action = cells.time_action(sc)
    data = {"schema_version": runtime.SCHEMA_VERSION, "kind": runtime.KIND, "action": action,
            "features": [{"name": "running_decodes", "edges": [4.0, 16.0]}],
            "fractions": [1.0, 4.0, 16.0], "default_budget": 512,
            "provenance": {**scenario_provenance(sc), "rule": "r", "refined_cells": [1]}}
    dagger = {"candidates": ["round 0", "refined", "time-budget-deadline-kv:4"], "chosen": 2}
    path = refine.save_refined(BudgetTable(data), dagger, str(tmp_path))
    assert path == str(tmp_path / "refined_table.json")
    back = BudgetTable.load(path)
    assert list(back.action.cells) == [1.0, 4.0, 16.0]
    assert back.provenance["dagger"] == dagger and back.provenance["refined_cells"] == [1]


def test_the_kept_round_s_provenance_leaves_the_other_rounds_and_the_run_alone():
    """Every round's table is built on the run's provenance; saying what the kept one is
    must not rewrite theirs (nor the run's, which later tables are built on)."""
    from types import SimpleNamespace

    from envs.scenario import Scenario
    from eval.export.cells import build_table, scenario_provenance
    from eval.export.select import kept_table

    said = "cells from the model's decisions"
    prov = {**scenario_provenance(Scenario()), "rule": said}
    feats = {"running_decodes": np.arange(50.0)}
    rounds = [SimpleNamespace(table=build_table(feats, np.full(50, 1024), 2, provenance=prov),
                              features=["running_decodes"], build=(None, list(range(50))))
              for _ in range(3)]
    data, names, built = kept_table(rounds, [], (["round 0", "round 1", "round 2"], ["round"] * 3),
                                    {"chosen": 2}, SimpleNamespace(dagger_rounds=2), prov)
    assert data["provenance"]["rule"].startswith(said + "; cells also from the states the tables "
                                                 "of the first 2 DAgger round(s)")
    assert names == ["running_decodes"] and built == 50
    assert prov["rule"] == said and all(r.table.provenance["rule"] == said for r in rounds)
