"""A trained stable-baselines3 model as a budget policy."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from envs.actions import DEFAULT_LADDER, budget_from_action
from envs.observation import observe, slo_features
from envs.metrics import SLO
from policies.base import BudgetPolicy


class ModelPolicy(BudgetPolicy):
    """Feeds the environment's observation of the simulator to an SB3 model.

    ``slo`` is the target pair the model is asked to serve (the last two entries of
    its observation); ``action_type`` and ``ladder`` must match the training env.
    """

    kind = "learned"

    def __init__(self, model, slo: SLO, ladder: Sequence[int] = DEFAULT_LADDER,
                 action_type: str = "discrete", name: str = "learned"):
        self.model = model
        self.slo = slo
        self.ladder = tuple(ladder)
        self.action_type = action_type
        self.name = name
        self._slo_obs = slo_features(slo)

    def observation(self, state) -> np.ndarray:
        return observe(state.simulator, self.slo, self._slo_obs)

    def budget(self, state) -> int:
        action, _ = self.model.predict(self.observation(state), deterministic=True)
        return budget_from_action(action, self.ladder, self.action_type)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return self.model.predict(observation, state, episode_start, deterministic)
