"""Budget policies, specs, the lookup-table runtime and its export."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from envs.errors import ConfigError
from envs.profiles import get_hardware
from envs.scenario import Scenario
from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                SarathiSLOPolicy, StaticPolicy, vllm_default_budget)
from policies.specs import make_policies, make_policy
from policies.table import BudgetTable, TableError
from tests.conftest import make_sim

SMALL = Scenario(num_requests=150, rate=6.0)


class FakeState:
    def __init__(self, num_decodes=0, num_waiting=0, waiting_prefill_tokens=0, kv_usage=0.0):
        self.num_decodes = num_decodes
        self.num_waiting = num_waiting
        self.waiting_prefill_tokens = waiting_prefill_tokens
        self.kv_usage = kv_usage


def test_vllm_default_follows_memory_and_part():
    assert vllm_default_budget(get_hardware("h100-sxm")) == 8192
    assert vllm_default_budget(get_hardware("h200")) == 8192
    assert vllm_default_budget(get_hardware("h100-sxm"), "offline") == 16384
    assert vllm_default_budget(get_hardware("a100-80g")) == 2048
    assert vllm_default_budget(get_hardware("l40s")) == 2048
    assert vllm_default_budget(get_hardware("l40s"), "offline") == 8192


@pytest.mark.parametrize("decodes, expected", [(0, 2048), (5, 5 + 1024), (20, 20 + 512),
                                               (80, 80 + 256)])
def test_queue_depth_heuristic(decodes, expected):
    assert QueueDepthPolicy(512)(FakeState(num_decodes=decodes)) == expected


def test_no_decode_boost_and_floor_at_running_decodes():
    p = NoDecodeBoostPolicy(256, 8192)
    assert p(FakeState(num_decodes=0)) == 8192
    assert p(FakeState(num_decodes=3)) == 256
    assert p(FakeState(num_decodes=300)) == 300  # never below the decodes that must run


def test_free_ride_policy_uses_the_exact_free_ride():
    from envs.cost import free_ride_root
    sim = make_sim([(0.0, 4000, 50), (0.0, 100, 200)], hardware=get_hardware("h100-sxm"),
                   model="llama-3-8b")
    seen = []
    policy = FreeRidePolicy()

    def spy(state):
        b = policy(state)
        seen.append((state.num_decodes, state.decode_context_tokens, state.head_prefilled_tokens, b))
        return b

    sim.run(spy)
    assert seen[0][3] == 16384  # nothing decoding: no free ride to protect, go big
    for n, ctx, prefix, b in seen[1:]:
        if n:
            exact = n + int(free_ride_root(sim.roofline, n, ctx, prefix))
            assert b == min(max(exact, 256), 16384)


def test_sarathi_slo_meets_the_itl_target_at_the_typical_batch():
    p = SarathiSLOPolicy.fit(SMALL)
    assert p.typical["pass_s"] <= SMALL.slo_itl_s
    tighter = SarathiSLOPolicy.fit(SMALL.with_fields(slo_itl_s=0.05))
    assert tighter.tokens < p.tokens


def test_specs_build_every_kind_and_reject_unknown():
    names = [p.name for p in make_policies(
        "static:2048,vllm-default,vllm-default:offline,queue-depth,queue-depth:256,"
        "no-decode-boost,no-decode-boost:512:8192,free-ride,sarathi-slo", SMALL)]
    assert names[:8] == ["static:2048", "vllm-default:8192", "vllm-default:16384", "queue-depth:512",
                         "queue-depth:256", "no-decode-boost:2048:16384",
                         "no-decode-boost:512:8192", "free-ride"]
    assert names[8].startswith("sarathi-slo:")
    with pytest.raises(ConfigError, match=r"unknown spec 'best'; known: static:N"):
        make_policy("best", SMALL)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        make_policy("static:64", SMALL)
    with pytest.raises(ConfigError, match="named twice"):
        make_policies("static:512,static:512", SMALL)
    with pytest.raises(ConfigError, match="not a train.py run directory"):
        make_policy("model:/nonexistent", SMALL)


def test_static_predict_follows_the_sb3_protocol():
    p = StaticPolicy(2048)
    action, state = p.predict(np.zeros(12, dtype=np.float32))
    assert int(action) == 5 and state is None  # 2048 is rung 5 of the default ladder
    batch, _ = p.predict(np.zeros((3, 12), dtype=np.float32))
    assert batch.tolist() == [5, 5, 5]


# --- tables ----------------------------------------------------------------------------

def table_dict(**over):
    d = {"schema_version": 1, "kind": "chunkpilot-budget-table",
         "features": [{"name": "running_decodes", "edges": [10, 50]},
                      {"name": "kv_usage", "edges": [0.5]}],
         "budgets": [4096, 2048, 2048, 1024, 1024, 512], "visited": [1, 1, 1, 1, 0, 1],
         "default_budget": 2048}
    d.update(over)
    return d


def test_lookup_by_hand():
    t = BudgetTable(table_dict())
    # running_decodes buckets: (<10), [10, 50), (>=50); kv_usage: (<0.5), (>=0.5)
    assert t.lookup(running_decodes=0, kv_usage=0.1) == 4096
    assert t.lookup(running_decodes=0, kv_usage=0.5) == 2048  # an edge belongs to the bucket above
    assert t.lookup(running_decodes=10, kv_usage=0.0) == 2048
    assert t.lookup(running_decodes=49, kv_usage=0.9) == 1024
    assert t.lookup(running_decodes=500, kv_usage=0.9) == 512
    assert t.max_budget == 4096
    with pytest.raises(TableError, match="needs feature 'kv_usage'"):
        t.lookup(running_decodes=3)


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 2}, "schema_version: got 2"),
    ({"kind": "other"}, "kind: got 'other'"),
    ({"budgets": [1, 2, 3]}, "budgets: must list 6 cells"),
    ({"budgets": [1, 2, 3, 4, 5, -6]}, "every cell must be a positive integer"),
    ({"features": [{"name": "running_decodes", "edges": [50, 10]}]}, "must increase strictly"),
    ({"features": [{"name": "gpu_temperature", "edges": [1]}]}, "an engine can provide"),
])
def test_corrupt_tables_are_one_line_errors(change, message):
    with pytest.raises(TableError, match=message):
        BudgetTable(table_dict(**change))


def test_save_load_round_trip_and_csv(tmp_path):
    t = BudgetTable(table_dict())
    path = tmp_path / "sub" / "t.json"
    t.save(str(path))
    again = BudgetTable.load(str(path))
    assert again.budgets == t.budgets and again.edges == t.edges and again.visited == t.visited
    csv = t.to_csv().splitlines()
    assert csv[0] == "running_decodes_from,running_decodes_to,kv_usage_from,kv_usage_to,budget,visited"
    assert csv[1] == "-inf,10,-inf,0.5,4096,1"
    assert csv[5] == "50,inf,-inf,0.5,1024,0"
    path.write_text("{not json")
    with pytest.raises(TableError, match="not valid JSON"):
        BudgetTable.load(str(path))


def test_runtime_imports_nothing_beyond_the_standard_library():
    code = ("import sys; import policies.table as t; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'envs', 'gymnasium')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-S", "-c", code], check=True)


def test_table_policy_reads_the_scheduler_state():
    from policies.table_policy import TablePolicy
    p = TablePolicy(BudgetTable(table_dict()))
    assert p(FakeState(num_decodes=20, kv_usage=0.7)) == 1024


def test_build_table_from_states_fills_unvisited_cells_from_neighbours():
    from eval.export import build_table
    rng = np.random.default_rng(0)
    feats = np.column_stack([rng.integers(0, 100, 500), rng.integers(0, 20, 500),
                             rng.integers(0, 50000, 500), rng.random(500) * 0.5])
    budgets = np.where(feats[:, 0] < 30, 4096, 1024)  # a rule on running decodes only
    t = build_table(feats, budgets, buckets=4)
    agree = np.mean([t.lookup_values(f) == b for f, b in zip(feats, budgets)])
    assert agree > 0.9
    assert not all(t.visited) or t.cells == sum(t.visited)
    assert set(t.budgets) <= {1024, 4096}


def test_every_rule_answers_sb3_predict_on_env_observations():
    from stable_baselines3.common.evaluation import evaluate_policy

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from envs.observation import ObservedState, observe
    from policies.table_policy import TablePolicy

    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))
    obs, _ = env.reset(seed=0)
    for _ in range(15):
        obs, *_ = env.step(5)
    state = env.sim.state()
    seen = ObservedState(observe(env.sim, env._slo), 256)
    assert seen.num_decodes == state.num_decodes
    assert seen.num_waiting == state.num_waiting
    assert abs(seen.waiting_prefill_tokens - state.waiting_prefill_tokens) <= 1 + 1e-5 * state.waiting_prefill_tokens
    assert abs(seen.free_ride_tokens - state.free_ride_tokens) <= 1
    policies = [StaticPolicy(2048), QueueDepthPolicy(), NoDecodeBoostPolicy(), FreeRidePolicy(),
                TablePolicy(BudgetTable(table_dict()))]
    for p in policies:
        action, _ = p.predict(obs)
        assert env.budgets[int(action)] == env.budgets[p.action_for_budget(p(state))]
        batch, _ = p.predict(np.stack([obs, obs]))
        assert batch.shape == (2,)
    from stable_baselines3.common.monitor import Monitor
    mean, _ = evaluate_policy(QueueDepthPolicy(),
                              Monitor(ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=20))),
                              n_eval_episodes=1)
    assert np.isfinite(mean)
