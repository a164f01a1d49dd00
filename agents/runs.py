"""Training runs on disk: their checkpoints (the run's config and trained policy are read by
``policies.learned``: read_config, load_run)."""

from __future__ import annotations

from pathlib import Path


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
