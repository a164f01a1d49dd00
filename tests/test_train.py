"""train.py end to end (marked slow: ``python -m pytest -m slow``): a smoke run of a few
hundred steps per algorithm, resume after a finished run, an interruption and a corrupt
checkpoint; and its bad options (fast, in-process)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli, refused_in_one_line

ROOT = Path(__file__).parent.parent
TINY = ["--n-envs", "2", "--n-steps", "64", "--conditions", "4", "--episode-s", "10", "--clone-decisions", "512",
        "--eval-every", "128", "--eval-episodes", "2", "--final-seeds", "2", "--final-requests", "60",
        "--checkpoint-every", "128", "--workers", "1", "--no-progress-bar", "--no-checks"]


def train(*args, **kwargs):
    return subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, **kwargs)


def trained_steps(run: Path) -> int:
    return json.loads((run / "summary.json").read_text())["timesteps"]


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
    assert summary["timesteps"] == 256
    assert set(summary["capacity"]) == {"serving", "+3 ms per pass", "tight KV cache"}
    for study in summary["capacity"].values():
        assert study["_hindsight_static"]["budget"] > 0
        assert {f"model:{run}", "time-budget"} <= set(study)  # the learned policy, by its spec
        assert study[f"model:{run}"]["kind"] == "learned"
    assert "Job 1" in (run / "summary.md").read_text()
    config = json.loads((run / "config.json").read_text())
    assert config["args"]["algo"] == algo and config["scenario"]["hardware"] == "h100-sxm"
    assert all(c["capacity_rps"] > 0 for c in config["conditions"])


@pytest.mark.slow
def test_a_trained_run_exports_a_table_the_runtime_accepts(tmp_path):
    """The export end to end on a tiny run: DAgger rounds, the round kept, the fidelity at
    capacity and at load, and a table that ``python -m policies.table check`` accepts for
    the run's hardware and model."""
    run = tmp_path / "run"
    out = train("--total-timesteps", "128", "--run-dir", str(run), *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    table = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-m", "eval", "export", str(run), "--out", str(table),
                          "--csv", str(tmp_path / "t.csv"), "--build-episodes", "2", "--held-episodes", "1",
                          "--fidelity-seeds", "2", "--fidelity-requests", "60", "--workers", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(table.read_text())
    dagger = data["provenance"]["dagger"]
    labels = ["round 0", "round 1", "round 2", "time-budget-deadline:4", "time-budget-deadline:16",
              "time-budget-deadline-kv:4", "time-budget-deadline-kv:16", "time-budget-slack:7"]
    assert dagger["rounds"] == 2 and dagger["candidates"] == labels and dagger["chosen"] in range(8)
    assert len(dagger["capacity_kept"]) == 8
    assert "goodput_kept" not in dagger or len(dagger["goodput_kept"]) == 8
    assert dagger["streams"] > 0
    assert f"kept: the table of {labels[dagger['chosen']]} among round 0" in out.stdout
    fid = data["fidelity"]
    assert set(fid["capacity"]) == set(fid["goodput"]) == {"serving", "+3 ms per pass", "tight KV cache"}
    assert (fid["build_decisions"] > 0) == (dagger["chosen"] < 3) and 0 <= fid["agreement"] <= 1
    assert ("at its capacity on" in out.stdout) == bool(fid["at_capacity"].get("passes"))
    assert ("what its cells are worth" in out.stdout) == bool(fid["against_flat"])
    check = subprocess.run([sys.executable, "-m", "policies.table", "check", str(table),
                            "--hardware", "h100-sxm", "--model", "llama-3-8b"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_resume_continues_and_refuses_a_conflicting_flag(tmp_path):
    run = tmp_path / "r"
    first = train("--total-timesteps", "256", "--run-dir", str(run), *TINY)
    assert first.returncode == 0, first.stderr[-2000:]
    again = train("--resume", str(run), "--total-timesteps", "256", "--no-progress-bar")
    assert again.returncode == 0 and "already trained 256 of 256" in again.stdout
    conflict = train("--resume", str(run), "--algo", "dqn", "--total-timesteps", "512")
    assert conflict.returncode == 2 and "algo: got 'dqn'" in conflict.stderr
    second = train("--resume", str(run), "--total-timesteps", "512", "--no-progress-bar")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from" in second.stdout and trained_steps(run) == 512
    # The run's own settings came from its config, not from train.py's defaults.
    assert json.loads((run / "config.json").read_text())["args"]["conditions"] == 4
    assert len(list((run / "tensorboard").iterdir())) == 1  # one curve, continued
    # Killed after its last step, before the summary: the resume writes the summary.
    (run / "summary.md").unlink()
    (run / "summary.json").unlink()
    finish = train("--resume", str(run), "--total-timesteps", "512", "--no-progress-bar")
    assert finish.returncode == 0, finish.stderr[-2000:]
    assert trained_steps(run) == 512 and (run / "summary.md").exists()
    assert len(list((run / "tensorboard").iterdir())) == 1


def test_resume_skips_a_checkpoint_whose_statistics_are_missing_or_cut_short(tmp_path, monkeypatch, capsys):
    """The newest checkpoint's VecNormalize file emptied, the one before it missing, the
    one before that foreign: the resume falls back to the oldest whole pair, warning
    about each checkpoint it skips, and returns its statistics; with none left it is one
    line."""
    import pickle

    import gymnasium as gym
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    import agents.training
    from agents.training import resumable_checkpoint
    from envs.errors import ConfigError

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for steps in (128, 256, 384, 512):
        (folder / f"ckpt_{steps}_steps.zip").write_bytes(b"zip")
    stats = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]))
    stats.save(str(folder / "ckpt_vecnormalize_128_steps.pkl"))
    (folder / "ckpt_vecnormalize_256_steps.pkl").write_bytes(pickle.dumps({"obs_rms": None}))
    (folder / "ckpt_vecnormalize_512_steps.pkl").write_bytes(b"")
    monkeypatch.setattr(agents.training, "load_model", lambda algo, path: f"model from {path.name}")
    ckpt, model, found = resumable_checkpoint(tmp_path, "ppo")
    assert ckpt.name == "ckpt_128_steps.zip" and model == "model from ckpt_128_steps.zip"
    assert isinstance(found, VecNormalize) and found.clip_obs == stats.clip_obs
    err = capsys.readouterr().err
    assert ("checkpoint ckpt_512_steps.zip: its statistics ckpt_vecnormalize_512_steps.pkl cannot "
            "be loaded (EOFError)") in err
    assert "ckpt_vecnormalize_384_steps.pkl cannot be loaded (FileNotFoundError)" in err
    assert "ckpt_vecnormalize_256_steps.pkl cannot be loaded (TypeError)" in err
    (folder / "ckpt_vecnormalize_128_steps.pkl").unlink()
    with pytest.raises(ConfigError, match="no loadable checkpoint"):
        resumable_checkpoint(tmp_path, "ppo")


