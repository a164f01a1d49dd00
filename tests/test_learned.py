"""The learned controller's pieces: the numpy actor, observation normalisation, time-fraction
tables (the runtime converts exactly as the simulator), export and its fidelity."""

from __future__ import annotations

import random

import numpy as np
import pytest

from envs.cost import Roofline, chunk_price
from envs.cost import chunk_within as sim_chunk_within
from envs.profiles import get_hardware, get_model
from eval.export import build_table, scenario_provenance
from policies import table as runtime
from policies.table import BudgetTable


@pytest.mark.parametrize("hardware, model", [("h100-sxm", "llama-3-8b"), ("a100-80g", "llama-3-8b"),
                                             ("h100-sxm", "llama-3-70b-tp4"), ("m5-max", "llama-3-8b-q4"),
                                             ("h100-sxm-datasheet", "llama-3-8b")])
def test_runtime_converts_a_time_fraction_exactly_as_the_simulator(hardware, model):
    r = Roofline.of(get_hardware(hardware), get_model(model))
    cost = r.coefficients()
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 256)
        ctx = n * rng.randint(1, 8000)
        q = rng.choice([0, rng.randint(0, 60000)])
        seconds = rng.uniform(0.002, 0.4)
        x = rng.randint(0, 20000)
        assert runtime.pass_seconds(cost, n, ctx, x, q) == pytest.approx(chunk_price(r, n, ctx, x, q),
                                                                        rel=1e-12)
        assert (runtime.chunk_within(cost, n, ctx, seconds, q, 16384 - n)
                == sim_chunk_within(r, n, ctx, seconds, q, cap=16384 - n))


def time_table(fractions_by_kv, sc, edges=(0.5, 0.8)):
    cost = sc.simulator().roofline.coefficients()
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
    r = sc.simulator().roofline
    state = dict(running_decodes=40, decode_context_tokens=40 * 1500, head_prefilled_tokens=2000)
    for kv, f in ((0.2, 1.0), (0.6, 0.5), (0.9, 0.25)):
        want = 40 + sim_chunk_within(r, 40, 60000, f * sc.slo_itl_s, 2000, cap=16384 - 40)
        assert t.budget({**state, "kv_usage": kv}) == want
    assert t.budget({**state, "running_decodes": 0, "kv_usage": 0.1}) == 16384  # nothing decoding
    # The JSON round trip keeps the kind, the coefficients and the cells.
    again = BudgetTable(t.to_dict())
    assert again.action.cells == t.action.cells and again.action.cost == t.action.cost


@pytest.mark.parametrize("change, message", [
    ({"fractions": [1.0, 30.0, 0.5]}, "fractions: every cell must be a number in (0, 16]"),
    ({"fractions": [1.0, 0.5]}, "fractions: must list 3 cells"),
    ({"action": {"kind": "time_fraction", "itl_s": 0.1, "cap": 16384, "cost": {"weights_s": 1}}},
     "action.cost: must hold"),
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
    from eval.export import action_spec, agreement, feature_values, pick_features

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
    t = build_table({n: feature_values(n, build, action["cost"]) for n in names}, rule(build), 8,
                    prov, action)
    assert agreement(t, {n: feature_values(n, held, action["cost"]) for n in names}, rule(held)) > 0.94
    assert set(t.action.cells) == {1.0, 0.5, 0.25}


def test_numpy_actor_and_normalisation_match_the_model(tmp_path):
    """The learned policy acts with a numpy copy of the network on normalised observations,
    as the trained model does through SB3 and VecNormalize."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from policies.learned import NumpyActor, ObsNorm

    venv = VecNormalize(DummyVecEnv([lambda: ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))]),
                        norm_obs=True, norm_reward=True)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, verbose=0)
    model.learn(128)
    actor, norm = NumpyActor.of(model), ObsNorm.of(venv)
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))
    obs, _ = env.reset(seed=3)
    for _ in range(40):
        want = int(model.predict(venv.normalize_obs(obs), deterministic=True)[0])
        assert actor.act(norm(obs)) == want
        assert np.allclose(norm(obs), venv.normalize_obs(obs), atol=1e-6)
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
    cost = dict(t.action.cost, fixed_s=t.action.cost["fixed_s"] + 0.01)
    assert slower == 40 + runtime.chunk_within(cost, 40, 60000, 0.1, 0, 16384 - 40) < plain
    data = {k: v for k, v in t.to_dict().items() if k != "fractions"}
    tokens = BudgetTable({**data, "action": {"kind": "tokens"}, "budgets": [1, 2, 3],
                          "default_budget": 1})
    assert tokens.with_step_overhead(0.01) is tokens


def test_export_report_says_when_the_policy_is_constant(capsys):
    from types import SimpleNamespace

    from eval.export import report
    from policies.table import BudgetTable

    for path, constant in (("tables/a100-80g__llama-3-8b.json", True),
                           ("tables/h100-sxm__llama-3-8b.json", False)):
        report(BudgetTable.load(path), 1.0, SimpleNamespace(out=path))
        out = capsys.readouterr().out
        assert ("NOTE: every cell holds 1: the policy does not depend on the state here; it is "
                "the time-budget rule at 1 (time-budget:1)" in out) == constant, out
