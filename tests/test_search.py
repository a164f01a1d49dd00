"""Paired policy search (agents/search.py): evolution strategies on the action head, every
candidate on the same episodes, kept only where it beats the start on held-out episodes."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from envs.actions import FRACTION_LADDER
from envs.scenario import Scenario
from tests.conftest import cli, refused_in_one_line

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


def test_the_head_round_trips_and_a_perturbed_copy_acts_by_its_own_logits(tiny_ppo):
    from agents.search import policy_with

    _, _, policy = tiny_ppo
    raw = np.random.default_rng(0).normal(0.0, 1.0, (300, policy.width)).astype(np.float32)
    theta = policy.actor.head()
    same = policy_with(policy, theta)
    assert (same.actions_of(raw) == policy.actions_of(raw)).all()
    favoured = theta.copy()
    favoured[-len(FRACTION_LADDER) + 5] += 1e4  # rung 5's bias
    shifted = policy_with(policy, favoured)
    assert (shifted.actions_of(raw) == 5).all()
    assert (pickle.loads(pickle.dumps(shifted)).actions_of(raw) == 5).all()
    assert (policy.actions_of(raw) == same.actions_of(raw)).all()  # the start is left as it was


def write_tiny_run(run, tiny_ppo, algo: str = "ppo") -> None:
    """A train.py run directory holding the tiny model as its kept one."""
    model, venv, _ = tiny_ppo
    run.mkdir()
    model.save(str(run / "best_model.zip"))
    venv.save(str(run / "best_vecnormalize.pkl"))
    (run / "config.json").write_text(json.dumps({
        "args": {"algo": algo, "load_low": 0.5, "load_high": 1.5, "episode_s": 5.0},
        "scenario": A100.with_fields(rate=4.0).fields_dict(), "ladder": list(FRACTION_LADDER),
        "action_type": "discrete", "actions": "time", "conditions": []}))


RUNGS = len(FRACTION_LADDER)


def fake_costs(target_rung: int | None):
    """Episode costs without simulating: each episode's offset, plus (with a rung) how far
    the head's bias for that rung and the weight from feature 0 to it are below 3 (a cost
    the search can lower)."""
    def costs(base, thetas, episodes, executor=None, requests=0):
        # an episode's arrivals, or (the capacity objective's) its stream's seed
        offsets = [float(w % 97 if requests else len(w)) for _, w in episodes]
        out = []
        for t in thetas:
            gap = 0.0 if target_rung is None else (max(0.0, 3.0 - t[-RUNGS + target_rung])
                                                   + max(0.0, 3.0 - t[target_rung]))
            out.append([o + gap for o in offsets])
        return np.asarray(out)
    return costs


def searched(tmp_path, tiny_ppo, monkeypatch, rung, *flags):
    """agents.search on the tiny run with :func:`fake_costs` (``rung``): (its result, OUT)."""
    import agents.search as search

    monkeypatch.setattr(search, "episode_costs", fake_costs(rung))
    run, out = tmp_path / "run", tmp_path / "out"
    write_tiny_run(run, tiny_ppo)
    proc = cli("agents.search", "--run", run, "--out", out, "--episodes", "2", "--eval-episodes", "3",
               "--workers", "1", *flags)
    assert proc.returncode == 0, proc.stderr
    return proc, out


def test_a_search_that_does_not_beat_its_start_writes_no_model(tmp_path, tiny_ppo, monkeypatch):
    import agents.search as search

    proc, out = searched(tmp_path, tiny_ppo, monkeypatch, None, "--iterations", "2", "--directions", "2",
                         "--check-every", "1")
    assert "did not beat its start" in proc.stdout
    record = json.loads((out / "search.json").read_text())
    assert record["kept"] is None and [r["verdict"] for r in record["iterations"]] == ["ties", "ties"]
    assert not (out / "best_model.zip").exists() and not (out / search.PROGRESS).exists()


def test_a_search_that_beats_its_start_writes_a_run_with_the_searched_head(tmp_path, tiny_ppo, monkeypatch):
    from policies.learned import load_run

    proc, out = searched(tmp_path, tiny_ppo, monkeypatch, 4, "--iterations", "6", "--directions", "4",
                         "--step", "2")
    run = tmp_path / "run"
    record = json.loads((out / "search.json").read_text())
    assert record["kept"] is not None and "cost less than the start" in proc.stdout
    assert record["confirmed"]["verdict"] == "falls short" and record["confirmed"]["episodes"] == 12
    assert "theta" not in record["kept"]
    kept, start = load_run(out), load_run(run)
    head = kept.model.policy.action_net.state_dict()  # the torch model written: actions x features
    before = start.model.policy.action_net.state_dict()
    assert float(head["bias"][4]) > float(before["bias"][4])  # raised where the cost favours it
    assert float(head["weight"][4, 0]) > float(before["weight"][4, 0])
    assert np.allclose(kept.actor.head()[RUNGS:-RUNGS], start.actor.head()[RUNGS:-RUNGS], atol=0.5)
    assert record["kept"]["held_out"] < record["start_cost"]


def test_a_lead_that_fresh_episodes_do_not_confirm_keeps_no_model(tmp_path, tiny_ppo, monkeypatch):
    import agents.search as search

    monkeypatch.setattr(search, "confirm", lambda *a, **k: {
        "episodes": 12, "cost": 1.0, "start_cost": 1.0, "diff": 0.0, "ci95": 0.1, "verdict": "ties",
        "differ": 0, "loads": []})
    proc, out = searched(tmp_path, tiny_ppo, monkeypatch, 4, "--iterations", "3", "--directions", "4",
                         "--step", "2")
    assert "does not hold on fresh episodes" in proc.stdout
    assert json.loads((out / "search.json").read_text())["confirmed"]["verdict"] == "ties"
    assert not (out / "best_model.zip").exists() and not (out / "config.json").exists()


def test_an_episode_s_load_is_its_rate_over_its_condition_s_capacity():
    from agents.search import episode_load

    conditions = [{"workload": "a", "capacity_rps": 2.0}, {"workload": "b", "capacity_rps": 4.0}]
    sc = type("S", (), {"workload": "b", "rate": 5.0})()
    assert episode_load(sc, conditions) == pytest.approx(1.25)
    assert episode_load(type("S", (), {"workload": "c", "rate": 5.0})(), conditions) is None


def test_a_killed_search_goes_on_from_its_place_to_the_unbroken_result(tmp_path, tiny_ppo, monkeypatch):
    import agents.search as search

    monkeypatch.setattr(search, "episode_costs", fake_costs(4))
    run = tmp_path / "run"
    write_tiny_run(run, tiny_ppo)
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
    (["--run", "r", "--out", "o", "--objective", "reward"], "objective: got 'reward'"),
    (["--run", "r", "--out", "o", "--capacity-requests", "5"], "capacity_requests"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_work(argv, needle):
    refused_in_one_line(cli("agents.search", *argv), needle)


def test_a_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path):
    proc = cli("agents.search", "--run", tmp_path, "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.startswith("error: run: ")
    assert "not a train.py run directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_run_without_an_actor_s_head_or_an_out_that_is_another_run_is_refused(tmp_path, tiny_ppo):
    sac, run, other = tmp_path / "sac", tmp_path / "run", tmp_path / "other"
    write_tiny_run(sac, tiny_ppo, algo="sac")
    proc = cli("agents.search", "--run", sac, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "run: " in proc.stderr and "trained with sac" in proc.stderr
    write_tiny_run(run, tiny_ppo)
    write_tiny_run(other, tiny_ppo)
    for out, needle in ((other, "out: "), (run, "must not be the run itself")):
        proc = cli("agents.search", "--run", run, "--out", out)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert "holds a train.py run" in cli("agents.search", "--run", run, "--out", other).stderr
    assert (other / "best_model.zip").exists() and (run / "best_model.zip").exists()


@pytest.mark.parametrize("saved", ["[]", "1", "{\"key\": 3}", "not json"])
def test_a_damaged_place_starts_afresh_and_says_so(tmp_path, tiny_ppo, monkeypatch, saved):
    import agents.search as search

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / search.PROGRESS).write_text(saved)
    proc, out = searched(tmp_path, tiny_ppo, monkeypatch, None, "--iterations", "1", "--directions", "1")
    assert "starting afresh" in proc.stdout and (out / "search.json").exists()


def test_the_capacity_objective_is_minus_the_log_of_the_load_eval_capacity_finds():
    """On the same stream, the cost is -log of eval.capacity's load factor; a tighter TTFT
    target costs more; an SLO no load meets costs -log(LOWEST_LOAD)."""
    from agents.search import CAPACITY_STEP, LOWEST_LOAD, capacity_cost
    from eval.capacity import stream_capacity
    from policies.specs import make_policy

    sc = A100.with_fields(rate=8.0, slo_ttft_s=5.0)  # the mix's long prompts need over 1 s
    rule = make_policy("time-budget", sc)
    _, factor, _ = stream_capacity(sc, rule, 0, 1, 60, step=CAPACITY_STEP, min_duration_s=50.0,
                                   seed_base=123)
    assert factor > 0 and capacity_cost(sc, 123, rule, 60) == pytest.approx(-np.log(factor))
    assert capacity_cost(sc, 123, rule, 60) == capacity_cost(sc, 123, rule, 60)  # deterministic
    tight = sc.with_fields(slo_ttft_s=2.0)
    assert capacity_cost(tight, 123, rule, 60) > capacity_cost(sc, 123, rule, 60)
    hopeless = sc.with_fields(slo_ttft_s=0.5)
    assert capacity_cost(hopeless, 123, rule, 60) == pytest.approx(-np.log(LOWEST_LOAD))


def test_capacity_episodes_are_the_drawn_conditions_with_their_own_stream_seeds():
    from agents.search import search_episodes
    from envs.episodes import EpisodeSampler, draw_episodes

    sampler = EpisodeSampler(load_range=(0.9, 1.3))
    drawn = draw_episodes(A100.with_fields(rate=4.0), sampler, 3, 50)
    cap = search_episodes(A100.with_fields(rate=4.0), sampler, 3, 50, "capacity", 7000)
    assert [sc for sc, _ in cap] == [sc for sc, _ in drawn]
    assert [s for _, s in cap] == [7000, 7001, 7002]
    cost = search_episodes(A100.with_fields(rate=4.0), sampler, 3, 50, "cost", 7000)
    assert all(a[0] == b[0] and np.array_equal(a[1].arrival_s, b[1].arrival_s)
               for a, b in zip(cost, drawn))


def test_a_capacity_search_scores_training_held_out_and_fresh_streams_apart(tmp_path, tiny_ppo, monkeypatch):
    """The capacity objective asks for --capacity-requests per stream, trains on streams
    below EVAL_SEED_BASE, checks on SEARCH_HELD_STREAMS and confirms on SEARCH_CONFIRM_SEEDS,
    and speaks of capacity."""
    import agents.search as search
    from envs.seeds import EVAL_SEED_BASE, SEARCH_CONFIRM_SEEDS, SEARCH_HELD_STREAMS

    fake, seen = fake_costs(4), []

    def costs(base, thetas, episodes, executor=None, requests=0):
        seen.append((requests, [s for _, s in episodes]))
        return fake(base, thetas, episodes, executor, requests)

    monkeypatch.setattr(search, "episode_costs", costs)
    run, out = tmp_path / "run", tmp_path / "out"
    write_tiny_run(run, tiny_ppo)
    proc = cli("agents.search", "--run", run, "--out", out, "--episodes", "2", "--eval-episodes", "3",
               "--workers", "1", "--objective", "capacity", "--capacity-requests", "40",
               "--iterations", "6", "--directions", "4", "--step", "2")
    assert proc.returncode == 0, proc.stderr
    assert {r for r, _ in seen} == {40}
    seeds = [s for _, ss in seen for s in ss]
    held = [s for s in seeds if SEARCH_HELD_STREAMS <= s < SEARCH_HELD_STREAMS + 3]
    fresh = [s for s in seeds if SEARCH_CONFIRM_SEEDS <= s < SEARCH_CONFIRM_SEEDS + 12]
    assert held and sorted(fresh) == list(range(SEARCH_CONFIRM_SEEDS, SEARCH_CONFIRM_SEEDS + 12))
    assert all(s < EVAL_SEED_BASE for s in seeds if s not in held and s not in fresh)
    assert "served more than the start" in proc.stdout and "capacity +" in proc.stdout
    record = json.loads((out / "search.json").read_text())
    assert record["args"]["objective"] == "capacity" and record["confirmed"]["verdict"] == "falls short"


def test_the_capacity_objective_searches_a_real_run_end_to_end(tmp_path, tiny_ppo):
    proc = cli("agents.search", "--run", write_tiny_run(tmp_path / "run", tiny_ppo) or tmp_path / "run",
               "--out", tmp_path / "out", "--objective", "capacity", "--capacity-requests", "20",
               "--iterations", "1", "--directions", "1", "--episodes", "2", "--eval-episodes", "2",
               "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out" / "search.json").read_text())
    assert len(record["start_costs"]) == 2 and all(np.isfinite(record["start_costs"]))


def test_the_capacity_objective_refuses_a_trace_run_in_one_line(tmp_path, tiny_ppo):
    run = tmp_path / "run"
    write_tiny_run(run, tiny_ppo)
    config = json.loads((run / "config.json").read_text())
    config["conditions"] = [{"trace": "azure-conv", "capacity_rps": 2.0}]
    (run / "config.json").write_text(json.dumps(config))
    proc = cli("agents.search", "--run", run, "--out", tmp_path / "out", "--objective", "capacity")
    refused_in_one_line(proc, "objective: ")
    assert "azure-conv" in proc.stderr and not (tmp_path / "out").exists()
