"""train.py end to end: a smoke run of a few hundred steps, and the resume path (marked slow:
``python -m pytest -m slow``), and its bad options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--n-envs", "2", "--n-steps", "64", "--episode-requests", "40", "--eval-every", "128", "--eval-requests", "60",
        "--eval-seeds", "1", "--final-eval-requests", "80", "--final-eval-seeds", "1",
        "--checkpoint-every", "128", "--static-budgets", "512,8192", "--no-progress-bar"]


def train(*args):
    out = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_smoke_run_writes_a_complete_run_directory(tmp_path, algo):
    run = tmp_path / algo
    out = train("--algo", algo, "--total-timesteps", "256", "--run-dir", str(run), *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("model.zip", "vecnormalize.pkl", "config.json", "summary.md", "summary.json"):
        assert (run / name).is_file(), name
    assert list((run / "checkpoints").glob("ckpt_*_steps.zip"))
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["timesteps"] >= 256
    assert set(summary["results"]) == {f"learned ({algo})", "vllm-default:8192", "static:512",
                                       "static:8192"}
    assert "vLLM's default" in summary["verdict"]
    config = json.loads((run / "config.json").read_text())
    assert config["args"]["algo"] == algo and config["scenario"]["hardware"] == "h100-sxm"


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(tmp_path):
    run = tmp_path / "r"
    first = train("--total-timesteps", "256", "--run-dir", str(run), *TINY)
    assert first.returncode == 0, first.stderr[-2000:]
    second = train("--total-timesteps", "512", "--resume", str(run), *TINY)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from" in second.stdout
    resumed_at = int(second.stdout.split("timesteps")[0].rsplit(" at ", 1)[1])
    assert resumed_at == 256
    summary = json.loads((run / "summary.json").read_text())
    assert summary["timesteps"] == 512
    # The TensorBoard curve continues (one run folder, not a fresh one from step 0).
    assert len(list((run / "tensorboard").iterdir())) == 1


def test_bad_options_are_one_line_errors(tmp_path):
    from tests.conftest import cli

    out = cli("train.py", "--total-timesteps", "0", "--run-dir", str(tmp_path / "x"))
    assert out.returncode == 2 and "total_timesteps: got 0" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("train.py", "--resume", str(tmp_path / "nothing-here"))
    assert out.returncode == 2 and "resume: no checkpoint" in out.stderr
    out = cli("train.py", "--workload", "nope")
    assert out.returncode == 2 and "workload: unknown name 'nope'" in out.stderr
