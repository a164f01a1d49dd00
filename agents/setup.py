"""Algorithm setups: which SB3 class, which action space, which hyperparameters.

Everything goes through SB3's documented constructor arguments and
``policy_kwargs``; nothing is patched.
"""

from __future__ import annotations

from pathlib import Path

from envs.errors import ConfigError

# Action space each algorithm trains on: SAC needs a continuous one.
ACTION_TYPES = {"ppo": "discrete", "dqn": "discrete", "a2c": "discrete", "sac": "continuous"}


def algorithm_class(algo: str):
    from stable_baselines3 import A2C, DQN, PPO, SAC

    classes = {"ppo": PPO, "dqn": DQN, "a2c": A2C, "sac": SAC}
    if algo not in classes:
        raise ConfigError(f"algo: got {algo!r}, must be one of {', '.join(classes)}")
    return classes[algo]


def hyperparameters(algo: str, n_envs: int, learning_rate: float | None, gamma: float,
                    net_arch: tuple[int, ...], n_steps: int | None = None) -> dict:
    """Defaults tuned for this environment: short decisions (tens of ms of simulated
    time each) whose consequences play out over a few hundred passes."""
    kw: dict = {"gamma": gamma, "policy_kwargs": {"net_arch": list(net_arch)}}
    if algo == "ppo":
        kw.update(n_steps=n_steps or max(2048 // n_envs, 64), batch_size=256, n_epochs=5, gae_lambda=0.95,
                  ent_coef=0.01, clip_range=0.2, learning_rate=learning_rate or 3e-4)
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


def load_model(algo: str, path: str | Path, env=None):
    return algorithm_class(algo).load(str(path), env=env)
