"""Approximate policy iteration (agents/improve.py): the model imitates the rollout over
itself on sampled futures, and keeps its own actions where no rollout looked."""

from __future__ import annotations

import numpy as np
import pytest

from envs.observation import OBSERVATION_FIELDS
from envs.scenario import Scenario
from envs.workload import Workload
from tests.conftest import cli, refused_in_one_line

A100 = Scenario(hardware="a100-80g", model="llama-3-8b", slo_ttft_s=1.0, slo_itl_s=0.05)


@pytest.fixture(scope="module")
def tiny(tiny_ppo):
    """A small PPO model on the environment and the policy it serves."""
    model, _, policy = tiny_ppo
    return model, policy


def lone_requests() -> list:
    """Prompts far apart with nothing decoding while each prefills: every candidate gives
    the same budget, so the rollout never leaves its base."""
    w = Workload.from_arrays([5.0 * i for i in range(4)], [3000] * 4, [30] * 4)
    return [(A100, w)]


def test_fit_actions_learns_a_labelled_map(tiny):
    from agents.setup import fit_actions

    model, _ = tiny
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, len(OBSERVATION_FIELDS))).astype(np.float32)
    y = np.where(x[:, 0] > 0, 3, 7)
    assert fit_actions(model.policy, x, y, epochs=20) > 0.95


def test_where_the_rollout_keeps_its_base_the_labels_are_the_model_s_own_actions(tiny):
    from agents.improve import Rollout, RolloutLabels
    from eval.harness import run_policy

    _, policy = tiny
    base = policy.at(A100)
    rec = RolloutLabels(Rollout(horizon_ttft=2.0).over(base, A100), base)
    sc, w = lone_requests()[0]
    run_policy(sc, rec, [w])
    assert rec.deviations == 0 and len(rec.labels) >= 4
    assert rec.labels == base.actions_of(np.asarray(rec.obs)).tolist()


def test_a_round_with_nothing_to_improve_keeps_the_model_s_actions(tiny):
    """With no deviation to learn, a round fitted on its labels and the anchor states
    (labelled with the model's own actions) leaves what the model does almost as it was."""
    from agents.improve import Rollout, improve, served_states

    model, policy = tiny
    base = policy.at(A100)
    episodes = [(A100, A100.with_fields(rate=8.0).stream(0, 1, 5, 60))]
    anchor = served_states(base, episodes)
    before = base.actions_of(anchor)
    rounds = improve(model, base, lambda r: lone_requests(), 1, anchor, Rollout(horizon_ttft=2.0),
                     log=lambda line: None)
    after = base.actions_of(anchor)
    assert rounds[0]["deviated"] == 0 and rounds[0]["changed"] == 0
    assert np.mean(after == before) > 0.97


@pytest.mark.parametrize("argv, needle", [
    (["--out", "o"], "run: "),
    (["--run", "r"], "out: "),
    (["--run", "r", "--out", "o", "--rounds", "0"], "rounds: got 0"),
    (["--run", "r", "--out", "o", "--horizon-ttft", "1e9"], "horizon_ttft"),
    (["--run", "r", "--out", "o", "--candidates", "some"], "candidates"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_work(argv, needle):
    refused_in_one_line(cli("agents.improve", *argv), needle)


def test_a_run_directory_that_is_not_one_is_refused_in_one_line(tmp_path):
    from agents.improve import main
    from envs.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        main(["--run", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
