"""Test factories: a toy accelerator and model with round numbers, and tiny simulators."""

from __future__ import annotations

import pytest

from envs.engine import EngineConfig, Simulator
from envs.profiles import HardwareProfile, ModelProfile
from envs.workload import Workload

# Round numbers so roofline cases can be worked out by hand:
#   1 TB/s, 100 TFLOP/s, 1 ms per pass; 1e9 params in bf16 (2 GB of weights);
#   KV bytes/token = 2 * 2 layers * 2 kv heads * 16 dims * 2 bytes = 256;
#   attention FLOPs per (query, key) pair = 4 * 2 layers * 4 heads * 16 dims = 512.
TOY_HW = HardwareProfile(name="toy", hbm_bytes_per_s=1e12, peak_flops_per_s=1e14,
                         memory_bytes=4e9, bandwidth_fraction=1.0, flops_fraction=1.0,
                         per_pass_overhead_s=0.001)
TOY_MODEL = ModelProfile(name="toy-1b", layers=2, hidden_size=64, heads=4, kv_heads=2,
                         head_dim=16, params=1e9)


def make_sim(requests, budget_blocks=None, hardware=TOY_HW, model=TOY_MODEL, **config) -> Simulator:
    """A simulator over ``requests`` = [(arrival_s, prompt_tokens, output_tokens), ...]."""
    arr, prm, out = zip(*requests) if requests else ((), (), ())
    cfg = EngineConfig(num_kv_blocks=budget_blocks, **config)
    return Simulator(hardware, model, Workload.from_arrays(arr, prm, out), cfg, record_shapes=True)


@pytest.fixture
def toy():
    return TOY_HW, TOY_MODEL


def call(main, *argv) -> tuple[int, str, str]:
    """Run a command line's ``main(argv)`` in this process, as ``python -m ...`` would:
    (exit code, stdout, stderr)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from envs.errors import cli_main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(main, [str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


COMMANDS = {"envs.probe": "envs.probe", "envs.simulate": "envs.simulate",
            "envs.calibrate": "envs.calibrate.__main__", "eval": "eval.__main__", "train.py": "train",
            "policies.table": "policies.table.__main__", "agents.improve": "agents.improve",
            "agents.search": "agents.search"}


def slack_run(policy, hardware="a100-80g", rate: float = 1.0):
    """A bursty stream of long prompts (gamma arrivals, shape 0.5) at an A100's load, SLO
    2 s / 100 ms, served by ``policy`` on ``hardware`` (a preset's name or a profile): its
    summary and its share of decode tokens over the ITL target."""
    from envs.scenario import Scenario

    sc = Scenario(hardware=hardware, model="llama-3-8b", rate=rate, num_requests=300,
                  arrival="gamma", burstiness=0.5, slo_ttft_s=2.0, slo_itl_s=0.1)
    sim = sc.simulator(sc.arrivals(3))
    summary = sim.run(policy).summary(sc.slo())
    slow, _ = sim.log.tokens_over_since(0, 0.1)
    tokens, _ = sim.log.tokens_over_since(0, -1.0)
    return summary, slow / tokens


def cli(command: str, *argv):
    """``python -m command argv...`` (or ``python train.py``) run in this process; the result
    has ``returncode``, ``stdout`` and ``stderr`` like ``subprocess.run``'s."""
    import importlib
    from types import SimpleNamespace

    main = importlib.import_module(COMMANDS[command]).main
    code, out, err = call(main, *argv)
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def refused_in_one_line(proc, needle: str) -> None:
    """A command refused before any work: exit 2, nothing on stdout, one line on stderr
    holding ``needle``."""
    assert proc.returncode == 2 and not proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.fixture(scope="module")
def tiny_ppo():
    """A small PPO model on the environment, its VecNormalize and the policy it serves (at an
    A100's SLO of 1 s / 50 ms)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from envs.scenario import Scenario
    from policies.learned import ModelPolicy, ObsNorm

    venv = VecNormalize(DummyVecEnv([lambda: ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30))]),
                        norm_obs=True, norm_reward=True)
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, verbose=0)
    model.learn(128)
    slo = Scenario(hardware="a100-80g", model="llama-3-8b", slo_ttft_s=1.0, slo_itl_s=0.05).slo()
    return model, venv, ModelPolicy(model, slo, obs_norm=ObsNorm.of(venv))


@pytest.fixture
def drawn(monkeypatch):
    """What every figure eval.plots saves shows, read back from its matplotlib objects
    before it is written: [(file name, {"legends", "labels", "suptitle"})]."""
    from eval import plots

    kept = []
    save = plots._save

    def keep(fig, path):
        kept.append((path.name, fig))
        fig.canvas.draw()  # lay it out as saving would, so texts are final
        legends = [[t.get_text() for t in (ax.get_legend().get_texts() if ax.get_legend() else [])]
                   for ax in fig.axes]
        labels = [(ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) for ax in fig.axes]
        kept[-1] = (path.name, {"legends": legends, "labels": labels, "suptitle":
                                fig._suptitle.get_text() if fig._suptitle else ""})
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return kept