def test_resume_keeps_the_run_s_own_values_and_refuses_any_flag_that_differs(tmp_path):
    """A flag is refused when it differs from the run's value even where it equals the
    default (--conditions 32, --n-envs 8); the run's checkpoint and
    evaluation periods and its total are kept unless the command line sets them."""
    import train
    from envs.cli import parse
    from envs.errors import ConfigError

    saved = {**asdict(train.Args()), "n_envs": 2, "conditions": 4, "checkpoint_every": 256,
             "eval_every": 256, "total_timesteps": 1024}
    (tmp_path / "config.json").write_text(json.dumps({"args": saved, "scenario": {}, "ladder": [],
                                                      "action_type": "discrete"}))

    def resumed(*flags):
        argv = ["--resume", str(tmp_path), *flags]
        return train.resumed_args(parse(train.Args, argv), argv)[0]

    for flags, name in ((("--conditions", "32"), "conditions"), (("--n-envs", "8"), "n_envs"),
                        (("--run-dir", str(tmp_path / "elsewhere")), "run_dir"),
                        (("--conditions=31",), "conditions")):
        with pytest.raises(ConfigError, match=f"^{name}: got .*(trained with|not used with --resume)"):
            resumed(*flags)
    with pytest.raises(ConfigError, match="unrecognized arguments: --n-env 8; did you mean --n-envs"):
        resumed("--n-env", "8")  # flags are taken whole
    kept = resumed("--conditions", "4")
    assert (kept.n_envs, kept.conditions, kept.checkpoint_every, kept.eval_every,
            kept.total_timesteps, kept.resume) == (2, 4, 256, 256, 1024, str(tmp_path))
    more = resumed("--total-timesteps", "2048", "--checkpoint-every", "512")
    assert (more.total_timesteps, more.checkpoint_every, more.eval_every) == (2048, 512, 256)
    # ...and become the run's own: the bare resume an interrupted run suggests goes on to them.
    again = resumed()
    assert (again.total_timesteps, again.checkpoint_every) == (2048, 512)
    assert json.loads((tmp_path / "config.json").read_text())["args"]["total_timesteps"] == 2048
    # A run from before --teacher existed resumes as it was trained: the checks' pick.
    old = json.loads((tmp_path / "config.json").read_text())
    del old["args"]["teacher"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert resumed().teacher is None
    # One from before --teacher-streams and --teacher-tie picked its teachers on 2 streams, 2%.
    for name in ("teacher_streams", "teacher_tie"):
        del old["args"][name]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert (resumed().teacher_streams, resumed().teacher_tie) == (2, 0.02)
    with pytest.raises(ConfigError, match="^teacher: got 'time-budget-deadline', but the run being resumed was trained without --teacher;"):
        resumed("--teacher", "time-budget-deadline")
    # A config.json that parses but was edited or cut is one line, not a traceback.
    good = json.loads((tmp_path / "config.json").read_text())
    for change, needle in (({"args": {k: v for k, v in saved.items() if k != "n_envs"}},
                            "has no 'n_envs' in its args"),
                           ({"args": []}, "args must be an object"),
                           ({"conditions": "x"}, "conditions must be a list of objects")):
        (tmp_path / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=needle):
            resumed()


def test_dropped_training_conditions_are_said(monkeypatch, capsys):
    import agents.conditions
    import train

    args = train.Args(conditions=3)
    drawn = agents.conditions.draw_conditions(args.scenario(), 3, args.seed)
    monkeypatch.setattr(train, "with_capacities", lambda sc, conds, **kw: conds[:1])
    assert train.draw_training_conditions(args, args.scenario(), None) == drawn[:1]
    assert "dropped 2 of 3 conditions: under" in capsys.readouterr().out
    monkeypatch.setattr(train, "with_capacities", lambda sc, conds, **kw: [])
    assert train.draw_training_conditions(args, args.scenario(), None) == []
    assert "dropped 3 of 3 conditions" in (out := capsys.readouterr().out)
    assert "training on the scenario alone, at its own load" in out


def test_a_resume_from_an_older_checkpoint_evaluates_the_steps_it_learns_again(tmp_path, monkeypatch):
    """best.json says the abandoned line evaluated at 1,024 steps; resumed from 768, the
    next evaluation is due from 768, and the best cost found so far is kept."""
    import agents.checks
    import train

    history = [{"timesteps": t, "cost": 2.0} for t in (0, 512, 1024)]
    (tmp_path / "best.json").write_text(json.dumps({"cost": 1.5, "last_eval": 1024, "history": history}))
    monkeypatch.setattr(agents.checks, "draw_episodes", lambda *a, **k: [])
    monkeypatch.setattr(agents.checks, "constant_costs", lambda eps, names, **k: {names[0]: np.zeros(1)})
    config = {"conditions": [], "checks": {"best_constant": "time-budget:1"}, "ladder": [1.0], "actions": "time",
              "action_type": "discrete"}
    args = train.Args()
    back = train.evaluator(args, config, args.scenario(), tmp_path, timesteps=768)
    assert (back._last, back.best) == (768, 1.5)
    assert [h["timesteps"] for h in back.history] == [0, 512]  # summary.json's whole history
    ahead = train.evaluator(args, config, args.scenario(), tmp_path, timesteps=2048)
    assert ahead._last == 1024 and ahead.history == history
    # A damaged best.json holds no model: a fresh start of the evaluation, with a warning.
    for text in ("{cut", "[1, 2]", '{"cost": "x"}'):
        (tmp_path / "best.json").write_text(text)
        fresh = train.evaluator(args, config, args.scenario(), tmp_path, timesteps=768)
        assert (fresh._last, fresh.best, fresh.history) == (0, float("inf"), [])


def test_the_summary_s_speed_is_that_of_the_steps_learned_in_this_session():
    from train import training_speed

    assert training_speed(150_000, 150_000, 50.0) == "150,000 timesteps trained in 50 s (3,000 steps/s)"
    assert training_speed(150_000, 50_000, 25.0) == ("150,000 timesteps, 50,000 of them trained since "
                                                     "the resume at 100,000 in 25 s (2,000 steps/s)")
    assert training_speed(150_000, 0, 0.0) == "150,000 timesteps, trained before this resume"
    assert training_speed(2_048, 2_048, 2.0, total=1_024) == (
        "2,048 timesteps (--total-timesteps 1,024, reached within the last rollout) trained in 2 s "
        "(1,024 steps/s)")
    assert training_speed(1_024, 1_024, 2.0, total=1_024) == "1,024 timesteps trained in 2 s (512 steps/s)"


def test_a_resumed_run_s_progress_bar_counts_from_the_steps_it_kept():
    from types import SimpleNamespace

    from agents.training import RunProgressBar

    bar = RunProgressBar()
    bar.locals, bar.model = {"total_timesteps": 300}, SimpleNamespace(num_timesteps=100)
    bar._on_training_start()
    try:
        assert (bar.pbar.total, bar.pbar.n) == (300, 100)
    finally:
        bar.pbar.close()
    # learn() hands SB3 this bar (not SB3's own, which counts the rest from zero) and keeps
    # the count on a resume.
    from agents.training import TrainedSteps, learn

    seen = {}

    class Fake:
        num_timesteps = 100

        def learn(self, steps, **kw):
            seen.update(kw, steps=steps)

    learn(Fake(), 300, [], progress_bar=True, resumed=True, trained=TrainedSteps())
    bars = [c for c in seen["callback"].callbacks if isinstance(c, RunProgressBar)]
    assert seen["steps"] == 200 and len(bars) == 1 and seen["reset_num_timesteps"] is False
    assert not seen.get("progress_bar")


def test_a_stop_signal_sets_a_flag_the_next_step_reads():
    """StopOnSignal by hand: the handler only records the signal and the next step returns
    False; a second signal raises at once; a signal the process ignores stays ignored;
    restore puts the previous handlers back; from another thread nothing is installed.
    UntilStopped calls no callback after the one that stops."""
    import threading
    from types import SimpleNamespace

    from stable_baselines3.common.callbacks import BaseCallback

    from agents.training import StopOnSignal, UntilStopped

    stop = StopOnSignal()
    assert stop._on_step()
    stop._handle(signal.SIGTERM, None)
    assert stop.signum == signal.SIGTERM and not stop._on_step()
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGINT handled as Python does by default, whatever this process inherited (a job
    # started in the background by a non-interactive shell inherits it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fresh = StopOnSignal()
        fresh.install()
        assert signal.getsignal(signal.SIGINT) == fresh._handle
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # started ignored: kept so
        fresh.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        elsewhere = StopOnSignal()
        worker = threading.Thread(target=elsewhere.install)
        worker.start()
        worker.join()
        assert not elsewhere._previous and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

    calls = []

    class Step(BaseCallback):
        def __init__(self, name, go):
            super().__init__()
            self.label, self.go = name, go

        def _on_step(self):
            calls.append(self.label)
            return self.go

    steps = [Step("trained", True), Step("stop", False), Step("evaluate", True)]
    for step in steps:
        step.model = SimpleNamespace(num_timesteps=0)  # what SB3 gives a callback it runs
    assert UntilStopped(steps)._on_step() is False and calls == ["trained", "stop"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, vec_env", [(signal.SIGINT, "dummy"), (signal.SIGTERM, "dummy"),
                                             (signal.SIGINT, "subproc")],
                         ids=["SIGINT", "SIGTERM", "Ctrl-C to the process group, subproc envs"])
def test_interrupted_run_keeps_only_trained_steps_and_resumes(tmp_path, signum, vec_env):
    """A Ctrl-C or a scheduler's SIGTERM mid-training: the run stops at its next step,
    exits 128 + the signal, and keeps a checkpoint of whole rollouts to resume from. A
    Ctrl-C at a terminal reaches the whole process group, environment workers too: they
    leave the stop to the main process."""
    run = tmp_path / "i"
    proc = subprocess.Popen([sys.executable, "train.py", "--total-timesteps", "200000", "--run-dir",
                             str(run), *TINY, "--vec-env", vec_env], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            # as at a terminal, even when the tests run in the background
                            # (where a shell starts them with SIGINT ignored, and so the run)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and len(list((run / "checkpoints").glob("ckpt_*.zip"))) < 2:
        time.sleep(0.5)
    if vec_env == "subproc":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # every thread's stack, for the failure message
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"no exit 120 s after {signum.name}:\n{err[-6000:]}")
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "continue with: python train.py --resume" in err
    steps = [int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("ckpt_*_steps.zip")]
    assert max(steps) % 128 == 0  # whole rollouts (2 envs x 64 steps): only what was trained
    # A checkpoint cut short by a kill: resume falls back to the one before it.
    newest = run / "checkpoints" / f"ckpt_{max(steps)}_steps.zip"
    newest.write_bytes(newest.read_bytes()[:100])
    total = max(steps) + 128
    resumed = train("--resume", str(run), "--total-timesteps", str(total), "--no-progress-bar")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "cannot be loaded" in resumed.stderr
    assert trained_steps(run) == total


def test_bad_options_are_one_line_errors(tmp_path):
    for args, message in [
        (["--total-timesteps", "0"], "total_timesteps: got 0"),
        (["--resume", str(tmp_path / "nothing-here")], "is not a train.py run directory"),
        (["--workload", "nope"], "workload: unknown name 'nope'"),
        (["--net-arch", "100000000"], "net_arch: got '100000000'"),
        (["--seed", "-1"], "seed: got -1"),
        (["--learning-rate", "nan"], "learning_rate: got nan"),
        (["--load-low", "2", "--load-high", "1"], "load_high: got 1.0"),
        (["--conditions", "5000"], "conditions: got 5000"),
        (["--teacher", "x9"], "teacher: got 'x9', must be one of time-budget:0.25,"),
        (["--teacher", "t4"], "teacher: got 't4', must be one of time-budget:0.25,"),
        (["--teacher", "time-budget-deadline", "--actions", "tokens"], "teacher: got 'time-budget-deadline', needs --actions time"),
    ]:
        out = cli("train.py", *args, "--run-dir", str(tmp_path / "x"))
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    (tmp_path / "file").write_text("")
    out = cli("train.py", "--run-dir", str(tmp_path / "file"))
    assert out.returncode == 2 and "run_dir" in out.stderr


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint_to_the_promised_steps(tmp_path):
    """SIGKILL after a checkpoint (nothing after it is saved): the resume restarts from that
    checkpoint and ends with exactly the steps asked for, counted by the model's logger."""
    run = tmp_path / "k"
    proc = subprocess.Popen([sys.executable, "train.py", "--total-timesteps", "200000", "--run-dir",
                             str(run), *TINY], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((run / "checkpoints").glob("ckpt_*.zip"))) < 2:
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = max(int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("ckpt_*_steps.zip"))
    total = saved + 256
    resumed = train("--resume", str(run), "--total-timesteps", str(total), "--no-progress-bar")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at {saved} timesteps" in resumed.stdout
    assert trained_steps(run) == total
    # The logger's own count: the last step TensorBoard recorded a rollout at (SB3 keeps
    # time/total_timesteps out of TensorBoard; the step axis is that count).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = 0
    for events in (run / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "time/fps" in acc.Tags()["scalars"]:
            logged = max(logged, max(e.step for e in acc.Scalars("time/fps")))
    assert logged == total


def test_teacher_is_the_best_measured_capacity_among_cost_ties():
    """The return is a noisy proxy: among the choices whose paired cost ties with the lowest,
    the teacher is the one that served the most in the capacity ranking."""
    import numpy as np

    from agents.checks import teacher_choice

    rng = np.random.default_rng(0)
    base = rng.uniform(0, 2, 24)
    wobble = np.tile([0.35, -0.25], 12)  # mean +0.05 (about 5%), spread 0.3: within the interval
    costs = {"time-budget-kv:1": base, "time-budget-slack-kv:16": base + wobble, "time-budget:0.5": base + 5.0}
    ranking = {"rows": [{"policy": "time-budget-kv:1", "relative_capacity": 0.91},
                        {"policy": "time-budget-slack-kv:16", "relative_capacity": 0.96},
                        {"policy": "time-budget:0.5", "relative_capacity": 0.99}]}
    assert teacher_choice(costs) == "time-budget-kv:1"  # no ranking: the lowest cost
    assert teacher_choice(costs, ranking) == "time-budget-slack-kv:16"  # f0.5 serves more but costs clearly more
    costs["time-budget-slack-kv:16"] = base + 1.0  # no longer a tie
    assert teacher_choice(costs, ranking) == "time-budget-kv:1"


def test_a_model_of_another_observation_version_is_refused_in_one_line(tmp_path):
    from types import SimpleNamespace

    from policies.learned import check_observations
    from envs.errors import ConfigError
    from envs.observation import OBSERVATION_FIELDS

    ok = SimpleNamespace(observation_space=SimpleNamespace(shape=(len(OBSERVATION_FIELDS),)))
    check_observations(ok, tmp_path)
    earlier = SimpleNamespace(observation_space=SimpleNamespace(shape=(14,)))
    check_observations(earlier, tmp_path)  # ChunkBudget-v2's vector, a prefix of this one
    with pytest.raises(ConfigError, match="was trained on 14 observations"):
        check_observations(earlier, tmp_path, resuming=True)  # training goes on in its own
    old = SimpleNamespace(observation_space=SimpleNamespace(shape=(13,)))
    with pytest.raises(ConfigError, match="was trained on 13 observations, chunkpilot/ChunkBudget-v4 has 19"):
        check_observations(old, tmp_path)


def test_each_condition_keeps_its_own_best_fixed_choice():
    """On a tight cache of short conversations the KV-aware rule beats the slack rule,
    which ignores the cache, on every episode; where every choice meets the SLO, the
    overall teacher stays."""
    from agents.checks import condition_teachers
    from envs.episodes import EpisodeSampler
    from envs.scenario import Scenario

    base = Scenario(hardware="h100-sxm", model="llama-3-8b")
    tight = dict(prompt="empirical:azure_conv_2023", output="empirical:azure_conv_2023:output_tokens",
                 arrival="poisson", slo_ttft_s=10.0, slo_itl_s=0.2, per_pass_overhead_s=0.00271,
                 num_kv_blocks=3837, capacity_rps=12.06)
    light = dict(prompt="short-long", output="lognormal:128:0.8:1024", arrival="poisson",
                 slo_ttft_s=10.0, slo_itl_s=0.2, capacity_rps=0.5)
    sampler = EpisodeSampler(load_range=(1.1, 1.3), episode_s=60.0, conditions=(tight, light))
    picks = condition_teachers(base, sampler, ["time-budget-kv:1"], "time-budget-slack", per_condition=3, seed=5)
    assert picks == ["time-budget-kv:1", "time-budget-slack"]


def test_imitation_follows_each_environments_condition():
    from types import SimpleNamespace

    import numpy as np

    from agents.checks import condition_index
    from agents.setup import _teacher_actions_by_env, teacher_actions
    from envs.actions import FRACTION_LADDER
    from envs.observation import OBSERVATION_FIELDS
    from envs.scenario import Scenario

    conds = [dict(slo_itl_s=0.05, num_kv_blocks=4000, capacity_rps=2.0), dict(slo_itl_s=0.2, capacity_rps=9.0)]
    base = Scenario(hardware="h100-sxm", model="llama-3-8b")
    scs = [base.with_fields(**{k: v for k, v in c.items() if k != "capacity_rps"}) for c in conds]
    scs.append(base.with_fields(slo_itl_s=0.03))  # from no condition: the overall teacher
    assert [condition_index(sc, conds) for sc in scs] == [0, 1, None]
    raw = np.zeros((3, len(OBSERVATION_FIELDS)), dtype=np.float32)
    raw[:, 3] = 0.9  # a nearly full cache: k1 shrinks the time budget
    venv = SimpleNamespace(get_attr=lambda name: scs if name == "episode_scenario" else None)
    got = _teacher_actions_by_env(venv, raw, "time-budget:0.5", FRACTION_LADDER, ["time-budget-kv:1", "time-budget:1"], conds)
    want = [teacher_actions(n, FRACTION_LADDER, raw[i:i + 1])[0] for i, n in enumerate(["time-budget-kv:1", "time-budget:1", "time-budget:0.5"])]
    assert got.tolist() == want
    assert FRACTION_LADDER[got[0]] < 1.0 == FRACTION_LADDER[got[1]]
    assert _teacher_actions_by_env(venv, raw, "time-budget:0.5", FRACTION_LADDER, None, conds).tolist() == \
        teacher_actions("time-budget:0.5", FRACTION_LADDER, raw).tolist()


def test_a_given_teacher_is_kept_over_the_checks_pick(monkeypatch, capsys):
    """--teacher pins the overall teacher: the checks still measure the costs and the
    ranking, but neither replaces it, and each condition's teacher is picked against it."""
    import numpy as np

    import train as checks  # the checks' functions as train.py holds them
    import train

    names_seen = {}
    monkeypatch.setattr(checks, "draw_episodes", lambda *a, **k: list(range(6)))
    monkeypatch.setattr(checks, "constant_costs", lambda episodes, names, **_: {
        n: np.full(len(episodes), 0.5 if n == "time-budget-deadline-kv" else 3.0) for n in names})
    monkeypatch.setattr(checks, "ranking_check", lambda *a, **k: {
        "spearman": 0.9, "conditions": 5, "rows": [{"policy": "time-budget-deadline-kv", "relative_capacity": 1.0}]})
    monkeypatch.setattr(checks, "condition_teachers", lambda base, sampler, names, teacher, *a, **k:
                        names_seen.setdefault("teacher", teacher) and [teacher])
    monkeypatch.setattr(checks, "room_check",
                        lambda *a, **k: {"gain": 0.0, "gain_ci95": 0.0, "episodes": 6})
    conditions = [{"capacity_rps": 1.0}]
    for teacher, want in ((None, "time-budget-deadline-kv"), ("time-budget-deadline", "time-budget-deadline")):
        args = train.Args(teacher=teacher, conditions=1, workers=1)
        args.validate()
        names_seen.clear()
        out = train.pretraining_checks(args, args.scenario(), conditions, None)
        assert out["best_constant"] == want and names_seen["teacher"] == want
        assert out["lowest_cost"] == "time-budget-deadline-kv" and out.get("teacher_given", False) == (teacher is not None)
    train.print_checks(out)
    printed = capsys.readouterr().out
    assert ("teacher as given (--teacher): time-budget-deadline (cost 3.00" in printed
            and "the checks' pick: time-budget-deadline-kv" in printed)
    assert out["checks_pick"] == "time-budget-deadline-kv"
    from agents.summary import teacher_line

    assert teacher_line(out) == ("- teacher: time-budget-deadline, given (--teacher); the checks' pick: "
                                 "time-budget-deadline-kv")
    args = train.Args(teacher="time-budget-deadline", checks=False)  # without the checks it is still the teacher
    assert train.pretraining_checks(args, args.scenario(), conditions, None)["best_constant"] == "time-budget-deadline"


def test_a_condition_teacher_keeps_the_overall_teachers_top_among_ties(monkeypatch):
    """Where several rules beat the overall teacher equally, the condition's teacher is the
    one nearest it (its top), so the clones disagree only where the condition needs it."""
    import numpy as np

    import agents.checks as checks
    from envs.episodes import EpisodeSampler
    from envs.scenario import Scenario

    per = 4
    table = {  # condition -> name -> costs of its episodes
        0: {"time-budget-slack": [8, 9, 7, 8], "time-budget-kv:0.917": [0, 0, 0, 0], "time-budget-slack-kv": [0, 0, 0, 0], "time-budget:1": [9, 9, 9, 9]},
        1: {"time-budget-slack": [3, 0, 2, 1], "time-budget-kv:0.917": [9, 9, 8, 9], "time-budget-slack-kv": [3, 0, 2, 1], "time-budget:1": [3, 1, 2, 1]},
        2: {"time-budget-slack": [9, 8, 9, 9], "time-budget-kv:0.917": [1, 0, 1, 0], "time-budget-slack-kv": [5, 4, 6, 5], "time-budget:1": [9, 9, 9, 9]},
    }
    monkeypatch.setattr(checks, "draw_episodes", lambda base, one, n, seed: [one.conditions[0]] * n)

    def costs(episodes, names, **_):
        return {n: np.concatenate([table[c["i"]][n] for c in episodes[::per]]).astype(float)
                for n in names}

    monkeypatch.setattr(checks, "constant_costs", costs)
    sampler = EpisodeSampler(conditions=tuple({"i": i} for i in range(3)))
    picks = checks.condition_teachers(Scenario(), sampler, ["time-budget-kv:0.917", "time-budget-slack-kv", "time-budget:1"], "time-budget-slack",
                                      per_condition=per)
    assert picks == ["time-budget-slack-kv", "time-budget-slack", "time-budget-kv:0.917"]


def test_a_condition_teacher_by_capacity_is_the_one_that_serves_most_ties_to_the_first():
    from agents.checks import capacity_pick

    names = ["time-budget-deadline-kv:16", "time-budget-deadline-kv:4", "time-budget-deadline-kv:2"]
    assert capacity_pick(names, [1.0, 1.015, 0.5], 0.01) == names[1]  # 1.0 < 0.99 x 1.015
    assert capacity_pick(names, [1.0, 1.01, 0.5], 0.01) == names[0]  # within 1%: the first
    assert capacity_pick(names, [1.0, 1.015, 0.5], 0.02) == names[0]  # within 2%: the first
    assert capacity_pick(names, [1.0, 1.015, 0.5], 0.0) == names[1]  # no tie: the highest
    assert capacity_pick(names, [0.0, 0.0, 0.0], 0.01) == names[0]  # nothing meets the SLO: the first
    assert capacity_pick(names, [0.5, 0.9, 1.0], 0.01) == names[2]


def test_condition_capacities_come_back_in_the_conditions_order_across_slo_groups(monkeypatch):
    """Conditions are searched in groups of one TTFT target (a stream lasts ten of them), and
    each condition's capacities come back in its own place, one per name, each search
    started from the condition's own capacity."""
    from types import SimpleNamespace

    import agents.conditions as conditions
    from agents.checks import condition_capacities
    from envs.scenario import Scenario

    calls = []

    def sweep(pairs, seeds, num_requests, starts=None, min_duration_s=0.0, **_):
        calls.append(min_duration_s)
        return [SimpleNamespace(capacity=sc.slo_itl_s * 1000 + len(p.name) + starts[k][0])
                for k, (sc, p) in enumerate(pairs)]

    monkeypatch.setattr(conditions, "capacity_sweep", sweep)
    conds = [dict(slo_ttft_s=10.0, slo_itl_s=0.2, capacity_rps=2.0),
             dict(slo_ttft_s=2.0, slo_itl_s=0.1, capacity_rps=4.0),
             dict(slo_ttft_s=10.0, slo_itl_s=0.3, capacity_rps=1.0)]
    names = ["time-budget-deadline-kv:4", "time-budget"]
    base = Scenario(rate=2.0)
    got = condition_capacities(base, conds, names)
    assert calls == [20.0, 100.0]  # the 2 s group first, streams of at least ten targets
    long, short = len("time-budget-deadline-kv"), len("time-budget")  # how the policies name themselves
    assert got == [[200 + long + 1.0, 200 + short + 1.0], [100 + long + 2.0, 100 + short + 2.0],
                   [300 + long + 0.5, 300 + short + 0.5]]


def test_on_an_l40s_the_deadline_rule_at_top_4_serves_more_than_at_top_16():
    """The capacities behind a condition's teacher across deployments: on the L40S, whose
    prefill of 1,298 tokens per ITL target is a third of the H100's, passes of 16 targets
    cost the running users more than they gain (docs/learning.md)."""
    from agents.checks import capacity_pick, condition_capacities
    from envs.scenario import Scenario

    cond = dict(hardware="l40s", model="llama-3-8b", prompt="short-long",
                output="lognormal:128:0.8:1024", arrival="gamma", burstiness=0.5,
                slo_ttft_s=2.0, slo_itl_s=0.1, capacity_rps=0.9)
    names = ["time-budget-deadline-kv:16", "time-budget-deadline-kv:4"]
    (caps,) = condition_capacities(Scenario(rate=1.0), [cond], names, seeds=1, num_requests=200)
    assert caps[1] > 1.1 * caps[0] > 0
    assert capacity_pick(names, caps, 0.01) == "time-budget-deadline-kv:4"


def test_across_deployments_each_conditions_teacher_is_picked_by_capacity(monkeypatch):
    """--all-deployments picks each condition's teacher from the deadline rule's family by
    capacity (not by episode cost) and records the capacities in the checks."""
    import train

    monkeypatch.setattr(train, "draw_episodes", lambda *a, **k: list(range(6)))
    monkeypatch.setattr(train, "constant_costs", lambda episodes, names, **_: {
        n: np.full(len(episodes), 0.5 if n == "time-budget-deadline-kv:16" else 3.0) for n in names})
    monkeypatch.setattr(train, "ranking_check", lambda *a, **k: {"spearman": 0.9, "conditions": 5, "rows": []})
    monkeypatch.setattr(train, "condition_teachers", lambda *a, **k: pytest.fail("picked by cost"))
    monkeypatch.setattr(train, "room_check", lambda *a, **k: {"gain": 0.0, "gain_ci95": 0.0, "episodes": 6})
    caps = [[2.0, 2.0, 2.01], [1.0, 1.0, 1.5]]
    streams = []

    def capacities(base, conds, names, seeds, **_):
        streams.append(seeds)
        return caps[:len(conds)]

    monkeypatch.setattr(train, "condition_capacities", capacities)
    args = train.Args(all_deployments=True, conditions=2, workers=1)
    args.validate()
    out = train.pretraining_checks(args, args.scenario(), [{"capacity_rps": 1.0}] * 2, None)
    assert out["condition_teachers"] == ["time-budget-deadline-kv:4", "time-budget-deadline-kv:16"]
    assert out["teacher_capacities"] == {"policies": list(train.DEPLOYMENT_TEACHERS), "capacity_rps": caps}
    # --teacher-streams sets the streams; with --teacher-tie 0 the highest teaches, 0.5% or not.
    args = train.Args(all_deployments=True, conditions=2, workers=1, teacher_streams=3, teacher_tie=0.0)
    out = train.pretraining_checks(args, args.scenario(), [{"capacity_rps": 1.0}] * 2, None)
    assert streams == [6, 3]
    assert out["condition_teachers"] == ["time-budget-deadline-kv:16"] * 2


def test_the_clone_follows_its_teachers_rare_decisions():
    """Behaviour cloning at CLONE_EPOCHS learns a deadline rule's boosts (4x the ITL target
    on an L40S, about a fifth of its decisions near capacity), not only its majority action:
    on a stream it never saw, the cloned policy decides as the rule does."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from agents.setup import imitate, teacher_actions
    from envs.actions import FRACTION_LADDER
    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from envs.scenario import Scenario
    from policies.learned import ModelPolicy, ObsNorm

    torch.set_num_threads(1)
    sc = Scenario(hardware="l40s", model="llama-3-8b", rate=1.0, prompt="short-long",
                  output="lognormal:128:0.8:1024", slo_ttft_s=2.0, slo_itl_s=0.1)
    sampler = EpisodeSampler(load_range=(0.9, 1.2), episode_s=120.0)
    venv = VecNormalize(DummyVecEnv([lambda: ChunkBudgetEnv(scenario=sc, sampler=sampler)] * 4),
                        norm_obs=True, norm_reward=True)
    model = PPO("MlpPolicy", venv, n_steps=64, seed=0, verbose=0)
    teacher = "time-budget-deadline-kv:4"
    assert imitate(model, teacher, FRACTION_LADDER, 6000, seed=0) > 0.95
    policy = ModelPolicy(model, sc.slo(), obs_norm=ObsNorm.of(venv))
    chosen, raws = [], []

    def act(state, decide=policy.action):
        chosen.append(int(decide(state)))
        raws.append(policy.raw_observation(state))
        return chosen[-1]

    policy.action = act
    sim = sc.simulator(sc.stream(0, 1, 99, 300))
    sim.run(policy)
    rule = teacher_actions(teacher, FRACTION_LADDER, np.array(raws))
    boosts = rule == FRACTION_LADDER.index(4.0)
    assert boosts.mean() > 0.05  # the rule boosts here
    assert (np.array(chosen)[boosts] == rule[boosts]).mean() > 0.8
    assert (np.array(chosen) == rule).mean() > 0.9


def test_presets_pass_a_preset_flags_and_the_final_streams(monkeypatch, tmp_path):
    """`python -m agents.presets --only NAME` trains that preset with its scenario's flags and
    8 held-out streams, then exports its table next to the others; an unknown name is a
    one-line error naming the known ones."""
    from agents import presets
    from envs.errors import ConfigError

    calls = []

    def run_step(argv):  # each step is its own process: -m train, then -m eval export
        calls.append(("train" if argv[:2] == ["-m", "train"] else "export", argv[2:]))
        assert argv[:2] == ["-m", "train"] or argv[:3] == ["-m", "eval", "export"]
        return 0

    monkeypatch.setattr(presets, "run_step", run_step)
    assert presets.main(["--only", "l40s__llama-3-8b", "--runs", str(tmp_path), "--workers", "1"]) == 0
    (_, targs), (_, eargs) = calls
    flag = lambda argv, name: argv[argv.index(name) + 1]
    assert flag(targs, "--hardware") == "l40s" and flag(targs, "--rate") == "1.5"
    assert flag(targs, "--teacher") == "time-budget-deadline"  # the checks' own pick there clones worse
    assert flag(targs, "--final-seeds") == "8" and flag(targs, "--workers") == "1"
    assert flag(targs, "--run-dir") == f"{tmp_path}/l40s__llama-3-8b"
    assert eargs[1] == f"{tmp_path}/l40s__llama-3-8b" and flag(eargs, "--out") == "tables/l40s__llama-3-8b.json"
    with pytest.raises(ConfigError, match="only: unknown nope; known: h100-sxm__llama-3-8b"):
        presets.main(["--only", "nope"])
    for empty in ("", " ", "l40s__llama-3-8b,"):  # an empty name is not "all of them"
        with pytest.raises(ConfigError, match="only: got .*, an empty name"):
            presets.main(["--only", empty, "--export-only"])
    # --export-only: the tables again from the finished runs, nothing trained; a preset
    # without a finished run is refused before any export starts.
    calls.clear()
    (tmp_path / "l40s__llama-3-8b" / "config.json").parent.mkdir()
    (tmp_path / "l40s__llama-3-8b" / "config.json").write_text("{}")
    assert presets.main(["--only", "l40s__llama-3-8b", "--runs", str(tmp_path), "--export-only"]) == 0
    assert [c[0] for c in calls] == ["export"] and flag(calls[0][1], "--features").startswith("itl_slack")
    calls.clear()
    with pytest.raises(ConfigError, match="export_only: no finished run of h200__llama-3-8b in"):
        presets.main(["--only", "l40s__llama-3-8b,h200__llama-3-8b", "--runs", str(tmp_path), "--export-only"])
    assert not calls


def test_action_histogram_counts_budgets_in_quarter_octaves_and_by_running_decodes():
    """Hand-computed: 1,000 tokens falls in the bin from 861 (64 * 2^(15/4)), 1,100 in the
    one from 1,024, 20 tokens under the ladder and 20,000 in the last bin; the share over
    the target counts fractions above 1 only when the values are time fractions."""
    from eval.usage import action_histogram
    from agents.summary import budget_lines

    h = action_histogram([1, 1, 16, 1, 0.5, 0.25], [0.25, 0.5, 1, 16],
                         [1000, 1100, 20000, 990, 64, 20], [3, 5, 9, 2, 80, 1], time_fractions=True)
    assert h["shares"] == pytest.approx({"0.25": 1 / 6, "0.5": 1 / 6, "1": 0.5, "16": 1 / 6})
    assert h["used_5pct"] == 4
    assert h["budget_shares"] == pytest.approx({"1": 1 / 6, "64": 1 / 6, "861": 2 / 6, "1024": 1 / 6,
                                                "16384": 1 / 6})
    assert h["budgets_5pct"] == 5
    rows = {r["decodes"]: r for r in h["by_decodes"]}
    assert set(rows) == {"1-3", "4-15", "64+"}
    assert rows["1-3"]["median_budget"] == pytest.approx(990) and rows["1-3"]["share"] == pytest.approx(0.5)
    assert rows["4-15"]["over_target"] == pytest.approx(0.5) and rows["1-3"]["over_target"] == 0.0
    text = "\n".join(budget_lines(h))
    assert "5 bins each hold at least 5% of passes (861-1,023 33%" in text and "under 64 17%" in text
    assert "16,384+ 17%" in text  # the last bin is open above
    assert "| 1-3 | 0.500 | 990 | 0.000 |" in text and "| 4-15 | 0.333 | 10,550 | 0.500 |" in text
    tokens = action_histogram([512, 2048], [512, 2048], [512, 2048], [1, 1])
    assert "over_target" not in tokens["by_decodes"][0]
    assert "share over 1x the target" not in "\n".join(budget_lines(tokens))
    assert action_histogram([1.0], [1.0]).keys() == {"shares", "used_5pct", "passes"}


def test_presets_report_shows_the_table_at_capacity_and_at_the_serving_load(tmp_path):
    """The report's row per final scenario: the best static, the learned policy, the
    table's capacity and goodput-at-load verdicts against its model, as the run's summary
    and the table's fidelity recorded them; a missing table or run says so."""
    from agents.presets import PRESETS, name_of, report

    name = name_of(*next(iter(PRESETS)))
    study = {"_hindsight_static": {"budget": 2435, "capacity": 6.21},
             "learned (ppo)": {"kind": "learned", "capacity_rps": 6.52, "verdict": "beats (+4.9% ± 0.8%)"},
             "time-budget": {"capacity_rps": 6.3, "verdict": "beats (+1.4% ± 0.5%)"}}
    summary = {"actions": {"shares": {"1": 0.7, "4": 0.26, "0.25": 0.04}}, "checks": {},
               "capacity": {"serving": study, "tight KV cache": study}}
    table = {"fidelity": {"capacity": {"serving": {"verdict": "ties", "table_capacity_rps": 6.5}},
                          "at_capacity": {"passes": 900, "shares": {"1": 0.9, "16": 0.07, "0.5": 0.03},
                                          "budgets_5pct": 3},
                          "goodput": {"serving": {"verdict": "falls short", "loss": 0.2, "table_goodput": 0.6,
                                                  "model_goodput": 0.75},
                                      "tight KV cache": {"verdict": "not judged", "loss": None,
                                                         "table_goodput": 0.2, "model_goodput": 0.3}},
                          "against_flat": {"fraction": 1.0, "scenarios": {"serving": {
                              "gain": 0.052, "gain_ci95": 0.031, "verdict": "beats",
                              "table_capacity_rps": 6.5, "flat_capacity_rps": 6.18}}}}}
    (tmp_path / "runs" / name).mkdir(parents=True)
    (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / f"{name}.json").write_text(json.dumps(table))
    lines = report(str(tmp_path / "runs"), str(tmp_path / "tables")).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 12
    assert lines[2] == (f"| {name} | serving | 2,435: 6.21 | 6.52 (beats (+4.9% ± 0.8%)) | 6.30 (beats "
                        "(+1.4% ± 0.5%)) | ties (6.50) | falls short (0.600 / 0.750) | +5.2% ± 3.1%, "
                        "beats (at 1) | 1 70%, 4 26% | 1 90%, 16 7%; 3 budget bins | not checked |")
    assert "| not exported | not judged (0.200 / 0.300) | not measured |" in lines[3]
    assert all(line.count("|") == 12 for line in lines)
    assert all("not trained" in line for line in lines[4:])


def test_model_selection_keeps_the_start_until_a_model_beats_it_paired():
    """The start (the clone at step 0) is kept; a later model replaces it only where it
    costs less on the same held-out episodes beyond the 95% interval of the per-episode
    differences, and less than the kept one. A lower mean within the episode noise keeps
    nothing."""
    from agents.callbacks import SimEvalCallback, paired_record
    from agents.summary import selection_sentence

    cb = SimEvalCallback([], 5.0, (1.0,), "time", "discrete", 100, baseline_costs=[5.0] * 4)
    start = [6.0, 2.0, 9.0, 3.0]

    def entry(step, costs):
        e = {"timesteps": step, "cost": float(np.mean(costs)), "costs": costs}
        if cb.history:
            e["vs_start"] = paired_record(costs, cb.history[0]["costs"])
        return e

    def offer(step, costs):
        e = entry(step, costs)
        if cb.keeps(e):
            cb.best, cb.kept = e["cost"], step
        cb.history.append(e)
        return e

    offer(0, start)
    assert cb.kept == 0
    # 1.25 lower on average, but -5, +1, -2, +1: sd 2.87, half 3.182 * 2.87 / 2 = 4.57: a tie
    noisy = offer(100, [1.0, 3.0, 7.0, 4.0])
    assert noisy["vs_start"]["verdict"] == "ties" and noisy["cost"] < 5.0 and cb.kept == 0
    text = selection_sentence(cb.history, cb.kept, cloned=True)
    assert text.startswith("Model selection kept the behaviour clone at step 0: none of the 1 later "
                           "models cost less than it beyond the paired interval on the 4 held-out "
                           "episodes (the closest, at step 100: -1.25 ± 4.57)")
    assert "the learning did not beat its start. `python -m agents.search --run RUN_DIR --out " \
        "RUN_DIR-search --objective capacity`" in text
    # 1 lower on every episode, give or take 0.1: kept
    offer(200, [5.0, 1.1, 7.9, 2.0])
    assert cb.kept == 200
    # cheaper than the start beyond the interval, but not cheaper than the kept: not kept
    offer(300, [5.1, 1.0, 8.0, 2.1])
    assert cb.kept == 200
    assert selection_sentence(cb.history, cb.kept, cloned=True).startswith(
        "Model selection kept the model at step 200: it costs 1.00 ± ")


def test_presets_search_by_capacity_and_export_the_searched_model_only_where_one_was_kept(monkeypatch, tmp_path):
    """--search-iterations N: train, then agents.search --objective capacity into RUN-search,
    then export that folder where the search kept a model and the run itself where it did
    not; a run on a trace is exported unsearched."""
    import json
    from pathlib import Path

    from agents import presets
    from envs.errors import ConfigError

    calls, keeps = [], {"kept": True}
    run = tmp_path / "l40s__llama-3-8b"

    def run_step(argv):
        calls.append(argv[1] if argv[1] != "eval" else "export")
        if argv[1] == "train":
            run.mkdir(exist_ok=True)
            (run / "config.json").write_text(json.dumps({"scenario": {"trace": keeps.get("trace")},
                                                         "conditions": []}))
        if argv[1] == "agents.search":
            assert argv[argv.index("--objective") + 1] == "capacity"
            assert argv[argv.index("--iterations") + 1] == "3" and argv[argv.index("--run") + 1] == str(run)
            if keeps["kept"]:
                Path(argv[argv.index("--out") + 1]).mkdir(exist_ok=True)
                Path(argv[argv.index("--out") + 1], "best_model.zip").write_text("")
        if argv[1] == "eval":
            calls.append(argv[3])
        return 0

    monkeypatch.setattr(presets, "run_step", run_step)
    flags = ["--only", "l40s__llama-3-8b", "--runs", str(tmp_path), "--search-iterations", "3"]
    assert presets.main(flags) == 0
    assert calls == ["train", "agents.search", "export", f"{run}-search"]
    keeps["kept"] = False
    calls.clear()
    (Path(f"{run}-search") / "best_model.zip").unlink()
    assert presets.main(flags) == 0
    assert calls == ["train", "agents.search", "export", str(run)]
    calls.clear()  # a search folder left from before is not exported when no search is asked for
    (Path(f"{run}-search") / "best_model.zip").write_text("")
    assert presets.main(flags[:-2]) == 0 and calls == ["train", "export", str(run)]
    calls.clear()
    assert presets.main([*flags, "--export-only"]) == 0 and calls == ["export", f"{run}-search"]
    keeps["trace"] = "mooncake.csv"
    calls.clear()
    assert presets.main(flags) == 0
    assert calls == ["train", "export", str(run)]
    calls.clear()
    with pytest.raises(ConfigError, match="search_iterations: got -1"):
        presets.main(["--only", "l40s__llama-3-8b", "--runs", str(tmp_path), "--search-iterations", "-1"])
    assert not calls


def test_all_deployments_records_its_conditions_and_never_draws_a_held_out_one(tmp_path, monkeypatch):
    """A run across deployments records what it trained on and what it held out; neither
    its training conditions nor the model selection's episodes are ever a held-out
    deployment (the capacities are stubbed: measuring them is the slow part)."""
    from dataclasses import replace

    import train
    from agents.conditions import held_out
    from envs.deployment import HELD_OUT_DEPLOYMENTS
    from envs.episodes import draw_episodes
    from envs.seeds import EVAL_SEED_BASE, PERIODIC_EVAL_SEEDS

    monkeypatch.setattr(train, "with_capacities",
                        lambda base, conds, **kw: [{**c, "capacity_rps": 1.0} for c in conds])
    args = train.Args(all_deployments=True, conditions=48, run_dir=str(tmp_path / "run"))
    args.validate()
    sc = args.scenario()
    conditions = train.draw_training_conditions(args, sc, None)
    train.write_config(tmp_path, args, sc, conditions, {"best_constant": "time-budget:1"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["deployments"]["held_out"] == [list(d) for d in HELD_OUT_DEPLOYMENTS]
    assert len(config["conditions"]) == 48
    assert not any(held_out(c["hardware"], c["model"]) for c in config["conditions"])
    rng = config["deployments"]["range"]
    for c in config["conditions"]:  # the range is the conditions' own
        d = sc.with_fields(**{k: v for k, v in c.items() if k != "capacity_rps"}).deployment()
        assert all(rng[k][0] <= v <= rng[k][1] for k, v in d.as_dict().items() if math.isfinite(v))
    assert "Infinity" not in (tmp_path / "config.json").read_text()  # standard JSON
    assert rng["slo_ttft_s"][0] < rng["slo_ttft_s"][1]  # SLO pairs drawn apart
    sampler = replace(train.make_sampler(args, config["conditions"], EVAL_SEED_BASE),
                      load_range=train.SELECTION_LOADS)
    episodes = draw_episodes(sc, sampler, 48, PERIODIC_EVAL_SEEDS)
    assert len({e.hardware for e, _ in episodes}) > 5
    assert not any(held_out(e.hardware, e.model) for e, _ in episodes)


@pytest.mark.parametrize("flags, says", [
    (["--hardware", "h200"], "hardware: got 'h200', with --model llama-3-8b is held out"),
    (["--model", "llama-3-70b-tp4"], "is held out of --all-deployments"),
    (["--conditions", "0"], "conditions: got 0, must be > 0 with --all-deployments"),
    (["--hardware", "a100-80g@hbm_bytes_per_s=4.078e12,peak_flops_per_s=1.56e14"], "is held out"),
    (["--model", "llama-3-8b-q4"], "is not a deployment --all-deployments trains on"),
    (["--trace", "azure_conv_2023"], "trace: got 'azure_conv_2023', is not used with --all-deployments"),
])
def test_all_deployments_refuses_a_held_out_serving_deployment(flags, says):
    refused_in_one_line(cli("train.py", "--all-deployments", *flags), says)


@pytest.mark.parametrize("flags, says", [
    (["--teacher-streams", "3"], "teacher_streams: got 3, needs --all-deployments"),
    (["--all-deployments", "--no-condition-teachers", "--teacher-tie", "0.02"],
     "teacher_tie: got 0.02, needs --all-deployments (and its teachers per condition)"),
    (["--all-deployments", "--teacher-tie", "2"], "teacher_tie: got 2.0, must be a finite number >= 0 and <= 0.5"),
])
def test_the_teacher_choice_flags_are_refused_where_they_choose_nothing(flags, says, tmp_path):
    """A run on one deployment picks its teachers by episode cost: --teacher-streams and
    --teacher-tie, which pick them by capacity across deployments, are refused there in one
    line before any work, as is a tie outside 0-0.5."""
    refused_in_one_line(cli("train.py", "--run-dir", str(tmp_path / "r"), *flags), says)
    assert not (tmp_path / "r").exists()
