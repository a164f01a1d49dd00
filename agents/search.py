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
Reinforcement Learning", 2017, with the differences scaled by their root mean square).

What it lowers (``--objective``):

- ``cost``: the environment's episode cost, the one train.py's model selection scores. It
  rewards what happens beyond capacity as well as at it, so a lead in it need not serve
  more requests.
- ``capacity``: each episode's capacity under the SLO, the figure eval capacity judges: the
  episode's condition and stream (the same arrivals for every candidate, at every load) are
  searched for the highest load at which p99 TTFT and p99 ITL meet their targets, and the
  cost is minus the log of that load (a difference of 0.05 is 5% more capacity). About 8
  simulations an episode instead of one.

Every few iterations the searched model is compared with the start on the run's
held-out episodes, paired, as train.py's model selection does. The cheapest that costs
less than the start beyond the 95% interval is measured again on fresh episodes (its lead
on the episodes it was picked on is biased up) and stays in OUT as a run directory
(``model:OUT``, eval and export read it) only where it beats the start there too. Where
it does not, the command says the search did not beat its start and leaves no model. The
search keeps its place in OUT and goes on from it when run again after a kill.
"""

from __future__ import annotations

import hashlib
import json
import math
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
from envs.seeds import EVAL_SEED_BASE, PERIODIC_EVAL_SEEDS, SEARCH_CONFIRM_SEEDS, SEARCH_HELD_STREAMS
from eval.capacity import stream_capacity
from eval.harness import paired_difference
from eval.parallel import LocalExecutor, make_executor
from policies.learned import ModelPolicy, load_run, read_config, run_sampler


ALGOS = ("ppo", "a2c")
"""Algorithms whose model has the action head the search perturbs (an actor-critic's
logits over the ladder's rungs)."""


def policy_with(base: ModelPolicy, theta: np.ndarray) -> ModelPolicy:
    """A copy of ``base`` acting with the action head ``theta`` (``NumpyActor.head``'s layout)."""
    return base.acting_with(base.actor.with_head(theta))


OBJECTIVES = ("cost", "capacity")

CAPACITY_STEP = 1.5
"""The capacity objective's bracketing step: an episode starts at 0.9-1.3 times its
condition's capacity, so the boundary is one or two steps away."""
LOWEST_LOAD = 1e-3
"""The load the capacity objective counts for an episode whose SLO no load meets (its cost
is then -log of it, 6.9: finite, and worse than any load found)."""


def capacity_cost(scenario: Scenario, stream_seed: int, policy, requests: int) -> float:
    """Minus the log of the highest load factor (times ``scenario``'s own rate, to 2%) at which
    ``policy`` meets the SLO on the synthetic stream seeded ``stream_seed`` of ``requests``
    requests, or more where they arrive in less than ten TTFT targets (eval.capacity's
    search, as the run's conditions were measured: a shorter stream ends before a queue
    can break the TTFT target)."""
    _, factor, _ = stream_capacity(scenario, policy, 0, 1, requests, step=CAPACITY_STEP,
                                   min_duration_s=10 * scenario.slo_ttft_s, seed_base=stream_seed)
    return -math.log(max(factor, LOWEST_LOAD))


def _cost_task(scenario, episode, policy, requests) -> float:
    if requests:  # the capacity objective: the episode is its stream's seed
        return capacity_cost(scenario, episode, policy.at(scenario), requests)
    return episode_cost(scenario, episode, policy.at(scenario))


def episode_costs(base: ModelPolicy, thetas, episodes, executor=None, requests: int = 0) -> np.ndarray:
    """(candidates x episodes) costs of ``base`` with each action head of ``thetas``, every
    candidate on every episode (the same arrivals for all: paired). An episode is (scenario,
    arrivals), the environment's cost; with ``requests``, (scenario, stream seed), the
    capacity objective's (:func:`capacity_cost`)."""
    policies = [policy_with(base, t) for t in thetas]
    tasks = [(sc, w, p, requests) for p in policies for sc, w in episodes]
    found = (executor or LocalExecutor()).map(_cost_task, tasks)
    return np.asarray(found, dtype=float).reshape(len(policies), len(episodes))


def search_episodes(serving: Scenario, sampler, count: int, seed: int, objective: str,
                    streams: int) -> list[tuple]:
    """``count`` episodes of ``sampler`` drawn from ``seed`` on: (scenario, arrivals) for the
    environment's cost; for the capacity objective (scenario, stream seed), the streams
    seeded ``streams`` on."""
    drawn = draw_episodes(serving, sampler, count, seed)
    if objective == "cost":
        return drawn
    return [(sc, streams + i) for i, (sc, _) in enumerate(drawn)]


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
    """Perturbation size, in root mean squares of the head's weights (biases too take it):
    large enough that a perturbation changes some decisions (an argmax policy's cost is
    flat under small ones)."""
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
    objective: str = "cost"
    """What the search lowers: cost (the environment's episode cost, train.py's model
    selection's) or capacity (each episode's capacity under the SLO, what eval capacity
    judges; about 8 times slower)."""
    capacity_requests: int = 300
    """Requests of each stream of the capacity objective."""
    workers: int | None = None
    """Simulations at once on a local Ray instance (default: all cores; 1: in this process)."""
    seed: int = 0
    """Seed of the directions and the training episodes (iteration i's are drawn from seeds
    seed + 10,000 i on: distinct across iterations for up to 10,000 episodes each)."""

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
        require(self.objective in OBJECTIVES, "objective", self.objective,
                f"must be one of {', '.join(OBJECTIVES)}")
        integer("capacity_requests", self.capacity_requests, 20, 100_000)


PROGRESS = "search_progress.json"
"""The search's place in OUT (theta, iteration, records), for a run again after a kill."""


def _key(args: SearchArgs, run: Path, theta0: np.ndarray) -> dict:
    """What a saved place must match to be gone on from: the arguments that shape the
    search (not how many iterations it runs: a killed search may be given more), the run,
    and its start's head (a run trained again in place starts afresh)."""
    return {k: v for k, v in asdict(args).items() if k not in ("out", "workers", "iterations")} | {
        "run": str(run.resolve()), "start": hashlib.sha256(theta0.tobytes()).hexdigest()}


def _read_progress(path: Path, key: dict, size: int, iterations: int) -> tuple[dict | None, str]:
    """(the saved place of a search with the same key, or None; why none, where a file was
    there): another search's, or one damaged, starts afresh."""
    if not path.exists():
        return None, ""
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or saved.get("key") != key:
            return None, "another search's (other flags, or the run trained again)"
        theta = np.asarray(saved["theta"], dtype=float)
        it, kept = saved["iteration"], saved["kept"]
        ok = (theta.shape == (size,) and bool(np.isfinite(theta).all()) and isinstance(it, int)
              and 0 <= it <= iterations and isinstance(saved["records"], list)
              and len(saved["records"]) == it
              and (kept is None or (isinstance(kept, dict) and isinstance(kept.get("iteration"), int)
                                    and isinstance(kept.get("held_out"), (int, float)))))
        if not ok:
            return None, ("further than --iterations" if isinstance(it, int) and it > iterations
                          else "damaged")
        return {"iteration": it, "theta": theta, "records": saved["records"], "kept": kept}, ""
    except (OSError, ValueError, KeyError, TypeError):
        return None, "damaged"


SEARCH_FILES = ("best_model.zip", "best_vecnormalize.pkl", "config.json", "search.json")
"""What a search writes to OUT (and an earlier search's that a fresh one clears)."""


def check_out(out: Path, run: Path) -> None:
    """OUT may be new, or an earlier search's folder; never the run or another train.py run."""
    check_output("out", out, "folder")
    require(out.resolve() != run.resolve(), "out", str(out), "must not be the run itself")
    require(not (out / "config.json").exists() or (out / "search.json").exists()
            or (out / PROGRESS).exists(), "out", str(out),
            "holds a train.py run that no search wrote; pick another folder")


def set_head(model, theta: np.ndarray) -> None:
    """The SB3 model's action head (``action_net``: a torch Linear, weight actions x
    features) set from ``theta`` (``NumpyActor.head``'s layout: weights features x actions)."""
    import torch  # heavy: only once a model is written

    head = model.policy.action_net
    actions, features = head.weight.shape
    with torch.no_grad():
        head.weight.copy_(torch.as_tensor(theta[:features * actions].reshape(features, actions).T,
                                          dtype=head.weight.dtype))
        head.bias.copy_(torch.as_tensor(theta[features * actions:], dtype=head.bias.dtype))


def write_run(run: Path, out: Path, policy: ModelPolicy, theta: np.ndarray) -> None:
    """OUT as a run directory: the run's config and observation statistics (the same for
    every model a search writes), then its model with the action head ``theta``, replaced
    whole, last: a kill leaves the last model written or none. The start's torch model
    takes the head (the search acts with numpy actors only)."""
    shutil.copy(run / "config.json", out / "config.json")
    norm = run / ("best_vecnormalize.pkl" if (run / "best_model.zip").exists() else "vecnormalize.pkl")
    if norm.exists():
        shutil.copy(norm, out / "best_vecnormalize.pkl")
    set_head(policy.model, theta)
    tmp = out / "best_model.tmp.zip"
    policy.model.save(str(tmp))
    tmp.replace(out / "best_model.zip")


CONFIRM_EPISODES = 4
"""Fresh held-out episodes of the confirmation, in multiples of --eval-episodes: the kept
model is the best of several comparisons on the same held-out episodes, so its lead there
is biased up; a fresh set measures it without that bias."""


def episode_load(scenario: Scenario, conditions: list[dict]) -> float | None:
    """An episode's load as a multiple of its condition's capacity (None where no condition
    of the run matches its scenario)."""
    for cond in conditions:
        if all(getattr(scenario, k, None) == v for k, v in cond.items() if k != "capacity_rps") \
                and cond.get("capacity_rps"):
            return scenario.rate / cond["capacity_rps"]
    return None


def confirm(theta: np.ndarray, theta0: np.ndarray, episodes: list[tuple], conditions: list[dict],
            costs) -> dict:
    """The kept head ``theta`` against the start's on fresh held-out ``episodes``
    (SEARCH_CONFIRM_SEEDS), paired: the verdict, and on how many episodes, at which loads,
    the two decide differently at all."""
    start, found = costs([theta0, theta], episodes)
    v = paired_difference(found, start)
    differ = np.abs(found - start) > 1e-12
    loads = [x for x, d in zip((episode_load(sc, conditions) for sc, _ in episodes), differ)
             if d and x is not None]
    return {"episodes": len(episodes), "cost": float(found.mean()), "start_cost": float(start.mean()),
            "diff": round(v.rel, 4), "ci95": round(v.half, 4), "verdict": v.kind,
            "differ": int(differ.sum()),
            "loads": [round(min(loads), 3), round(max(loads), 3)] if loads else []}


def run_trace(config: dict) -> str | None:
    """The trace a run's scenario or one of its conditions replays (the capacity objective
    bisects synthetic streams only), or None."""
    return next((c["trace"] for c in (config["scenario"], *config.get("conditions", []))
                 if c.get("trace")), None)


def load_start(args: SearchArgs) -> ModelPolicy:
    """The run's kept model as the policy it serves, refused in one line where the search
    cannot perturb it or OUT is not a folder it may write."""
    run, out = Path(args.run), Path(args.out)
    config = read_config(run, "run")
    algo = config["args"].get("algo")
    require(algo in ALGOS, "run", str(run), f"was trained with {algo}; the search perturbs the "
            f"action head of {' or '.join(ALGOS)} (an actor-critic on the ladder's rungs)")
    trace = run_trace(config)
    require(args.objective == "cost" or not trace, "objective", args.objective,
            f"serves synthetic streams at any load, and this run trains on the trace {trace}: "
            "use --objective cost")
    check_out(out, run)
    policy = load_run(run)
    if policy.actor is None:
        raise ConfigError(f"run: {str(run)!r} holds a model whose network the search does not "
                          "know (an MLP actor with a linear head over the ladder's rungs)")
    return policy


def describe(objective: str, diff: float, half: float, kind: str) -> str:
    """A paired difference of costs against the start, in the objective's words: the cost's
    own units, or the capacity's change (minus the difference of the log costs)."""
    if objective == "capacity":
        word = {"falls short": "serves more", "beats": "serves less"}.get(kind, kind)
        return f"capacity {math.expm1(-diff):+.1%} (log {-diff:+.3f} ± {half:.3f}: {word})"
    return f"cost {diff:+.2f} ± {half:.2f} ({kind})"


def report(run: Path, out: Path, objective: str, kept: dict | None, confirmed: dict | None) -> None:
    """What the search found, in plain words; a kept model that fresh episodes do not
    confirm is removed from OUT."""
    less = "served more than" if objective == "capacity" else "cost less than"
    if kept is None:
        print(f"no iteration {less} the start beyond the paired interval: the search did "
              f"not beat its start; keep {run}")
        return
    c = confirmed
    print(f"iteration {kept['iteration']} {less} the start beyond the paired interval "
          f"on the held-out episodes; on {c['episodes']} fresh episodes, against the start: "
          f"{describe(objective, c['diff'], c['ci95'], c['verdict'])}; the two "
          f"{'serve a different capacity' if objective == 'capacity' else 'decide differently'} "
          f"on {c['differ']} of them"
          + (f", at {c['loads'][0]:.2f}-{c['loads'][1]:.2f} times their condition's capacity"
             if c["loads"] else ""))
    if c["verdict"] != "falls short":
        for name in SEARCH_FILES[:3]:
            (out / name).unlink(missing_ok=True)
        print(f"its lead does not hold on fresh episodes: the search did not beat its start; "
              f"keep {run}")
    else:
        print(f"{out}: measure its capacity before serving it "
              f"(python -m eval capacity --policies model:{out},...)")


def _place(out: Path, key: dict, size: int, iterations: int) -> dict | None:
    """The saved place to go on from, or None: then OUT is cleared of an earlier search's
    results (this one replaces them), saying why where a saved place was not used."""
    saved, why = _read_progress(out / PROGRESS, key, size, iterations)
    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        if why:
            print(f"{out / PROGRESS}: {why}; starting afresh", flush=True)
        for name in SEARCH_FILES:
            (out / name).unlink(missing_ok=True)
    return saved


def main(argv: list[str] | None = None) -> int:
    args = parse(SearchArgs, argv, prog="python -m agents.search")
    run, out = Path(args.run), Path(args.out)
    policy = load_start(args)
    executor = make_executor(args.workers)
    config = policy.config
    serving = Scenario(**config["scenario"])
    loads = (args.load_low, args.load_high)
    train = replace(run_sampler(config["args"], config["conditions"], 0), load_range=loads)
    held_sampler = replace(run_sampler(config["args"], config["conditions"], EVAL_SEED_BASE),
                           load_range=loads)

    def episodes(sampler, count, seed, streams):
        return search_episodes(serving, sampler, count, seed, args.objective, streams)

    def costs(thetas, eps):
        requests = args.capacity_requests if args.objective == "capacity" else 0
        return episode_costs(policy, thetas, eps, executor, requests)

    held = episodes(held_sampler, args.eval_episodes, PERIODIC_EVAL_SEEDS, SEARCH_HELD_STREAMS)
    theta0 = policy.actor.head()
    sigma = args.sigma * float(np.sqrt(np.mean(policy.actor.layers[-1][0] ** 2)))
    key = _key(args, run, theta0)
    saved = _place(out, key, theta0.size, args.iterations)
    start = costs([theta0], held)[0]
    figure = (f"capacity {math.exp(-start.mean()):.2f} times the episodes' loads (geometric mean)"
              if args.objective == "capacity" else f"cost {start.mean():.2f}")
    print(f"the start ({run}): {figure} on {len(held)} held-out episodes; searching "
          f"{theta0.size:,} weights of its action head", flush=True)
    theta, first, records, kept = theta0, 0, [], None
    if saved is not None:
        theta, first, records, kept = saved["theta"], saved["iteration"], saved["records"], saved["kept"]
        print(f"going on from iteration {first} ({out / PROGRESS})", flush=True)
    t0 = time.time()
    for it in range(first, args.iterations):
        seed = args.seed + 10_000 * (it + 1)  # below EVAL_SEED_BASE: training streams
        theta, rec = search_step(theta, costs, episodes(train, args.episodes, seed, seed),
                                 args.directions, sigma, args.step, np.random.default_rng([args.seed, it]))
        rec["iteration"] = it + 1
        if (it + 1) % args.check_every == 0 or it + 1 == args.iterations:
            c = costs([theta], held)[0]
            v = paired_difference(c, start)
            rec.update(held_out=round(float(c.mean()), 4), vs_start=round(v.rel, 4),
                       vs_start_ci95=round(v.half, 4), verdict=v.kind)
            print(f"  iteration {it + 1}: held-out, against the start: "
                  f"{describe(args.objective, v.rel, v.half, v.kind)}; {time.time() - t0:.0f} s", flush=True)
            if v.kind == "falls short" and (kept is None or c.mean() < kept["held_out"]):
                kept = {"iteration": it + 1, "held_out": float(c.mean()), "theta": theta.tolist()}
                write_run(run, out, policy, theta)
        records.append(rec)
        write_json_atomic(out / PROGRESS, {"key": key, "iteration": it + 1, "theta": theta.tolist(),
                                           "records": records, "kept": kept})
    confirmed = None if kept is None else confirm(
        np.asarray(kept["theta"]), theta0,
        episodes(held_sampler, CONFIRM_EPISODES * args.eval_episodes, SEARCH_CONFIRM_SEEDS,
                 SEARCH_CONFIRM_SEEDS), config["conditions"], costs)
    write_json_atomic(out / "search.json", {
        "args": asdict(args), "start_cost": float(start.mean()), "start_costs": start.tolist(),
        "kept": None if kept is None else {k: v for k, v in kept.items() if k != "theta"},
        "confirmed": confirmed, "iterations": records})
    (out / PROGRESS).unlink(missing_ok=True)
    report(run, out, args.objective, kept, confirmed)
    return 0


if __name__ == "__main__":
    run_cli(main)
