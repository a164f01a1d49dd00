"""Training runs on disk: their checkpoints, their config, and the trained policy."""

from __future__ import annotations

import json
from pathlib import Path

from envs.errors import ConfigError


def latest_checkpoint(path: Path) -> Path | None:
    """The checkpoint with the most timesteps in ``path``/checkpoints (or ``path`` itself)."""
    if path.suffix == ".zip":
        return path if path.exists() else None
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = sorted(folder.glob("ckpt_*_steps.zip"), key=lambda p: int(p.stem.split("_")[-2]))
    return found[-1] if found else None


def read_config(run_dir: str | Path) -> dict:
    """A train.py run directory's config.json."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model: {str(run_dir)!r} is not a train.py run directory (no config.json)")
    return json.loads(path.read_text())


def load_run(run_dir: str | Path, slo=None, name: str | None = None):
    """The policy of a train.py run directory (its best model when it kept one)."""
    from agents.setup import load_model
    from envs.metrics import SLO
    from policies.learned import ModelPolicy

    run = Path(run_dir)
    config = read_config(run)
    model_path = run / "best_model.zip" if (run / "best_model.zip").exists() else run / "model.zip"
    if not model_path.exists():
        raise ConfigError(f"model: no model.zip in {str(run)!r}; is training finished?")
    if slo is None:
        sc = config["scenario"]
        slo = SLO(sc["slo_ttft_s"], sc["slo_itl_s"])
    policy = ModelPolicy(load_model(config["args"]["algo"], model_path), slo, tuple(config["ladder"]),
                         config["action_type"], name=name or f"model:{run}")
    policy.config = config
    return policy
