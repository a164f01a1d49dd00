"""A trained stable-baselines3 model as a budget policy, and the train.py run directory
it is read from (``model:RUN_DIR``).

The model sees what the environment shows it: :func:`envs.observation.observe`,
normalised with the training run's ``VecNormalize`` statistics. For actor-critic models
(PPO, A2C) with discrete actions the deterministic action is computed with a numpy copy
of the policy network (a few microseconds, no torch call per pass); other models go
through ``model.predict``. stable-baselines3 (and torch) are imported only to load a
model from its file: this module needs neither otherwise.
"""

from __future__ import annotations


import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from envs import ENV_ID
from envs.actions import FRACTION_LADDER, action_value, pass_budget
from envs.episodes import EpisodeSampler
from envs.errors import ConfigError
from envs.files import load_json
from envs.metrics import SLO
from envs.observation import EARLIER_WIDTHS, OBSERVATION_FIELDS, observe, slo_features
from policies.base import BudgetPolicy, tighter

ALGORITHMS = ("ppo", "dqn", "a2c", "sac")
"""The stable-baselines3 algorithms a run may train with."""


def algorithm_class(algo: str):
    """The stable-baselines3 class of ``algo``."""
    if algo not in ALGORITHMS:
        raise ConfigError(f"algo: got {algo!r}, must be one of {', '.join(ALGORITHMS)}")
    import stable_baselines3  # heavy and optional: only loading or training a model needs it

    return getattr(stable_baselines3, algo.upper())


def load_model(algo: str, path: str | Path, env=None):
    return algorithm_class(algo).load(str(path), env=env)


UNSEEN_VAR = 1e-5
"""An observation entry whose variance in training stayed below this (a standard deviation
of 0.003 on its [0, 1] scale) never varied there: the model cannot have learnt what it
means, and it reads 0 (its training mean) wherever it is served. A model trained on one
deployment thus serves another as it served its own, not on entries pushed to the clip."""


@dataclass(frozen=True)
class ObsNorm:
    """SB3 ``VecNormalize``'s observation statistics: ``clip((obs - mean) / sqrt(var + eps))``,
    0 in the entries that never varied in training (``UNSEEN_VAR``)."""

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
        var = np.asarray(self.var)
        out = (obs - np.asarray(self.mean)) / np.sqrt(var + self.eps)
        return np.where(var < UNSEEN_VAR, 0.0, np.clip(out, -self.clip, self.clip)).astype(np.float32)


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

    def head(self) -> np.ndarray:
        """The action head (the last layer: logits over the actions) as one vector, its
        weights (features x actions) then its biases."""
        w, b, _ = self.layers[-1]
        return np.concatenate([w.ravel(), b.ravel()])

    def with_head(self, theta: np.ndarray) -> "NumpyActor":
        """A copy acting with the action head ``theta`` (:meth:`head`'s layout)."""
        w, b, kind = self.layers[-1]
        return NumpyActor([*self.layers[:-1],
                           (np.asarray(theta[:w.size], w.dtype).reshape(w.shape),
                            np.asarray(theta[w.size:], b.dtype).copy(), kind)])

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

    spec, kind = "model", "learned"
    summary = "a model trained by train.py"

    @classmethod
    def usage(cls) -> str:
        return "model:RUN_DIR"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if not args or not ":".join(args):
            raise ConfigError(f"policy: got {spec!r}, model takes model:RUN_DIR")
        return load_run(":".join(args), scenario.slo(), name=spec)

    def __init__(self, model, slo: SLO, ladder: Sequence[float] = FRACTION_LADDER,
                 action_type: str = "discrete", name: str = "learned", actions: str = "time",
                 obs_norm: ObsNorm | None = None, run_dir: Path | None = None,
                 max_pass: float | None = None):
        self.model, self.slo, self.name = model, slo, name
        self.max_pass = max_pass
        """The longest pass it makes while anyone decodes, in ITL targets: its run's cap
        (``Scenario.max_pass_itl``), or a tighter one it serves under; None: none."""
        self.run_dir = run_dir
        """The train.py run the model comes from (what ``eval export`` turns into a table)."""
        self.ladder, self.action_type, self.actions = tuple(ladder), action_type, actions
        self.obs_norm = obs_norm
        self._slo_obs = slo_features(slo)
        shape = getattr(getattr(model, "observation_space", None), "shape", None)
        self.width = int(shape[0]) if shape else None
        """Entries the model reads: a model trained on an earlier, shorter observation
        vector reads its prefix (``envs.observation.EARLIER_WIDTHS``)."""
        self._actor = NumpyActor.of(model) if action_type == "discrete" else None

    def serving(self) -> tuple[str, str] | None:
        return ("model", str(self.run_dir)) if self.run_dir else None

    @property
    def max_pass_s(self) -> float | None:
        return None if self.max_pass is None else self.max_pass * self.slo.itl_s

    def limit_pass(self, scenario) -> "ModelPolicy":
        """The tighter of its run's cap and ``scenario``'s: a model trained under a cap never
        learned what its actions above it do."""
        self.max_pass = tighter(self.max_pass, scenario.max_pass_itl)
        return self

    def at(self, scenario) -> "ModelPolicy":
        """A copy serving ``scenario``'s SLO pair (what it observes and the ITL target its
        fractions multiply), under the tighter of its cap and the scenario's."""
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)  # not copy.copy: pickling's state drops the model
        out.slo = scenario.slo()
        out._slo_obs = slo_features(out.slo)
        return out.limit_pass(scenario)

    def raw_observation(self, state) -> np.ndarray:
        """The environment's observation of ``state``, the entries the model reads, unnormalised."""
        return observe(state, self.slo, self._slo_obs)[:self.width]

    def observation(self, state) -> np.ndarray:
        obs = self.raw_observation(state)
        return self.obs_norm(obs) if self.obs_norm is not None else obs

    def actions_of(self, raw: np.ndarray) -> np.ndarray:
        """The ladder index the model takes for each row of raw observations."""
        x = self.obs_norm(raw) if self.obs_norm is not None else np.asarray(raw, np.float32)
        if self._actor is not None:
            return np.asarray([self._actor.act(o) for o in x], dtype=np.int64)
        return np.asarray(self.model.predict(x, deterministic=True)[0], dtype=np.int64).reshape(-1)

    def refresh(self) -> None:
        """Act with the model's weights as they are now (after training them in place)."""
        self._actor = NumpyActor.of(self.model) if self.action_type == "discrete" else None

    @property
    def actor(self) -> NumpyActor | None:
        """The numpy actor that serves (None for a continuous action)."""
        return self._actor

    def acting_with(self, actor: NumpyActor) -> "ModelPolicy":
        """A copy served by ``actor`` (its torch model left behind: the numpy actor is what
        acts, and what a worker receives)."""
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)  # not copy.copy: pickling's state drops the model
        out.model, out._actor = None, actor
        return out

    def action(self, state):
        obs = self.observation(state)
        if self._actor is not None:
            return self._actor.act(obs)
        return self.model.predict(obs, deterministic=True)[0]

    def action_value(self, state) -> float:
        """The fraction of the ITL target (or token budget) the model picks in ``state``
        (a fraction no larger than its cap)."""
        value = action_value(self.action(state), self.ladder, self.action_type)
        if self.max_pass is not None and self.actions == "time":
            return min(value, self.max_pass)
        return value

    def budget_for_value(self, state, value: float) -> int:
        return pass_budget(state, self.actions, value, self.slo.itl_s, self.max_pass)

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


