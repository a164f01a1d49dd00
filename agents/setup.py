"""Algorithm setups: which SB3 class, which action space, which hyperparameters.

Everything goes through SB3's documented constructor arguments and
``policy_kwargs``; nothing is patched.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from agents.checks import condition_index
from envs.scenario import Scenario
from policies.base import BudgetPolicy
from policies.learned import algorithm_class
from policies.specs import make_policy

# Action space each algorithm trains on: SAC needs a continuous one.
ACTION_TYPES = {"ppo": "discrete", "dqn": "discrete", "a2c": "discrete", "sac": "continuous"}


def hyperparameters(algo: str, n_envs: int, learning_rate: float | None, gamma: float,
                    net_arch: tuple[int, ...], n_steps: int | None = None) -> dict:
    """Defaults for this environment: one step is a decision interval (a twentieth of the
    TTFT target), whose consequences play out over a few TTFT targets. PPO's entropy
    bonus is small: it starts from the best fixed choice (:func:`imitate`) and should
    explore around it, not wander into the p99 cliff."""
    kw: dict = {"gamma": gamma, "policy_kwargs": {"net_arch": list(net_arch)}}
    if algo == "ppo":
        kw.update(n_steps=n_steps or max(2048 // n_envs, 64), batch_size=256, n_epochs=5, gae_lambda=0.95,
                  ent_coef=0.003, clip_range=0.2, learning_rate=learning_rate or 1e-4)
    elif algo == "a2c":
        kw.update(n_steps=n_steps or 32, ent_coef=0.01, learning_rate=learning_rate or 7e-4)
    elif algo == "dqn":
        kw.update(buffer_size=100_000, learning_starts=5_000, batch_size=128, train_freq=4,
                  target_update_interval=2_000, exploration_fraction=0.3,
                  exploration_final_eps=0.02, learning_rate=learning_rate or 2.5e-4)
    elif algo == "sac":
        kw.update(buffer_size=100_000, learning_starts=5_000, batch_size=256,
                  train_freq=4, gradient_steps=1, learning_rate=learning_rate or 3e-4)
    return kw


def make_model(algo: str, env, seed: int, tensorboard_log: str | None, learning_rate: float | None,
               gamma: float, net_arch: tuple[int, ...], n_steps: int | None = None):
    cls = algorithm_class(algo)
    return cls("MlpPolicy", env, seed=seed, tensorboard_log=tensorboard_log, verbose=0,
               **hyperparameters(algo, env.num_envs, learning_rate, gamma, net_arch, n_steps))


@lru_cache(maxsize=None)
def teacher_rule(spec: str) -> BudgetPolicy:
    """The fixed choice a spec names, as a teacher: its fraction of the ITL target read from
    raw observations does not depend on the SLO (``observed_fractions``)."""
    return make_policy(spec, UNIT_SLO)


UNIT_SLO = Scenario(slo_ttft_s=1.0, slo_itl_s=1.0)
"""A scenario whose targets are one second: a teacher's fractions are the same at any SLO."""


def teacher_actions(spec: str, ladder, raw_obs, max_num_seqs: int = 256,
                    max_pass: float | None = None) -> np.ndarray:
    """The ladder index a fixed choice that acts in time (a policy spec: ``time-budget:0.917``,
    ``time-budget-deadline-kv:16``, ...) takes for raw observations: the nearest rung, in
    log scale, to the fraction of the ITL target its rule picks there
    (``BudgetPolicy.observed_fractions``), no larger than the cap ``max_pass``."""
    fractions = teacher_rule(spec).observed_fractions(raw_obs, max_num_seqs)
    if max_pass is not None:
        fractions = np.minimum(fractions, max_pass)
    logs = np.log(np.asarray(ladder, dtype=float))
    return np.argmin(np.abs(np.log(fractions)[:, None] - logs[None, :]), axis=1)


def _teacher_actions_by_env(venv, raw_obs, teacher: str, ladder, teachers, conditions):
    scenarios = venv.get_attr("episode_scenario")
    cap = scenarios[0].max_pass_itl  # the run's: every episode has it
    if not teachers:
        return teacher_actions(teacher, ladder, raw_obs, max_pass=cap)
    names = []
    for sc in scenarios:
        i = condition_index(sc, conditions)
        names.append(teacher if i is None else teachers[i])
    names = np.asarray(names)
    out = np.empty(len(raw_obs), dtype=int)
    for n in set(names.tolist()):
        rows = names == n
        out[rows] = teacher_actions(n, ladder, raw_obs[rows], max_pass=cap)
    return out


CLONE_EPOCHS = 200
"""Passes of behaviour cloning over the teacher's decisions. A teacher rule is a function
of the observation, so the clone can match it; at 8 passes (625 steps of 256 decisions)
it learns the majority action and little else: across deployments it agreed on 82% of
20,000 decisions and on 35% of those not at 1x the ITL target (the deadline rule's boosts),
and on an L40S it never boosted where the rule did on a fifth of its passes. At 200
passes (24 s on one core) it agrees on 98.5% and on 95% of those, and follows the rule on
an L40S it never trained on in 97.6% of passes (docs/learning.md, "One policy for every
deployment")."""


def imitate(model, teacher: str, ladder, steps: int = 20_000, epochs: int = CLONE_EPOCHS,
            batch: int = 256, seed: int = 0, teachers: list[str] | None = None,
            conditions=(), progress=None) -> float:
    """Behaviour cloning of a teacher rule before reinforcement learning (the pretraining
    SB3's documentation describes: the policy's own distribution trained by maximum
    likelihood on the teacher's actions). The teacher drives the model's environments for
    ``steps`` decisions, which also warms up their observation statistics. With
    ``teachers`` (one fixed choice per training condition, see
    agents.checks.condition_teachers), each environment follows its episode's condition's
    teacher, and ``teacher`` where the episode comes from none of ``conditions``. Returns
    the share of those decisions on which the cloned policy agrees with the teacher.
    ``progress`` (a bar), where given, counts the decisions and then the epochs."""
    venv = model.get_env()
    raws, acts = [], []
    venv.reset()
    for _ in range(max(steps // venv.num_envs, 1)):
        raw = venv.get_original_obs()
        a = _teacher_actions_by_env(venv, raw, teacher, ladder, teachers, conditions)
        raws.append(raw)
        acts.append(a)
        venv.step(a)
        if progress is not None:
            progress.update(venv.num_envs)
    # Normalised with the statistics the policy acts with when learning starts, not with
    # each moment's (the first decisions' would be scaled by a few observations' spread).
    return fit_actions(model.policy, venv.normalize_obs(np.concatenate(raws)), np.concatenate(acts),
                       epochs, batch, seed, progress=progress)


def fit_actions(policy, x: np.ndarray, y: np.ndarray, epochs: int = 8, batch: int = 256,
                seed: int = 0, learning_rate: float = 1e-3, progress=None) -> float:
    """Train an SB3 policy's action distribution by maximum likelihood on normalised
    observations ``x`` and ladder indices ``y``; the share it then agrees on."""
    import torch  # heavy: only fitting needs it here

    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    opt = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(yt), generator=gen).split(batch):
            loss = -policy.get_distribution(xt[idx]).log_prob(yt[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if progress is not None:
            progress.update(len(yt) // epochs)
    with torch.no_grad():
        pred = policy.get_distribution(xt).distribution.probs.argmax(dim=1)
    return float((pred == yt).float().mean())
