"""Training runs on disk: their checkpoints, their config, and the trained policy."""

from __future__ import annotations

from pathlib import Path

from envs.errors import ConfigError


def checkpoints(path: Path) -> list[Path]:
    """Checkpoints in ``path``/checkpoints (or ``path`` itself), oldest first."""
    if path.suffix == ".zip":
        return [path] if path.exists() else []
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [p for p in folder.glob("ckpt_*_steps.zip") if p.stem.split("_")[-2].isdigit()]
    return sorted(found, key=lambda p: int(p.stem.split("_")[-2]))


def latest_checkpoint(path: Path) -> Path | None:
    """The checkpoint with the most timesteps in ``path``/checkpoints (or ``path`` itself)."""
    found = checkpoints(path)
    return found[-1] if found else None


def norm_path_of(checkpoint: Path) -> Path:
    """The VecNormalize statistics saved with a checkpoint."""
    return checkpoint.with_name(checkpoint.name.replace("ckpt_", "ckpt_vecnormalize_")
                                .replace(".zip", ".pkl"))


def read_config(run_dir: str | Path, field: str = "run_dir") -> dict:
    """A train.py run directory's config.json."""
    from envs.files import load_json

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


def load_obs_norm(path: Path):
    """The observation statistics a VecNormalize pickle holds (None if it has none)."""
    import pickle

    from policies.learned import ObsNorm

    if not path.exists():
        return None
    with open(path, "rb") as fh:
        return ObsNorm.of(pickle.load(fh))


def check_observations(model, run: Path, resuming: bool = False) -> None:
    """A model trained on another version's observation vector is refused in one line. An
    earlier vector that is a prefix of this one serves (the model reads its prefix), but
    training goes on only with the vector it started with."""
    from envs import ENV_ID
    from envs.observation import EARLIER_WIDTHS, OBSERVATION_FIELDS

    got = model.observation_space.shape[0] if model.observation_space.shape else 0
    if got != len(OBSERVATION_FIELDS) and (resuming or got not in EARLIER_WIDTHS):
        raise ConfigError(f"model: {str(run)!r} was trained on {got} observations, {ENV_ID} has "
                          f"{len(OBSERVATION_FIELDS)}; train it again with this version")


def load_run(run_dir: str | Path, slo=None, name: str | None = None):
    """The policy of a train.py run directory: its best model when it kept one (with the
    observation statistics saved with it), else its final model."""
    from agents.setup import load_model
    from envs.metrics import SLO
    from policies.learned import ModelPolicy

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
                         actions=config.get("actions", "tokens"), obs_norm=load_obs_norm(norm))
    policy.config = config
    return policy