# --- train.py run directories --------------------------------------------------------------

def read_config(run_dir: str | Path, field: str = "run_dir") -> dict:
    """A train.py run directory's config.json."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{field}: {str(run_dir)!r} is not a train.py run directory (no config.json)")
    config = load_json(f"{field} config.json", path, max_bytes=64 * 2**20)
    for key in ("args", "scenario", "ladder", "action_type"):
        if not isinstance(config, dict) or key not in config:
            raise ConfigError(f"{field}: {str(path)!r} has no {key!r}; not a train.py run "
                              "directory, or one written by another version")
    conditions = config.get("conditions", [])
    for key, ok in (("args", isinstance(config["args"], dict)),
                    ("scenario", isinstance(config["scenario"], dict)),
                    ("conditions", isinstance(conditions, list)
                     and all(isinstance(c, dict) for c in conditions))):
        if not ok:
            raise ConfigError(f"{field}: {str(path)!r}: {key} must be "
                              f"{'a list of objects' if key == 'conditions' else 'an object'}; "
                              "the file was edited or cut")
    return config


def load_obs_norm(path: Path) -> ObsNorm | None:
    """The observation statistics a VecNormalize pickle holds (None if it has none)."""
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        return ObsNorm.of(pickle.load(fh))


def check_observations(model, run: Path, resuming: bool = False) -> None:
    """A model trained on another version's observation vector is refused in one line. An
    earlier vector that is a prefix of this one serves (the model reads its prefix), but
    training goes on only with the vector it started with."""
    got = model.observation_space.shape[0] if model.observation_space.shape else 0
    if got != len(OBSERVATION_FIELDS) and (resuming or got not in EARLIER_WIDTHS):
        raise ConfigError(f"model: {str(run)!r} was trained on {got} observations, {ENV_ID} has "
                          f"{len(OBSERVATION_FIELDS)}; train it again with this version")


def load_run(run_dir: str | Path, slo=None, name: str | None = None) -> ModelPolicy:
    """The policy of a train.py run directory: its best model when it kept one (with the
    observation statistics saved with it), else its final model."""
    run = Path(run_dir)
    config = read_config(run, "model")
    best = run / "best_model.zip"
    model_path, norm = (best, run / "best_vecnormalize.pkl") if best.exists() else (
        run / "model.zip", run / "vecnormalize.pkl")
    if not model_path.exists():
        raise ConfigError(f"model: no model.zip in {str(run)!r}; is training finished?")
    if slo is None:
        sc = config["scenario"]
        slo = SLO(sc["slo_ttft_s"], sc["slo_itl_s"])
    model = load_model(config["args"]["algo"], model_path)
    check_observations(model, run)
    policy = ModelPolicy(model, slo, tuple(config["ladder"]),
                         config["action_type"], name=name or f"model:{run}",
                         actions=config.get("actions", "tokens"), obs_norm=load_obs_norm(norm),
                         run_dir=run, max_pass=config["scenario"].get("max_pass_itl"))
    policy.config = config
    return policy


def run_sampler(run_args, conditions, stream_seed_base: int = 0) -> EpisodeSampler:
    """A run's episode sampler: its conditions, loaded at ``load_low``-``load_high`` times
    their capacity for ``episode_s`` seconds (``run_args``: train.py's Args, or the dict a
    run's config.json holds of them)."""
    get = run_args.get if isinstance(run_args, dict) else (lambda k: getattr(run_args, k))
    return EpisodeSampler(load_range=(get("load_low"), get("load_high")), episode_s=get("episode_s"),
                          conditions=tuple(conditions), stream_seed_base=stream_seed_base)
