"""The training loop's parts: environments, the model (fresh or resumed), checkpoints that
count only trained steps, and the run directory on disk."""

from __future__ import annotations

import pickle
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import gymnasium as gym
from stable_baselines3.common import callbacks
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ProgressBarCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.utils import configure_logger
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize
from tqdm import TqdmExperimentalWarning

import envs
from agents.callbacks import save_model
from agents.runs import checkpoints, norm_path_of
from envs.errors import ConfigError
from policies.learned import load_model


def make_vec_env(scenario, sampler, actions: str, action_type: str, n_envs: int, seed: int,
                 vec_env: str = "dummy", decision_interval_s: float | None = None):
    def factory(rank: int):
        def make():
            if vec_env == "subproc":
                ignore_stop_signals()
            env = gym.make(envs.ENV_ID, scenario=scenario, sampler=sampler, actions=actions,
                           action_type=action_type, decision_interval_s=decision_interval_s)
            env.reset(seed=seed * 1000 + rank)
            return Monitor(env)
        return make

    cls = SubprocVecEnv if vec_env == "subproc" else DummyVecEnv
    return cls([factory(i) for i in range(n_envs)])


class TrainedSteps(BaseCallback):
    """Steps whose experience has been learned from: the count at the start of each
    rollout (PPO and A2C learn between rollouts; DQN and SAC every few steps, so for them
    the count at the latest rollout start is within one ``train_freq``). A checkpoint
    written after an interruption carries this count, not the steps collected since."""

    def __init__(self):
        super().__init__()
        self.trained = 0

    def _on_rollout_start(self) -> None:
        self.trained = self.num_timesteps

    def _on_step(self) -> bool:
        return True


class Checkpoints(BaseCallback):
    """A checkpoint (model + VecNormalize statistics) every ``every`` steps, each file
    written whole or not at all, at the start of a rollout (when everything collected so
    far has been learned from)."""

    def __init__(self, folder: Path, every: int, trained: TrainedSteps):
        super().__init__()
        self.folder, self.every, self.trained = folder, every, trained
        self._last = 0

    def _on_training_start(self) -> None:
        self._last = self.num_timesteps

    def _on_rollout_start(self) -> None:
        if self.num_timesteps - self._last >= self.every:
            self._last = self.num_timesteps
            write_checkpoint(self.model, self.folder, self.num_timesteps)

    def _on_step(self) -> bool:
        return True


def write_checkpoint(model, folder: Path, steps: int) -> Path:
    path = folder / f"ckpt_{steps}_steps.zip"
    save_model(model, path, norm_path_of(path))
    return path


def resumable_checkpoint(run: Path, algo: str):
    """(the newest checkpoint that loads with its VecNormalize statistics, the model loaded
    from it, those statistics): a checkpoint cut short by a kill, or whose statistics are
    missing, cut short or not VecNormalize's (a model resumed on fresh statistics would see
    other inputs), is skipped with a warning for the one before it."""
    def skip(ckpt: Path, what: str, err: Exception) -> None:
        print(f"warning: checkpoint {ckpt.name}: {what} cannot be loaded ({type(err).__name__}); "
              "trying the one before it", file=sys.stderr)

    for ckpt in reversed(checkpoints(run)):
        norm = norm_path_of(ckpt)
        try:  # the statistics first: a small file, read before the model's zip
            with open(norm, "rb") as f:
                stats = pickle.load(f)
            if not isinstance(stats, VecNormalize):
                raise TypeError(f"holds a {type(stats).__name__}")
        except Exception as err:  # missing, cut short or foreign: any of the file's or pickle's errors
            skip(ckpt, f"its statistics {norm.name}", err)
            continue
        try:
            model = load_model(algo, ckpt)
        except Exception as err:  # a truncated or foreign zip: any of zipfile's or SB3's errors
            skip(ckpt, "the model", err)
            continue
        return ckpt, model, stats
    raise ConfigError(f"resume: no loadable checkpoint (ckpt_*_steps.zip with its "
                      f"ckpt_vecnormalize_*_steps.pkl) in {str(run)!r}")


