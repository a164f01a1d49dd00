"""The serving runtime installs into a vLLM environment without a training package."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ("gymnasium", "stable_baselines3", "tensorboard", "matplotlib", "hypothesis")

CHECK = """
import importlib.metadata as md, json, sys
(ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "chunkpilot"]
import policies.vllm_scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
print(json.dumps({"entry_point": ep.value, "scheduler": policies.vllm_scheduler.__file__,
                  "wrapped": hasattr(EngineArgs.create_engine_config, "__wrapped__"),
                  "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_no_deps_install_adds_only_chunkpilot_and_its_vllm_plugin(tmp_path):
    import json

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "train.py"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("envs", "agents", "policies", "eval"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    # What docs/serving.md says, into a folder of its own so that the test sees what it adds
    # (offline: no dependency, and the environment's own setuptools builds it).
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    added = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    assert added == ["agents", "chunkpilot-0.1.0.dist-info", "envs", "eval", "policies",
                     "train.py"]
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin",
                                            "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["entry_point"] == "policies.vllm_startup:register"
    assert seen["scheduler"].startswith(str(site))  # the installed copy, not the checkout
    assert seen["wrapped"]  # vLLM's own plug-in loader ran chunkpilot's check hook
    assert not set(TRAINING) & set(seen["modules"])
