"""Paired policy search (agents/search.py): evolution strategies on the action head, every
candidate on the same episodes, kept only where it beats the start on held-out episodes."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from envs.actions import FRACTION_LADDER
from envs.scenario import Scenario
from tests.conftest import cli

A100 = Scenario(hardware="a100-80g", model="llama-3-8b", slo_ttft_s=1.0, slo_itl_s=0.05)


def test_one_direction_steps_against_the_sign_of_its_difference():
    """Hand-computed: with one direction z and a linear cost a.theta, the mirror pair differs
    by 2 sigma a.z, and the step is -step * sigma * sign(a.z) * z."""
    from agents.search import search_step

    a = np.array([1.0, -2.0, 0.5])
    theta = np.array([0.3, 0.1, -0.4])
    z = np.random.default_rng(7).standard_normal((1, 3))[0]

    def costs(thetas, episodes):
        return [[float(a @ t) + e for e in episodes] for t in thetas]

    new, rec = search_step(theta, costs, [0.0, 5.0], 1, 0.5, 0.2, np.random.default_rng(7))
    assert rec["diffs"][0] == pytest.approx(2 * 0.5 * float(a @ z), abs=1e-4)
    assert rec["cost"] == pytest.approx(float(a @ theta) + 2.5)
    assert np.allclose(new, theta - 0.2 * 0.5 * np.sign(a @ z) * z)


def test_common_random_numbers_cancel_the_episodes_noise_and_the_search_descends():
    """Every candidate meets the same episodes: an offset per episode, however large,
    leaves every difference, and so every step, as it is without it; on a quadratic cost
    the search closes most of the distance to its minimum."""
    from agents.search import search_step

    target = np.linspace(-1.0, 1.0, 12)

    def make(offsets):
        def costs(thetas, episodes):
            return [[float(np.sum((t - target) ** 2)) + offsets[e] for e in episodes] for t in thetas]
        return costs

    noisy = make(np.random.default_rng(1).normal(0.0, 1e4, 1000))
    quiet = make(np.zeros(1000))
    a = b = np.zeros(12)
    for it in range(40):
        eps = list(range(it * 8, it * 8 + 8))
        a, _ = search_step(a, noisy, eps, 8, 0.1, 0.5, np.random.default_rng([3, it]))
        b, _ = search_step(b, quiet, eps, 8, 0.1, 0.5, np.random.default_rng([3, it]))
    assert np.allclose(a, b, atol=1e-6)
    assert np.linalg.norm(a - target) < 0.3 * np.linalg.norm(target)


@pytest.fixture(scope="module")
def tiny():
    """A small PPO model on the environment and the policy it serves."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from policies.learned import ModelPolicy, ObsNorm

    venv = VecNormalize(DummyVecEnv([lambda: ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))]),
                        norm_obs=True, norm_reward=True)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, verbose=0)
    model.learn(128)
    return model, venv, ModelPolicy(model, A100.slo(), obs_norm=ObsNorm.of(venv))


def test_the_head_round_trips_and_a_perturbed_copy_acts_by_its_own_logits(tiny):
    from agents.search import head_of, policy_with

    _, _, policy = tiny
    raw = np.random.default_rng(0).normal(0.0, 1.0, (300, policy.width)).astype(np.float32)
    theta = head_of(policy._actor)
    same = policy_with(policy, theta)
    assert (same.actions_of(raw) == policy.actions_of(raw)).all()
    favoured = theta.copy()
    favoured[-len(FRACTION_LADDER) + 5] += 1e4  # rung 5's bias
    shifted = policy_with(policy, favoured)
    assert (shifted.actions_of(raw) == 5).all()
    assert (pickle.loads(pickle.dumps(shifted)).actions_of(raw) == 5).all()
    assert (policy.actions_of(raw) == same.actions_of(raw)).all()  # the start is left as it was


def write_tiny_run(run, tiny) -> None:
    """A train.py run directory holding the tiny model as its kept one."""
    model, venv, _ = tiny
    run.mkdir()
    model.save(str(run / "best_model.zip"))
    venv.save(str(run / "best_vecnormalize.pkl"))
    (run / "config.json").write_text(json.dumps({
        "args": {"algo": "ppo", "load_low": 0.5, "load_high": 1.5, "episode_s": 5.0},
        "scenario": A100.with_fields(rate=4.0).fields_dict(), "ladder": list(FRACTION_LADDER),
        "action_type": "discrete", "actions": "time", "conditions": []}))


