"""Callbacks (SB3's ``BaseCallback._on_step`` hook): evaluate on held-out episodes and keep
the model that beats its start on them, paired (:class:`SimEvalCallback`)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.checks import episode_cost
from envs.actions import clamp_budget
from envs.stats import ci95_half
from eval.harness import paired_difference
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
                                   obs_norm=obs_norm, max_pass=sc.max_pass_itl))
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
    episodes) and the share of each action, and keep the model that :meth:`keeps` says to
    keep, with its observation statistics.

    Model selection is paired: the first evaluation (the starting policy, a cloned teacher)
    is kept until a later one costs less than it beyond the 95% interval of the
    per-episode differences on the same episodes, and then the lowest-cost such one. A
    lower mean alone, which the episode noise (about ±4 on a cost of 4-5) hands to one
    evaluation or another, keeps nothing: a learner that never beats its start is its
    start, and the run says so."""

    def __init__(self, episodes, baseline_cost: float, ladder, actions: str, action_type: str,
                 eval_every: int, run_dir: Path | None = None, weights=None,
                 best_cost: float = math.inf, last_eval: int = 0, history: list | None = None,
                 baseline_costs=None, kept: int | None = None):
        super().__init__()
        self.episodes, self.baseline_cost = episodes, baseline_cost
        self.baseline_costs = None if baseline_costs is None else [float(c) for c in baseline_costs]
        """The best constant action's cost on each of ``episodes`` (the pairing against it)."""
        self.ladder, self.actions, self.action_type = ladder, actions, action_type
        self.eval_every, self.run_dir, self.weights = eval_every, run_dir, weights
        self.best = best_cost
        self.kept = kept
        """The timesteps of the kept model (None before any evaluation)."""
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

    @property
    def start(self) -> dict | None:
        """The first evaluation, where it kept its per-episode costs (runs from before
        paired selection did not)."""
        return self.history[0] if self.history and "costs" in self.history[0] else None

    def keeps(self, entry: dict) -> bool:
        """Whether the evaluation ``entry`` replaces the kept model: the first one always;
        later ones where they cost less than the start beyond the paired interval and less
        than the kept one (a run from before paired selection: the lowest cost, the latest
        on ties)."""
        if not self.history:
            return True
        start = self.start
        if start is None:
            return entry["cost"] <= self.best
        return entry["vs_start"]["verdict"] == "falls short" and entry["cost"] < self.best

    def evaluate(self) -> dict:
        venv = self.model.get_vec_normalize_env()
        cost, costs, hist = evaluate_model(self.model, ObsNorm.of(venv), self.episodes, self.ladder,
                                           self.actions, self.action_type, self.weights)
        self.logger.record("eval/cost", cost)
        self.logger.record("baseline/cost", self.baseline_cost)
        self.logger.record("eval/actions_used_5pct", hist["used_5pct"])
        for v, share in hist["shares"].items():
            self.logger.record(f"eval/action_share/{v}", share)
        entry = {"timesteps": self.num_timesteps, "cost": cost, "cost_ci95": ci95_half(costs),
                 "actions_used_5pct": hist["used_5pct"], "costs": [float(c) for c in costs]}
        if self.start is not None:
            entry["vs_start"] = paired_record(costs, self.start["costs"])
            self.logger.record("eval/cost_vs_start", entry["vs_start"]["diff"])
        if self.baseline_costs is not None and len(self.baseline_costs) == len(costs):
            entry["vs_baseline"] = paired_record(costs, self.baseline_costs)
        self.logger.dump(self.num_timesteps)
        keep = self.keeps(entry)
        self.history.append(entry)
        if keep:
            self.best, self.kept = cost, self.num_timesteps
            if self.run_dir is not None:
                save_model(self.model, self.run_dir / "best_model.zip", self.run_dir / "best_vecnormalize.pkl")
        return entry


def paired_record(costs, reference) -> dict:
    """Episode costs against a reference's on the same episodes: the mean difference, its
    95% interval and the verdict ("falls short": cheaper beyond the interval)."""
    v = paired_difference(costs, reference)
    return {"diff": v.rel, "ci95": v.half, "verdict": v.kind}


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
