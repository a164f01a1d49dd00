"""Paired policy search: evolution strategies on the kept model's action head, every
candidate served on the same episodes.

    python -m agents.search --run RUN_DIR --out runs/search

PPO sees a few percent of room through the noise of episodes that differ in their
arrivals, loads and conditions; imitating a rollout (``agents.improve``) learns the
noise in its labels. This search compares candidates only with each other on the same
arrivals (common random numbers), so that the noise of the episodes cancels from
their differences. Each iteration draws fresh training episodes of the run's conditions
at the loads where choices decide the SLO, perturbs the action head (the last layer:
the logits over the ladder's rungs, from the features the model has learned) along a
few random directions, serves every perturbation and its mirror image on all of them,
and steps along the directions by how much each lowered the cost (antithetic evolution
strategies: Salimans et al., "Evolution Strategies as a Scalable Alternative to
Reinforcement Learning", 2017, with the differences scaled by their root mean square). The cost
is the environment's, the one train.py's model selection scores.

Every few iterations the searched model is compared with the start on the run's
held-out episodes, paired, as train.py's model selection does; the cheapest that costs
less than the start beyond the 95% interval is written to OUT as a run directory
(``model:OUT``, eval and export read it). Where none does, the command says the search
did not beat its start and writes no model. The search keeps its place in OUT and goes
on from it when run again after a kill.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from agents.checks import episode_cost
from envs.cli import parse
from envs.episodes import draw_episodes
from envs.errors import ConfigError, integer, number, require, run_cli
from envs.files import check_output, write_json_atomic
from envs.scenario import Scenario
from envs.seeds import EVAL_SEED_BASE, PERIODIC_EVAL_SEEDS
from eval.harness import paired_difference
from eval.parallel import LocalExecutor, make_executor
from policies.learned import ModelPolicy, NumpyActor, load_run, run_sampler




def head_of(actor: NumpyActor) -> np.ndarray:
    """The action head's weights and biases as one vector."""
    w, b, _ = actor.layers[-1]
    return np.concatenate([w.ravel(), b.ravel()])


def with_head(actor: NumpyActor, theta: np.ndarray) -> NumpyActor:
    """``actor`` with its action head set from ``theta`` (:func:`head_of`'s layout)."""
    w, b, kind = actor.layers[-1]
    return NumpyActor([*actor.layers[:-1],
                       (np.asarray(theta[:w.size], w.dtype).reshape(w.shape),
                        np.asarray(theta[w.size:], b.dtype).copy(), kind)])


def policy_with(base: ModelPolicy, theta: np.ndarray) -> ModelPolicy:
    """A copy of ``base`` acting with the action head ``theta`` (its torch model left behind:
    the numpy actor is what serves, and what a worker receives)."""
    out = type(base).__new__(type(base))
    out.__dict__.update(base.__dict__)
    out.model = None
    out._actor = with_head(base._actor, theta)
    return out


def _cost_task(scenario, workload, policy) -> float:
    return episode_cost(scenario, workload, policy.at(scenario))


def episode_costs(base: ModelPolicy, thetas, episodes, executor=None) -> np.ndarray:
    """(candidates x episodes) costs of ``base`` with each action head of ``thetas``, every
    candidate on every episode (the same arrivals for all: paired)."""
    policies = [policy_with(base, t) for t in thetas]
    tasks = [(sc, w, p) for p in policies for sc, w in episodes]
    found = (executor or LocalExecutor()).map(_cost_task, tasks)
    return np.asarray(found, dtype=float).reshape(len(policies), len(episodes))


