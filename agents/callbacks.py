"""Callbacks (SB3's ``BaseCallback._on_step`` hook): evaluate on held-out arrivals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from envs.scenario import Scenario
from envs.workload import Workload
from eval.harness import run_policy
from policies.learned import ModelPolicy


def evaluate_model(model, scenario: Scenario, workloads: list[Workload], ladder, action_type: str):
    """Mean summary of ``model`` over ``workloads`` and every budget it applied."""
    policy = ModelPolicy(model, scenario.slo(), ladder, action_type)
    budgets = []

    def keep_budgets(_policy, _index, result):
        budgets.append(result.pass_budget[result.pass_budget >= 0])

    runs = run_policy(scenario, policy, workloads, on_result=keep_budgets).runs
    mean = {k: float(np.nanmean([r[k] for r in runs])) for k in
            ("goodput", "ttft_p99_s", "itl_p99_s", "itl_max_s", "budget_mean")}
    return mean, np.concatenate(budgets) if budgets else np.zeros(0)


class SimEvalCallback(BaseCallback):
    """Every ``eval_every`` steps, score the model on fixed held-out arrivals and log
    ``eval/*`` next to ``baseline/*`` (the best static budget on the same arrivals), so
    the curves show whether learning is winning. Keeps the best model by goodput."""

    def __init__(self, scenario: Scenario, workloads: list[Workload], baseline: dict,
                 ladder, action_type: str, eval_every: int, best_path: Path | None = None):
        super().__init__()
        self.scenario = scenario
        self.workloads = workloads
        self.baseline = baseline
        self.ladder = ladder
        self.action_type = action_type
        self.eval_every = eval_every
        self.best_path = best_path
        self.best = (-math.inf, -math.inf)
        self._last = 0
        self.history: list[dict] = []

    def _on_step(self) -> bool:
        if self.num_timesteps - self._last < self.eval_every:
            return True
        self._last = self.num_timesteps
        self.evaluate()
        return True

    def evaluate(self) -> dict:
        mean, budgets = evaluate_model(self.model, self.scenario, self.workloads, self.ladder,
                                       self.action_type)
        for k, v in mean.items():
            self.logger.record(f"eval/{k}", v)
        for k in ("goodput", "ttft_p99_s", "itl_p99_s", "itl_max_s"):
            self.logger.record(f"baseline/{k}", self.baseline[k])
        self.logger.record("baseline/budget", self.baseline["budget"])
        if len(budgets):
            import torch

            self.logger.record("eval/budget_log2_hist", torch.as_tensor(np.log2(budgets)))
        self.logger.dump(self.num_timesteps)
        mean["timesteps"] = self.num_timesteps
        self.history.append(mean)
        score = (mean["goodput"], -mean["ttft_p99_s"])
        if self.best_path is not None and score > self.best:
            self.best = score
            self.model.save(str(self.best_path))
        return mean
