"""The Gymnasium environment: API conformance, determinism, hand-computed rewards."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler, RewardWeights
from envs.cost import price_pass
from envs.scenario import Scenario
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL

SMALL = EpisodeSampler(episode_requests=40)


@pytest.mark.parametrize("action_type", ["discrete", "continuous"])
def test_gymnasium_and_sb3_env_checkers(action_type):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    check_env(ChunkBudgetEnv(action_type=action_type, sampler=SMALL), skip_render_check=True)
    sb3_check_env(ChunkBudgetEnv(action_type=action_type, sampler=SMALL), warn=True)


def test_registered_with_time_limit():
    env = gym.make(envs.ENV_ID, hardware="a100-80g", model="llama-3-8b", workload="mixed-poisson",
                   slo=(1.0, 0.05))
    assert env.spec.max_episode_steps == 4096
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert env.unwrapped.scenario.hardware == "a100-80g"
    assert env.unwrapped.scenario.slo_itl_s == 0.05


def rollout(env, seed, steps=300):
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


def toy_env(requests, ttft, itl, weights=None):
    arr, prm, out = zip(*requests)
    sc = Scenario(hardware=TOY_HW, model=TOY_MODEL, slo_ttft_s=ttft, slo_itl_s=itl)
    env = ChunkBudgetEnv(workload=Workload.from_arrays(arr, prm, out), budgets=(256, 512, 4096),
                         reward=weights or RewardWeights())
    env.scenario = sc  # toy profiles are objects, not preset names
    return env


def test_reward_charges_by_hand():
    # One 1,000-token prompt, output 3, budget 512: two prefill passes (one decision
    # each), then two decode passes simulated inside the last step.
    env = toy_env([(0.0, 1000, 3)], ttft=0.01, itl=0.001)
    env.reset(seed=0)
    d0 = price_pass(TOY_HW, TOY_MODEL, [], [(512, 0)]).total_s
    d1 = price_pass(TOY_HW, TOY_MODEL, [], [(488, 512)]).total_s
    d2 = price_pass(TOY_HW, TOY_MODEL, [1000]).total_s
    d3 = price_pass(TOY_HW, TOY_MODEL, [1001]).total_s
    assert d0 > 0.01  # the TTFT deadline passes during the first pass

    _, r, term, _, info = env.step(1)
    assert not term
    assert info["ttft_miss"] == 1
    assert info["ttft_wait"] == pytest.approx(d0 / 0.01)
    assert info["itl_excess"] == 0
    assert r == pytest.approx(-(1 + 0.05 * d0 / 0.01))

    _, r, term, _, info = env.step(1)
    assert term
    assert info["ttft_miss"] == 0  # charged once, when the deadline passed
    assert info["ttft_wait"] == pytest.approx(d1 / 0.01)
    excess = ((d2 - 0.001) + (d3 - 0.001)) / 0.001 / 3  # per mean output length (3)
    assert info["itl_excess"] == pytest.approx(excess)
    assert r == pytest.approx(-(0.05 * d1 / 0.01 + excess))
    assert info["episode_metrics"]["goodput"] == 0.0
    assert info["episode_metrics"]["budget_mean"] == 512
    assert info["episode_metrics"]["budgets"].tolist() == [512, 512]


def test_no_charge_when_the_slo_is_met():
    env = toy_env([(0.0, 100, 5), (1.0, 100, 5)], ttft=10.0, itl=1.0,
                  weights=RewardWeights(ttft_wait=0.0))
    env.reset(seed=0)
    total = 0.0
    term = False
    while not term:
        _, r, term, _, info = env.step(2)
        total += r
    assert total == 0.0
    assert info["episode_metrics"]["goodput"] == 1.0


def test_budget_below_decodes_is_raised_and_reported():
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=300, rate_range=(2.0, 2.0)))
    env.reset(seed=1)
    clipped = 0
    for i in range(3000):
        decodes = env.sim.num_decodes
        _, _, term, _, info = env.step(8 if i % 2 else 0)  # alternate 16,384 and 64
        if info["budget"] == 64:
            assert info["budget_applied"] == max(64, decodes)
            assert info["budget_clipped"] == (decodes > 64)
            clipped += info["budget_clipped"]
        if term:
            env.reset()
    assert clipped > 0


def test_continuous_actions_map_to_the_ladder_ends():
    env = ChunkBudgetEnv(action_type="continuous")
    assert env.budget_for(np.array([-1.0])) == 64
    assert env.budget_for(np.array([1.0])) == 16384
    assert env.budget_for(np.array([0.0])) == 1024


def test_trace_episodes_stay_in_the_training_span():
    env = ChunkBudgetEnv(workload="azure_conv_2023",
                         sampler=EpisodeSampler(window_s=60, trace_span=(0.0, 0.5), rate_range=(1, 1)))
    for seed in range(5):
        env.reset(seed=seed)
        assert 0 < len(env.sim.workload) < 19366 * 0.1


def test_bad_arguments():
    from envs.errors import ConfigError
    with pytest.raises(ConfigError, match="budgets"):
        ChunkBudgetEnv(budgets=(512, 256))
    with pytest.raises(ConfigError, match="action_type"):
        ChunkBudgetEnv(action_type="beta")
    with pytest.raises(ConfigError, match="trace"):
        ChunkBudgetEnv(workload="no-such-workload")


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