def search_step(theta: np.ndarray, costs, episodes, directions: int, sigma: float, step: float,
                rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """One iteration: ``directions`` Gaussian perturbations of ``theta`` (each entry's
    standard deviation ``sigma``), each served with its mirror image on ``episodes``
    (``costs(thetas, episodes)`` -> their costs, candidates by episodes); the step is the
    directions weighted by their cost differences over the differences' spread, times
    ``step`` (the spread is the differences' root mean square, so that one direction
    moves by its sign). Returns the new theta and the iteration's record (the current theta's mean
    cost on the episodes, and each direction's mean difference)."""
    eps = rng.standard_normal((directions, theta.size)) * sigma
    thetas = [theta] + [theta + s * e for e in eps for s in (1.0, -1.0)]
    found = np.asarray(costs(thetas, episodes), dtype=float)
    diffs = (found[1::2] - found[2::2]).mean(axis=1)  # plus minus mirror, per direction
    spread = float(np.sqrt(np.mean(diffs ** 2)))
    move = -(diffs[:, None] * eps).sum(axis=0) / (directions * sigma) / spread if spread > 0 \
        else np.zeros_like(theta)
    return theta + step * sigma * move, {"cost": float(found[0].mean()),
                                         "diffs": [round(float(d), 4) for d in diffs]}


@dataclass(frozen=True)
class SearchArgs:
    """Paired evolution strategies on a train.py run's kept model: its action head is
    searched on training episodes where every candidate meets the same arrivals, and kept
    only where it beats the start on the run's held-out episodes, paired."""

    run: str = ""
    """The train.py run directory whose kept model starts (required)."""
    out: str = ""
    """Run directory to write the searched model to (required)."""
    iterations: int = 12
    """Search iterations."""
    directions: int = 8
    """Random directions per iteration, each served with its mirror image."""
    episodes: int = 16
    """Training episodes per iteration (fresh each iteration; every candidate serves all)."""
    sigma: float = 1.5
    """Perturbation size, in standard deviations of the head's weights: large enough that a
    perturbation changes some decisions (an argmax policy's cost is flat under small ones)."""
    step: float = 0.2
    """Step length, in units of the perturbation size."""
    check_every: int = 3
    """Compare with the start on the held-out episodes every this many iterations (and after
    the last)."""
    eval_episodes: int = 24
    """Held-out episodes of the comparison with the start (the model selection's)."""
    load_low: float = 0.9
    """Lowest load of the training and held-out episodes, times their condition's capacity
    (the model selection's: train.py's SELECTION_LOADS, where choices decide the SLO)."""
    load_high: float = 1.3
    """Highest load of the training and held-out episodes."""
    workers: int | None = None
    """Simulations at once on a local Ray instance (default: all cores; 1: in this process)."""
    seed: int = 0
    """Seed of the directions and the training episodes."""

    def __post_init__(self) -> None:
        for name in ("run", "out"):
            require(bool(getattr(self, name)), name, getattr(self, name), "is required: a folder")
        integer("iterations", self.iterations, 1, 10_000)
        integer("directions", self.directions, 1, 1000)
        integer("episodes", self.episodes, 1, 10_000)
        number("sigma", self.sigma, 0.0, 100.0, low_open=True)
        number("step", self.step, 0.0, 100.0, low_open=True)
        integer("check_every", self.check_every, 1, 10_000)
        integer("eval_episodes", self.eval_episodes, 2, 1000)
        number("load_low", self.load_low, 0.0, 100.0, low_open=True)
        number("load_high", self.load_high, self.load_low, 100.0)
        integer("seed", self.seed, 0, 2**31 - 1)


PROGRESS = "search_progress.json"
"""The search's place in OUT (theta, iteration, records), for a run again after a kill."""


def _key(args: SearchArgs, run: Path) -> dict:
    return {k: v for k, v in asdict(args).items() if k not in ("out", "workers")} | {"run": str(run.resolve())}


def _read_progress(path: Path, key: dict) -> dict | None:
    """The saved place of a search with the same arguments, or None (none, another search's,
    or damaged: it starts afresh)."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            return None
        return {"iteration": int(saved["iteration"]), "theta": np.asarray(saved["theta"], float),
                "records": list(saved["records"]), "kept": saved.get("kept")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_run(run: Path, out: Path, policy: ModelPolicy, theta: np.ndarray) -> None:
    """OUT as a run directory: the run's config and observation statistics, and its model with
    the action head ``theta``."""
    import torch  # heavy: only once a model is written

    head = policy.model.policy.action_net
    k, n = head.weight.shape
    with torch.no_grad():
        head.weight.copy_(torch.as_tensor(theta[:n * k].reshape(n, k).T, dtype=head.weight.dtype))
        head.bias.copy_(torch.as_tensor(theta[n * k:], dtype=head.bias.dtype))
    norm = run / ("best_vecnormalize.pkl" if (run / "best_model.zip").exists() else "vecnormalize.pkl")
    if norm.exists():
        shutil.copy(norm, out / "best_vecnormalize.pkl")
    tmp = out / "best_model.tmp.zip"
    policy.model.save(str(tmp))
    tmp.replace(out / "best_model.zip")
    shutil.copy(run / "config.json", out / "config.json")


def main(argv: list[str] | None = None) -> int:
    args = parse(SearchArgs, argv, prog="python -m agents.search")
    run, out = Path(args.run), Path(args.out)
    require(run.resolve() != out.resolve(), "out", args.out, "must not be the run itself")
    check_output("out", out, "folder")
    policy = load_run(run)
    if policy._actor is None:
        raise ConfigError(f"run: {str(run)!r} holds a model without a discrete action head "
                          "(PPO or A2C acting on the ladder); the search perturbs that head")
    config = policy.config
    serving = Scenario(**config["scenario"])
    loads = (args.load_low, args.load_high)
    train = replace(run_sampler(config["args"], config["conditions"], 0), load_range=loads)
    held = draw_episodes(serving, replace(run_sampler(config["args"], config["conditions"], EVAL_SEED_BASE),
                                          load_range=loads), args.eval_episodes, PERIODIC_EVAL_SEEDS)
    out.mkdir(parents=True, exist_ok=True)
    executor = make_executor(args.workers)

    def costs(thetas, episodes):
        return episode_costs(policy, thetas, episodes, executor)

    theta0 = head_of(policy._actor)
    sigma = args.sigma * float(np.sqrt(np.mean(policy._actor.layers[-1][0] ** 2)))
    key = _key(args, run)
    saved = _read_progress(out / PROGRESS, key)
    start = costs([theta0], held)[0]
    print(f"the start ({run}): cost {start.mean():.2f} on {len(held)} held-out episodes; "
          f"searching {theta0.size:,} weights of its action head", flush=True)
    theta, first, records, kept = theta0, 0, [], None
    if saved is not None:
        theta, first, records, kept = saved["theta"], saved["iteration"], saved["records"], saved["kept"]
        print(f"going on from iteration {first} ({out / PROGRESS})", flush=True)
    t0 = time.time()
    for it in range(first, args.iterations):
        episodes = draw_episodes(serving, train, args.episodes, args.seed + 10_000 * (it + 1))
        theta, rec = search_step(theta, costs, episodes, args.directions, sigma, args.step,
                                 np.random.default_rng([args.seed, it]))
        rec["iteration"] = it + 1
        if (it + 1) % args.check_every == 0 or it + 1 == args.iterations:
            c = costs([theta], held)[0]
            v = paired_difference(c, start)
            rec.update(held_out=round(float(c.mean()), 4), vs_start=round(v.rel, 4),
                       vs_start_ci95=round(v.half, 4), verdict=v.kind)
            print(f"  iteration {it + 1}: held-out cost {c.mean():.2f}, against the start "
                  f"{v.rel:+.2f} ± {v.half:.2f} ({v.kind}); {time.time() - t0:.0f} s", flush=True)
            if v.kind == "falls short" and (kept is None or c.mean() < kept["held_out"]):
                kept = {"iteration": it + 1, "held_out": float(c.mean())}
                write_run(run, out, policy, theta)
        records.append(rec)
        write_json_atomic(out / PROGRESS, {"key": key, "iteration": it + 1, "theta": theta.tolist(),
                                           "records": records, "kept": kept})
    write_json_atomic(out / "search.json", {"args": asdict(args), "start_cost": float(start.mean()),
                                            "start_costs": start.tolist(), "kept": kept,
                                            "iterations": records})
    (out / PROGRESS).unlink(missing_ok=True)
    if kept is not None:
        print(f"iteration {kept['iteration']} costs less than the start beyond the paired interval "
              f"(held-out cost {kept['held_out']:.2f} against {start.mean():.2f}): {out}; measure "
              f"its capacity before serving it (python -m eval capacity --policies model:{out},...)")
    else:
        print(f"no iteration cost less than the start beyond the paired interval: the search did "
              f"not beat its start; keep {run}")
    return 0


if __name__ == "__main__":
    run_cli(main)
