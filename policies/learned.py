"""A trained stable-baselines3 model as a budget policy.

The model sees what the environment shows it: :func:`envs.observation.observe`,
normalised with the training run's ``VecNormalize`` statistics. For actor-critic models
(PPO, A2C) with discrete actions the deterministic action is computed with a numpy copy
of the policy network (a few microseconds, no torch call per pass); other models go
through ``model.predict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from envs.actions import FRACTION_LADDER, action_value, pass_budget
from envs.metrics import SLO
from envs.observation import observe, slo_features
from policies.base import BudgetPolicy


@dataclass(frozen=True)
class ObsNorm:
    """SB3 ``VecNormalize``'s observation statistics: ``clip((obs - mean) / sqrt(var + eps))``."""

    mean: tuple[float, ...]
    var: tuple[float, ...]
    clip: float = 10.0
    eps: float = 1e-8

    @classmethod
    def of(cls, vec_normalize) -> "ObsNorm | None":
        if vec_normalize is None or not getattr(vec_normalize, "norm_obs", False):
            return None
        rms = vec_normalize.obs_rms
        return cls(tuple(map(float, rms.mean)), tuple(map(float, rms.var)),
                   float(vec_normalize.clip_obs), float(vec_normalize.epsilon))

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        out = (obs - np.asarray(self.mean)) / np.sqrt(np.asarray(self.var) + self.eps)
        return np.clip(out, -self.clip, self.clip).astype(np.float32)


class NumpyActor:
    """The argmax action of an SB3 ``ActorCriticPolicy`` over discrete actions, in numpy."""

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray, str]]):
        self.layers = layers

    @classmethod
    def of(cls, model) -> "NumpyActor | None":
        """From the model's torch modules, read by their class names (this module imports no
        torch); None for any network it does not know."""
        policy = getattr(model, "policy", None)
        extractor = getattr(policy, "mlp_extractor", None)
        head = getattr(policy, "action_net", None)
        if extractor is None or type(head).__name__ != "Linear":
            return None

        def arrays(linear):
            return (linear.weight.detach().cpu().numpy().T.copy(),
                    linear.bias.detach().cpu().numpy().copy())

        layers = []
        for mod in extractor.policy_net:
            kind = type(mod).__name__
            if kind == "Linear":
                layers.append((*arrays(mod), "linear"))
            elif kind in ("Tanh", "ReLU") and layers:
                w, b, _ = layers[-1]
                layers[-1] = (w, b, kind.lower())
            else:
                return None
        layers.append((*arrays(head), "linear"))
        return cls(layers)

    def act(self, obs: np.ndarray) -> int:
        x = obs
        for w, b, kind in self.layers:
            x = x @ w + b
            if kind == "tanh":
                x = np.tanh(x)
            elif kind == "relu":
                x = np.maximum(x, 0.0)
        return int(np.argmax(x))


class ModelPolicy(BudgetPolicy):
    """Feeds the environment's observation of the simulator to an SB3 model.

    ``slo`` is the target pair the model is asked to serve (part of its observation, and
    the ITL target a time fraction multiplies); ``actions``, ``ladder`` and
    ``action_type`` must match the training environment's.
    """

    kind = "learned"

    def __init__(self, model, slo: SLO, ladder: Sequence[float] = FRACTION_LADDER,
                 action_type: str = "discrete", name: str = "learned", actions: str = "time",
                 obs_norm: ObsNorm | None = None):
        self.model, self.slo, self.name = model, slo, name
        self.ladder, self.action_type, self.actions = tuple(ladder), action_type, actions
        self.obs_norm = obs_norm
        self._slo_obs = slo_features(slo)
        shape = getattr(getattr(model, "observation_space", None), "shape", None)
        self.width = int(shape[0]) if shape else None
        """Entries the model reads: a model trained on an earlier, shorter observation
        vector reads its prefix (``envs.observation.EARLIER_WIDTHS``)."""
        self._actor = NumpyActor.of(model) if action_type == "discrete" else None

    def observation(self, state) -> np.ndarray:
        obs = observe(state, self.slo, self._slo_obs)[:self.width]
        return self.obs_norm(obs) if self.obs_norm is not None else obs

    def action(self, state):
        obs = self.observation(state)
        if self._actor is not None:
            return self._actor.act(obs)
        return self.model.predict(obs, deterministic=True)[0]

    def action_value(self, state) -> float:
        """The fraction of the ITL target (or token budget) the model picks in ``state``."""
        return action_value(self.action(state), self.ladder, self.action_type)

    def budget_for_value(self, state, value: float) -> int:
        return pass_budget(state, self.actions, value, self.slo.itl_s)

    def budget(self, state) -> int:
        return self.budget_for_value(state, self.action_value(state))

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return self.model.predict(observation, state, episode_start, deterministic)

    def __getstate__(self):
        # Ray ships policies to its workers: the numpy actor is enough to act; the torch
        # model stays behind when there is one.
        d = dict(self.__dict__)
        if d.get("_actor") is not None:
            d["model"] = None
        return d