def attach_env(model, venv, stats, tb_dir: str):
    """A resumed model on fresh environments, normalised by the statistics saved with its
    checkpoint (``VecNormalize.load`` does the same: the unpickled wrapper on new envs)."""
    stats.set_venv(venv)
    model.set_env(stats)
    model.tensorboard_log = tb_dir
    return model, stats


class StopOnSignal(BaseCallback):
    """Ends learning at the next environment step after SIGINT or SIGTERM (a Ctrl-C, a job
    scheduler's stop), wherever the signal lands: the handler only sets a flag, and SB3
    stops when a callback's step returns False. A second signal raises KeyboardInterrupt
    at once, for a run that must not wait for its current step."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self):
        super().__init__()
        self.signum: int | None = None
        self._previous: dict = {}

    def _on_step(self) -> bool:
        return self.signum is None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def install(self) -> None:
        """Take over the signals (only the main thread may; elsewhere they stay as they are),
        but not one the process was started ignoring (``nohup``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class UntilStopped(CallbackList):
    """Callbacks called in order at each step until one asks to stop (SB3's CallbackList
    calls every one, so a stop signal landing on an evaluation step would wait for it)."""

    def _on_step(self) -> bool:
        return all(callback.on_step() for callback in self.callbacks)


class RunProgressBar(ProgressBarCallback):
    """SB3's progress bar over the run's whole count: a resumed run's starts at the steps it
    kept (75,000/150,000) instead of counting the rest from zero."""

    def _on_training_start(self) -> None:
        with warnings.catch_warnings():  # tqdm.rich's "experimental" warning (SB3 filters it too)
            warnings.simplefilter("ignore", TqdmExperimentalWarning)
            # learn(reset_num_timesteps=False) has already added the kept steps to the total.
            self.pbar = callbacks.tqdm(total=self.locals["total_timesteps"],
                                       initial=self.model.num_timesteps)


def ignore_stop_signals() -> None:
    """In an environment worker process (``--vec-env subproc``): leave SIGINT and SIGTERM
    to the main process, which stops at its next step and closes the workers; a worker
    that broke off at a Ctrl-C sent to the whole process group would leave the main
    process's next step a broken pipe instead."""
    for name in StopOnSignal.SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def learn(model, total: int, callbacks, progress_bar: bool, resumed: bool,
          trained: TrainedSteps) -> tuple[float, int | None]:
    """Learn up to ``total`` timesteps; (seconds, the signal that stopped it or None). On
    an interruption the model's count is set back to the steps actually learned from."""
    remaining = max(total - model.num_timesteps, 0)
    t0 = time.perf_counter()
    if not remaining:
        # Trained in full but stopped before its summary: the final evaluation still
        # logs, into the run's last TensorBoard folder.
        model.set_logger(configure_logger(0, model.tensorboard_log, "run", reset_num_timesteps=False))
        return 0.0, None
    trained.trained = model.num_timesteps
    stop = StopOnSignal()
    stop.install()
    try:
        bar = [RunProgressBar()] if progress_bar else []
        model.learn(remaining, callback=CallbackList([UntilStopped([trained, stop, *callbacks]), *bar]),
                    reset_num_timesteps=not resumed, tb_log_name="run")
    except KeyboardInterrupt:
        stop.signum = stop.signum or signal.SIGINT
    finally:
        stop.restore()
    if stop.signum is not None:
        model.num_timesteps = trained.trained
    return time.perf_counter() - t0, stop.signum


def close_logger(model, timeout_s: float = 10.0) -> None:
    """Flush and close the model's TensorBoard writer (it flushes on close or every two
    minutes: a short run's curves would otherwise never reach the disk). An interrupt
    that landed inside the writer's queue can leave its lock held, so the close runs in
    a daemon thread and is abandoned after ``timeout_s`` rather than hanging the exit."""
    logger = getattr(model, "_logger", None)
    if logger is None:
        return
    closer = threading.Thread(target=logger.close, daemon=True)
    closer.start()
    closer.join(timeout_s)
