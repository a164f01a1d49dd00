"""Callbacks (SB3's ``BaseCallback._on_step`` hook): evaluate on held-out episodes and keep
the best model."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.checks import episode_cost
from envs.actions import clamp_budget
from envs.stats import ci95_half
from eval.usage import ActionTrace, action_histogram
from policies.learned import ModelPolicy, ObsNorm


class Recorder(ActionTrace):
    """Wraps a model policy and keeps every action value it chose (for the action histogram)."""

    def __call__(self, state) -> int:
        v = self.policy.action_value(state)
        budget = clamp_budget(self.policy.budget_for_value(state, v), state.running_decodes)
        self.record(v, budget, state.running_decodes)
        return budget


def evaluate_model(model, obs_norm, episodes, ladder, actions: str, action_type: str,
                   weights=None, progress=None) -> tuple[float, list[float], dict]:
    """(mean cost, per-episode costs, action histogram) of ``model`` on ``episodes``, each
    pass decided by the model (as a table or an engine would); ``progress`` (a bar), where
    given, counts the episodes."""
    costs, values, budgets, decodes = [], [], [], []
    for sc, w in episodes:
        rec = Recorder(ModelPolicy(model, sc.slo(), ladder, action_type, actions=actions,
                                   obs_norm=obs_norm))
        costs.append(episode_cost(sc, w, rec, weights))
        values += rec.values
        budgets += rec.budgets
        decodes += rec.decodes
        if progress is not None:
            progress.update(1)
    return float(np.mean(costs)), costs, action_histogram(values, ladder, budgets, decodes, time_fractions=actions == "time")


class SimEvalCallback(BaseCallback):
    """Every ``eval_every`` steps, score the model on fixed held-out episodes of the
    training distribution (their streams are seeded apart from training's), log
    ``eval/cost`` next to ``baseline/cost`` (the best constant action on the same
    episodes) and the share of each action, and keep the best model (lowest cost; the
    latest on ties) with its observation statistics."""

    def __init__(self, episodes, baseline_cost: float, ladder, actions: str, action_type: str,
                 eval_every: int, run_dir: Path | None = None, weights=None,
                 best_cost: float = math.inf, last_eval: int = 0, history: list | None = None):
        super().__init__()
        self.episodes, self.baseline_cost = episodes, baseline_cost
        self.ladder, self.actions, self.action_type = ladder, actions, action_type
        self.eval_every, self.run_dir, self.weights = eval_every, run_dir, weights
        self.best = best_cost
        self._last = last_eval
        self.history: list[dict] = list(history or [])  # a resumed run's earlier evaluations

    def _on_training_start(self) -> None:
        if not self.history and self._last == 0:
            self.evaluate()  # the starting policy (a cloned teacher) is a candidate too

    def _on_step(self) -> bool:
        if self.num_timesteps - self._last >= self.eval_every:
            self._last = self.num_timesteps
            self.evaluate()
        return True

    def evaluate(self) -> dict:
        venv = self.model.get_vec_normalize_env()
        cost, costs, hist = evaluate_model(self.model, ObsNorm.of(venv), self.episodes, self.ladder,
                                           self.actions, self.action_type, self.weights)
        self.logger.record("eval/cost", cost)
        self.logger.record("baseline/cost", self.baseline_cost)
        self.logger.record("eval/actions_used_5pct", hist["used_5pct"])
        for v, share in hist["shares"].items():
            self.logger.record(f"eval/action_share/{v}", share)
        self.logger.dump(self.num_timesteps)
        entry = {"timesteps": self.num_timesteps, "cost": cost, "cost_ci95": ci95_half(costs),
            "actions_used_5pct": hist["used_5pct"]}
        self.history.append(entry)
        if self.run_dir is not None and cost <= self.best:
            self.best = cost
            save_model(self.model, self.run_dir / "best_model.zip", self.run_dir / "best_vecnormalize.pkl")
        return entry


def save_model(model, path: Path, norm_path: Path) -> None:
    """The model and its VecNormalize statistics, each written whole or not at all (a
    reader or a crash never sees half a file)."""
    tmp = path.with_name(path.stem + ".tmp.zip")
    model.save(str(tmp))
    venv = model.get_vec_normalize_env()
    if venv is not None:
        ntmp = norm_path.with_name(norm_path.name + ".tmp")
        venv.save(str(ntmp))
        shutil.move(str(ntmp), norm_path)
    shutil.move(str(tmp), path)
