"""The Gymnasium environment: API conformance, determinism, time-budget actions, decision
intervals, and the SLO reward on hand-computed cases."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs.actions import BUDGET_CAP, FRACTION_LADDER
from envs.pricing import time_budget
from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler, RewardWeights
from envs.cost import price_pass
from envs.metrics import SLO
from envs.scenario import Scenario
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL

SMALL = EpisodeSampler(episode_requests=40)


@pytest.mark.parametrize("actions, action_type", [("time", "discrete"), ("tokens", "discrete"),
                                                  ("time", "continuous")])
def test_gymnasium_and_sb3_env_checkers(actions, action_type):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = ChunkBudgetEnv(actions=actions, action_type=action_type, sampler=SMALL)
    check_env(env, skip_render_check=True)
    sb3_check_env(ChunkBudgetEnv(actions=actions, action_type=action_type, sampler=SMALL), warn=True)


def test_registered_with_time_limit():
    assert envs.ENV_ID == "chunkpilot/ChunkBudget-v4"
    env = gym.make(envs.ENV_ID, hardware="a100-80g", model="llama-3-8b", workload="mixed-poisson",
                   slo=(1.0, 0.05))
    assert env.spec.max_episode_steps == 4096
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert env.unwrapped.scenario.hardware == "a100-80g"
    assert env.unwrapped.scenario.slo_itl_s == 0.05
    assert env.action_space.n == len(FRACTION_LADDER)


def rollout(env, seed, steps=200):
    obs, _ = env.reset(seed=seed)
    out = [obs]
    rng = np.random.default_rng(123)
    for _ in range(steps):
        obs, r, term, trunc, info = env.step(int(rng.integers(env.action_space.n)))
        out.append(np.append(obs, r))
        if term or trunc:
            out.append(env.reset()[0])
    return np.concatenate(out)


def test_same_seed_same_trajectory():
    a = rollout(ChunkBudgetEnv(sampler=SMALL), seed=5)
    b = rollout(ChunkBudgetEnv(sampler=SMALL), seed=5)
    c = rollout(ChunkBudgetEnv(sampler=SMALL), seed=6)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def toy_env(requests, ttft, itl, **kwargs):
    arr, prm, out = zip(*requests)
    env = ChunkBudgetEnv(workload=Workload.from_arrays(arr, prm, out), slo=(ttft, itl), **kwargs)
    env.scenario = Scenario(hardware=TOY_HW, model=TOY_MODEL, slo_ttft_s=ttft, slo_itl_s=itl)
    return env


def test_reward_counts_slo_violations_by_hand():
    # One 1,000-token prompt (output 3) with a 512-token budget: two prefill passes,
    # then two decode passes. TTFT target 10 ms: missed in the first pass. ITL target
    # 1 ms: both decode gaps (d2, d3 > 1 ms) are slow tokens.
    env = toy_env([(0.0, 1000, 3)], ttft=0.01, itl=0.001, actions="tokens",
                  budgets=(256, 512, 4096), decision_interval_s=0)
    env.reset(seed=0)
    d0 = price_pass(TOY_HW, TOY_MODEL, [], [(512, 0)]).total_s
    d2 = price_pass(TOY_HW, TOY_MODEL, [1000]).total_s
    assert d0 > 0.01 and d2 > 0.001
    _, r, term, _, info = env.step(1)
    assert not term and info["ttft_miss"] == 100.0  # one request in one: 100% of requests
    assert info["slow_tokens"] == 0 and r == pytest.approx(-100.0)
    _, r, term, _, info = env.step(1)
    assert term and info["ttft_miss"] == 0  # charged once, when the deadline passed
    # Two slow tokens of two decode tokens, less the 1% a p99 target tolerates, in requests'
    # worth (mean output 3), in % of the one request; x10.
    assert info["slow_tokens"] == pytest.approx((2 - 0.01 * 2) / 3 * 100)
    assert r == pytest.approx(-10 * (2 - 0.01 * 2) / 3 * 100)
    assert info["episode_metrics"]["goodput"] == 0.0
    assert info["episode_metrics"]["budgets"].tolist() == [512, 512]


def test_slow_tokens_within_the_p99_allowance_are_free():
    """The slow charge of a step is the growth of the excess over 1% of decode tokens: free
    while within it, charged beyond it, returned as on-time tokens bring it back."""
    from envs.reward import RewardMeter

    class Log:
        deltas = (0, 0)

        def position(self):
            return 0

        def decode_tokens_since(self, mark, itl_s):
            return self.deltas[0], self.deltas[1], 0

    class Sim:
        log, requests, now = Log(), [], 0.0

    sim = Sim()
    meter = RewardMeter(sim, SLO(1.0, 0.1), mean_output=1.0, requests=100)
    charged = []
    for slow, tokens in ((1, 200), (3, 100), (0, 100)):
        sim.log.deltas = (slow, tokens)
        charged.append(meter.charges()[1])
    # excess: max(0, 1 - 2) = 0, max(0, 4 - 3) = 1, max(0, 4 - 4) = 0
    assert charged == pytest.approx([0.0, 1.0, -1.0])


def test_no_charge_when_the_slo_is_met():
    env = toy_env([(0.0, 100, 5), (1.0, 100, 5)], ttft=10.0, itl=1.0)
    env.reset(seed=0)
    total, term = 0.0, False
    while not term:
        _, r, term, _, info = env.step(len(FRACTION_LADDER) - 1)
        total += r
    assert total == 0.0
    assert info["episode_metrics"]["goodput"] == 1.0


def test_time_action_turns_into_the_time_budget_of_each_pass():
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=200, load_range=(1.5, 1.5)),
                         decision_interval_s=0)
    env.reset(seed=2)
    checked = 0
    for i in range(300):
        sim = env.sim
        a = i % len(FRACTION_LADDER)
        state = sim.state()
        want = time_budget(sim.cost, state.running_decodes, state.decode_context_tokens,
                           state.head_prefilled_tokens, FRACTION_LADDER[a] * env._slo.itl_s,
                           BUDGET_CAP)
        _, _, term, _, info = env.step(a)
        assert info["budget"] == want and info["passes"] == 1
        checked += sim.state().running_decodes > 0
        if term:
            env.reset()
    assert checked > 50


def test_a_step_spans_a_decision_interval_whatever_the_budget():
    """One step holds its action for the interval, so the steps an episode takes (and the
    discount per step) do not depend on how small the budgets are."""
    steps = {}
    for action in (0, len(FRACTION_LADDER) - 1):
        env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=150, load_range=(1.0, 1.0)),
                             decision_interval_s=0.1)
        env.reset(seed=4)
        t, n, term, spans = 0.0, 0, False, []
        while not term:
            _, _, term, _, info = env.step(action)
            spans.append(info["sim_time_s"] - t)
            t = info["sim_time_s"]
            n += 1
        steps[action] = (n, t)
        assert min(spans[:-1]) >= 0.1 - 1e-9  # every step but the last covers the interval
    (n_small, t_small), (n_large, t_large) = steps.values()
    assert n_small / t_small <= 10.0 + 1e-9 and n_large / t_large <= 10.0 + 1e-9


def test_continuous_actions_map_to_the_ladder_ends():
    env = ChunkBudgetEnv(action_type="continuous")
    assert env.action_value(np.array([-1.0])) == pytest.approx(FRACTION_LADDER[0])
    assert env.action_value(np.array([1.0])) == pytest.approx(FRACTION_LADDER[-1])
    tokens = ChunkBudgetEnv(actions="tokens", action_type="continuous")
    assert tokens.action_value(np.array([-1.0])) == pytest.approx(64)
    assert tokens.action_value(np.array([1.0])) == pytest.approx(16384)


def test_trace_episodes_stay_in_the_training_span():
    env = ChunkBudgetEnv(workload="azure_conv_2023",
                         sampler=EpisodeSampler(window_s=60, trace_span=(0.0, 0.5), load_range=(1, 1)))
    for seed in range(5):
        env.reset(seed=seed)
        assert 0 < len(env.sim.workload) < 19366 * 0.1


def test_bad_arguments():
    from envs.errors import ConfigError
    with pytest.raises(ConfigError, match="budgets"):
        ChunkBudgetEnv(budgets=(512, 256))
    with pytest.raises(ConfigError, match="action_type"):
        ChunkBudgetEnv(action_type="beta")
    with pytest.raises(ConfigError, match="actions"):
        ChunkBudgetEnv(actions="bytes")
    with pytest.raises(ConfigError, match="decision_interval_s"):
        ChunkBudgetEnv(decision_interval_s=-1.0)
    with pytest.raises(ConfigError, match="trace"):
        ChunkBudgetEnv(workload="no-such-workload")


def test_conditions_load_each_episode_relative_to_its_capacity():
    conds = ({"prompt": "fixed:500", "output": "fixed:20", "capacity_rps": 10.0},
             {"prompt": "fixed:4000", "output": "fixed:20", "slo_itl_s": 0.05, "capacity_rps": 2.0})
    env = ChunkBudgetEnv(sampler=EpisodeSampler(conditions=conds, load_range=(0.5, 1.5), episode_s=30))
    seen = set()
    for seed in range(12):
        env.reset(seed=seed)
        sc = env.episode_scenario
        cap = 10.0 if sc.prompt == "fixed:500" else 2.0
        assert 0.5 * cap <= sc.rate <= 1.5 * cap
        assert sc.num_requests == int(max(min(sc.rate * 30, 2000), 50))
        seen.add(sc.prompt)
    assert seen == {"fixed:500", "fixed:4000"}


def test_sampler_randomises_overhead_and_kv_capacity():
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=20, overhead_range_s=(0.001, 0.004),
                                                kv_blocks_range=(2000, 8000)))
    seen = set()
    for seed in range(6):
        env.reset(seed=seed)
        oh = env.sim.hardware.per_pass_overhead_s
        assert 0.001 <= oh <= 0.004
        assert 2000 <= env.sim.total_blocks <= 8000
        seen.add((round(oh, 6), env.sim.total_blocks))
    assert len(seen) == 6


def test_reward_ranks_two_statics_as_their_slo_outcomes(tmp_path):
    """On a scenario built with a p99 ITL cliff between 362 and 512 tokens, the episode
    cost ranks the two as their capacities do (362 serves ~50x more)."""
    from agents.checks import episode_cost
    from envs.profiles import profile_to_toml
    from policies.baselines import StaticPolicy

    hw, model = tmp_path / "hw.toml", tmp_path / "m.toml"
    hw.write_text(profile_to_toml(TOY_HW))
    model.write_text(profile_to_toml(TOY_MODEL))
    sc = Scenario(hardware=str(hw), model=str(model), rate=20.0, num_requests=80,
                  prompt="fixed:3000", output="fixed:40", slo_ttft_s=3.0, slo_itl_s=0.0095,
                  max_num_seqs=64, num_kv_blocks=4000)
    w = sc.arrivals(1)
    assert episode_cost(sc, w, StaticPolicy(362)) < episode_cost(sc, w, StaticPolicy(512))


def test_weights_scale_the_charges():
    env = toy_env([(0.0, 1000, 3)], ttft=0.01, itl=0.001, actions="tokens",
                  budgets=(256, 512, 4096), decision_interval_s=0,
                  reward=RewardWeights(ttft_miss=2.0, slow_tokens=0.0))
    env.reset(seed=0)
    _, r, *_ = env.step(1)
    assert r == pytest.approx(-200.0)