def fake_costs(target_rung: int | None):
    """Episode costs without simulating: each episode's offset, plus (with a rung) how far
    the head's bias for that rung is below 3 (a cost the search can lower)."""
    def costs(base, thetas, episodes, executor=None):
        offsets = [float(len(w)) for _, w in episodes]
        out = []
        for t in thetas:
            gap = 0.0 if target_rung is None else max(0.0, 3.0 - t[-len(FRACTION_LADDER) + target_rung])
            out.append([o + gap for o in offsets])
        return np.asarray(out)
    return costs


def test_a_search_that_does_not_beat_its_start_writes_no_model(tmp_path, tiny, monkeypatch):
    import agents.search as search

    monkeypatch.setattr(search, "episode_costs", fake_costs(None))
    run, out = tmp_path / "run", tmp_path / "out"
    write_tiny_run(run, tiny)
    proc = cli("agents.search", "--run", run, "--out", out, "--iterations", "2", "--directions", "2",
               "--episodes", "2", "--eval-episodes", "3", "--workers", "1", "--check-every", "1")
    assert proc.returncode == 0, proc.stderr
    assert "did not beat its start" in proc.stdout
    record = json.loads((out / "search.json").read_text())
    assert record["kept"] is None and [r["verdict"] for r in record["iterations"]] == ["ties", "ties"]
    assert not (out / "best_model.zip").exists() and not (out / search.PROGRESS).exists()


def test_a_search_that_beats_its_start_writes_a_run_with_the_searched_head(tmp_path, tiny, monkeypatch):
    import agents.search as search
    from policies.learned import load_run

    monkeypatch.setattr(search, "episode_costs", fake_costs(4))
    run, out = tmp_path / "run", tmp_path / "out"
    write_tiny_run(run, tiny)
    proc = cli("agents.search", "--run", run, "--out", out, "--iterations", "6", "--directions", "4",
               "--episodes", "2", "--eval-episodes", "3", "--workers", "1", "--step", "2")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "search.json").read_text())
    assert record["kept"] is not None and "costs less than the start" in proc.stdout
    kept = load_run(out)
    start = load_run(run)
    bias = kept._actor.layers[-1][1]
    assert bias[4] > start._actor.layers[-1][1][4]  # the search raised the rung the cost favours
    assert record["kept"]["held_out"] < record["start_cost"]


def test_a_killed_search_goes_on_from_its_place_to_the_unbroken_result(tmp_path, tiny, monkeypatch):
    import agents.search as search

    monkeypatch.setattr(search, "episode_costs", fake_costs(4))
    run = tmp_path / "run"
    write_tiny_run(run, tiny)
    flags = ["--iterations", "4", "--directions", "3", "--episodes", "2", "--eval-episodes", "3",
             "--workers", "1", "--check-every", "2"]
    assert cli("agents.search", "--run", run, "--out", tmp_path / "whole", *flags).returncode == 0
    step, calls = search.search_step, []

    def dies_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **k)

    monkeypatch.setattr(search, "search_step", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        search.main(["--run", str(run), "--out", str(tmp_path / "cut"), *flags])
    assert json.loads((tmp_path / "cut" / search.PROGRESS).read_text())["iteration"] == 2
    monkeypatch.setattr(search, "search_step", step)
    proc = cli("agents.search", "--run", run, "--out", tmp_path / "cut", *flags)
    assert "going on from iteration 2" in proc.stdout
    whole = json.loads((tmp_path / "whole" / "search.json").read_text())
    cut = json.loads((tmp_path / "cut" / "search.json").read_text())
    assert cut["iterations"] == whole["iterations"] and cut["kept"] == whole["kept"]


@pytest.mark.parametrize("argv, needle", [
    (["--out", "o"], "run: "),
    (["--run", "r"], "out: "),
    (["--run", "r", "--out", "o", "--sigma", "0"], "sigma: got 0"),
    (["--run", "r", "--out", "o", "--directions", "0"], "directions"),
    (["--run", "r", "--out", "o", "--eval-episodes", "1"], "eval_episodes"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_work(argv, needle):
    proc = cli("agents.search", *argv)
    assert proc.returncode == 2 and not proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_a_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path):
    proc = cli("agents.search", "--run", tmp_path, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "not a train.py run directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
