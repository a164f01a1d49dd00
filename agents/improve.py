"""Approximate policy iteration: the learned policy imitates the rollout over itself.

    python -m agents.improve --run RUN_DIR --out runs/api --rounds 2

A round: the current model, as the policy it serves (``policies.learned.ModelPolicy``),
is the base of a rollout (by default ``policies.reference.SampledRolloutPolicy``, blind to
the stream's own future); the rollout serves training episodes, and every pass's
observation is recorded with the action the rollout's choice takes there (its fraction
of the ITL target, as the nearest rung of the model's ladder). The model is then trained
by maximum likelihood on every round's decisions so far (dataset aggregation, as in
DAgger: Ross et al. 2011) plus anchor states that keep its own action, and the next
round rolls out over the model so trained. This is rollout-based policy iteration with a
classifier as the policy (Lagoudakis and Parr, ICML 2003; Bertsekas, "Rollout, Policy
Iteration, and Distributed Reinforcement Learning", 2020): each round's labels improve on
the base they roll out over, judged as capacity judges (deadlines missed and slow tokens
beyond the p99 allowance), not by the training reward. Each round's model is compared
with the start on the run's held-out episodes, paired, and the command says whether any
beat it. docs/learning.md ("Learning from the rollout") has what it gained: nothing, so far.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from envs.cli import parse
from envs.episodes import draw_episodes
from envs.errors import integer, number, require, run_cli
from envs.files import write_json_atomic
from envs.scenario import Scenario
from envs.seeds import EVAL_SEED_BASE, PERIODIC_EVAL_SEEDS

from envs.actions import FRACTION_LADDER
from eval.harness import paired_difference, run_policy
from eval.parallel import LocalExecutor, make_executor
from agents.setup import fit_actions
from policies.baselines import TimeBudgetPolicy
from policies.learned import load_run, run_sampler
from policies.reference import HORIZON_TTFT, RolloutPolicy, SampledRolloutPolicy
from policies.specs import make_policy


FUTURES = 2
"""Sampled futures per re-plan (``SampledRolloutPolicy``): labels from the stream's own
future would teach the policy to act on arrivals it cannot see."""


CANDIDATES = ("all", "rules")
"""The rollout's candidates: the ladder's fractions held per pass and the export's rules
(all), or the rules alone."""


@dataclass(frozen=True)
class Rollout:
    """The rollout that labels the states: its horizon in TTFT targets, its sampled
    futures per re-plan (0: the stream's own future, which the policy cannot see), its
    candidates, and the margin a deviation must score by to be labelled (requests' worth)."""

    horizon_ttft: float = HORIZON_TTFT
    futures: int = FUTURES
    candidates: str = "all"
    min_margin: float = 0.0

    def over(self, base, scenario) -> RolloutPolicy:
        """The rollout over ``base``, a policy serving ``scenario``."""
        itl = scenario.slo_itl_s
        pool = [] if self.candidates == "rules" else [TimeBudgetPolicy(itl, f) for f in FRACTION_LADDER]
        pool += [make_policy(r, scenario) for r in RolloutPolicy.RULES]
        kw = dict(horizon_s=self.horizon_ttft * scenario.slo_ttft_s, name=f"rollout over {base.name}")
        policy = (SampledRolloutPolicy(scenario.slo(), base, pool, futures=self.futures, **kw)
                  if self.futures else RolloutPolicy(scenario.slo(), base, pool, **kw))
        return policy.limit_pass(scenario)


class RolloutLabels:
    """Serves with the rollout reference over a model policy and records, every pass, the
    raw observation and the ladder index of the reference's choice there: the model's own
    action where the reference keeps its base, a held fraction's rung, or the rung nearest
    to the fraction a rule picks (within the cap)."""

    def __init__(self, reference: RolloutPolicy, base, min_margin: float = 0.0):
        self.reference, self.base, self.min_margin = reference, base, min_margin
        self.name, self.kind = (reference.name, reference.kind) if reference else (base.name, base.kind)
        self.ladder = np.log(np.asarray(base.ladder, dtype=float))
        self.obs: list[np.ndarray] = []
        self.labels: list[int] = []
        self.deviations = 0

    def reset(self) -> None:
        if self.reference is not None:
            self.reference.reset()

    def observer(self, policy):
        """``policy`` serving as it is, each pass's raw observation recorded here."""
        def serve(state):
            self.obs.append(self.base.raw_observation(state))
            return policy(state)
        serve.name, serve.kind, serve.reset = policy.name, policy.kind, policy.reset
        return serve

    def rung(self, fraction: float) -> int:
        if self.base.max_pass is not None:
            fraction = min(fraction, self.base.max_pass)
        return int(np.argmin(np.abs(self.ladder - np.log(fraction))))

    def __call__(self, state) -> int:
        budget = self.reference(state)
        raw = self.base.raw_observation(state)
        choice = self.reference._choice
        if choice is self.base or self.reference.margin < self.min_margin:
            label = self.base.actions_of(raw[None, :])[0]
        else:
            self.deviations += 1
            if isinstance(choice, TimeBudgetPolicy) and type(choice) is TimeBudgetPolicy:
                label = self.rung(choice.fraction)
            else:
                label = self.rung(float(choice.observed_fractions(raw[None, :])[0]))
        self.obs.append(raw)
        self.labels.append(int(label))
        return budget


def _label_task(scenario, workload, base, rollout: Rollout):
    policy = base.at(scenario)
    rec = RolloutLabels(rollout.over(policy, scenario), policy, rollout.min_margin)
    run_policy(scenario, rec, [workload])
    return np.asarray(rec.obs, dtype=np.float32), np.asarray(rec.labels, dtype=np.int64), rec.deviations


def rollout_decisions(base, episodes, rollout: Rollout = Rollout(), executor=None,
                      progress=None) -> tuple[np.ndarray, np.ndarray, float]:
    """(raw observations, ladder labels, the share of passes where the rollout's choice was
    labelled over its base's) of ``episodes`` (scenario, arrivals each) served by the
    rollout over ``base`` (a ModelPolicy)."""
    found = (executor or LocalExecutor()).map(
        _label_task, [(sc, w, base, rollout) for sc, w in episodes], progress)
    obs = np.concatenate([f[0] for f in found])
    labels = np.concatenate([f[1] for f in found])
    return obs, labels, sum(f[2] for f in found) / max(len(labels), 1)


def _served_task(scenario, workload, base):
    policy = base.at(scenario)
    rec = RolloutLabels(None, policy)
    run_policy(scenario, rec.observer(policy), [workload])
    return np.asarray(rec.obs, dtype=np.float32)


def served_states(base, episodes, executor=None, progress=None) -> np.ndarray:
    """The raw observations of every pass of ``episodes`` served by ``base`` itself."""
    found = (executor or LocalExecutor()).map(
        _served_task, [(sc, w, base) for sc, w in episodes], progress)
    return np.concatenate(found)


def improve(model, base, episodes_per_round, rounds: int, anchor=None,
            rollout: Rollout = Rollout(), seed: int = 0, executor=None, progress=None,
            log=print, on_round=None) -> list[dict]:
    """``rounds`` of approximate policy iteration on ``model`` (an SB3 model whose policy
    ``base``, a ModelPolicy, serves; its observation normalisation stays as it is).
    ``episodes_per_round(r)`` gives round ``r``'s training episodes. ``anchor`` (raw
    observations of states the policy serves, :func:`served_states`) keeps what the model
    does where no rollout looked: each round they are labelled with the model's own
    action before the fit, so the fit changes it only where the rollouts' labels pull
    (without them, a round fitted on a few episodes forgets the conditions those
    episodes missed). Returns a record per round (decisions, the share where the
    reference deviated, the fit's agreement on all labels and on the deviations); the
    model's weights after the last round are the result, and ``base`` acts with them.
    ``on_round(record)``, where given, is called after each round's fit."""
    def norm(raw):
        return base.obs_norm(raw) if base.obs_norm is not None else np.asarray(raw, np.float32)

    has_anchor = anchor is not None and len(anchor) > 0
    raws, ys, devs, out = [], [], [], []
    for r in range(rounds):
        obs, labels, deviated = rollout_decisions(base, episodes_per_round(r), rollout,
                                                  executor, progress)
        raws.append(obs)
        ys.append(labels)
        devs.append(labels != base.actions_of(obs))
        x, y = norm(np.concatenate(raws)), np.concatenate(ys)
        if has_anchor:
            x = np.concatenate([x, norm(anchor)])
            y = np.concatenate([y, base.actions_of(anchor)])
        fit_actions(model.policy, x, y, seed=seed + r)
        base.refresh()
        dev, pred = np.concatenate(devs), base.actions_of(np.concatenate(raws))
        agree = float(np.mean(pred == np.concatenate(ys)))
        agree_dev = float(np.mean(pred[dev] == np.concatenate(ys)[dev])) if dev.any() else 1.0
        out.append({"round": r + 1, "decisions": int(len(labels)), "deviated": round(deviated, 4),
                    "changed": round(float(np.mean(devs[-1])), 4),
                    "agreement": round(agree, 4), "agreement_changed": round(agree_dev, 4)})
        log(f"round {r + 1}: {len(labels):,} decisions, the reference left its base on "
            f"{deviated:.1%} (a different rung on {np.mean(devs[-1]):.1%}); the model now "
            f"takes all rounds' labels on {agree:.1%}, the changed ones on {agree_dev:.1%}")
        if on_round is not None:
            on_round(out[-1])
    return out


@dataclass(frozen=True)
class ImproveArgs:
    """Approximate policy iteration on a train.py run: the run's kept model imitates the
    rollout over itself, round by round; each round's model is written as a run directory
    that model:DIR, eval and export read."""

    run: str = ""
    """The train.py run directory whose kept model starts (required)."""
    out: str = ""
    """Folder for the rounds' run directories, OUT/round1, OUT/round2, ... (required)."""
    rounds: int = 2
    """Rounds of rollout labels and refitting."""
    episodes: int = 36
    """Training episodes the rollout serves per round (the run's conditions, at 0.7-1.5
    times their capacity, where deviations can pay)."""
    anchor_episodes: int = 48
    """Episodes of the run's own distribution whose states keep the model's own action."""
    horizon_ttft: float = HORIZON_TTFT
    """The rollout's horizon in TTFT targets."""
    min_margin: float = 0.0
    """Label a deviation only where it scored this much better than the model (requests' worth)."""
    candidates: str = field(default="all", metadata={"choices": list(CANDIDATES)})
    """The rollout's candidates: the ladder's fractions and the rules (all), or the rules alone."""
    futures: int = FUTURES
    """Sampled stretches of the stream per re-plan; 0 rolls out on the stream's own future,
    which the policy cannot see (a clairvoyant teacher)."""
    eval_episodes: int = 24
    """Held-out episodes each round's model is compared on with the start, paired."""
    workers: int | None = None
    """Simulations at once on a local Ray instance (default: all cores; 1: in this process)."""
    seed: int = 0
    """Seed of the rounds' episodes and fits."""

    def __post_init__(self) -> None:
        for name in ("run", "out"):
            require(bool(getattr(self, name)), name, getattr(self, name), "is required: a folder")
        integer("rounds", self.rounds, 1, 50)
        integer("episodes", self.episodes, 1, 10_000)
        integer("anchor_episodes", self.anchor_episodes, 0, 10_000)
        integer("eval_episodes", self.eval_episodes, 2, 1000)
        number("horizon_ttft", self.horizon_ttft, 0.25, 100.0)
        number("min_margin", self.min_margin, 0.0, 1000.0)
        integer("futures", self.futures, 0, 64)
        integer("seed", self.seed, 0, 2**31 - 1)


TRAIN_LOADS = (0.7, 1.5)
"""Loads (times a condition's capacity) of the rounds' episodes: below them the rollout
finds nothing to change."""


def main(argv: list[str] | None = None) -> int:
    from agents.callbacks import evaluate_model  # stable-baselines3: heavy

    args = parse(ImproveArgs, argv, prog="python -m agents.improve")
    run, out = Path(args.run), Path(args.out)
    policy = load_run(run)
    config = policy.config
    serving = Scenario(**config["scenario"])
    sampler = run_sampler(config["args"], config["conditions"], 0)
    held = draw_episodes(serving, replace(run_sampler(config["args"], config["conditions"], EVAL_SEED_BASE),
                                          load_range=(0.9, 1.3)), args.eval_episodes, PERIODIC_EVAL_SEEDS)
    executor = make_executor(args.workers)

    def costs():
        return np.asarray(evaluate_model(policy.model, policy.obs_norm, held, policy.ladder,
                                         policy.actions, policy.action_type)[1])

    start = costs()
    print(f"the start ({run}): cost {start.mean():.2f} on {len(held)} held-out episodes", flush=True)
    anchor = None
    if args.anchor_episodes:
        anchor = served_states(policy, draw_episodes(serving, sampler, args.anchor_episodes,
                                                     args.seed + 5000), executor)
    records = []
    t0 = time.time()

    def on_round(rec):
        c = costs()
        v = paired_difference(c, start)
        rec.update(cost=round(float(c.mean()), 4), vs_start=round(v.rel, 4), vs_start_ci95=round(v.half, 4),
                   verdict=v.kind, seconds=round(time.time() - t0, 1))
        print(f"  round {rec['round']}: cost {c.mean():.2f}, against the start {v.rel:+.2f} ± "
              f"{v.half:.2f} ({v.kind}); {rec['seconds']:.0f} s", flush=True)
        d = out / f"round{rec['round']}"
        d.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "best_vecnormalize.pkl", "vecnormalize.pkl"):
            if (run / name).exists():
                shutil.copy(run / name, d / name)
        policy.model.save(str(d / "best_model.zip"))
        records.append(rec)
        write_json_atomic(out / "improve.json", {"args": asdict(args), "start_cost": float(start.mean()),
                                                 "rounds": records})

    train = replace(sampler, load_range=TRAIN_LOADS)
    improve(policy.model, policy,
            lambda r: draw_episodes(serving, train, args.episodes, args.seed + 10_000 * (r + 1)),
            args.rounds, anchor, Rollout(args.horizon_ttft, args.futures, args.candidates,
                                         args.min_margin), args.seed, executor, on_round=on_round)
    better = [r for r in records if r["verdict"] == "falls short"]  # costs less than the start
    if better:
        kept = min(better, key=lambda r: r["cost"])
        print(f"round {kept['round']} costs less than the start beyond the paired interval: "
              f"{out / ('round%d' % kept['round'])}; measure its capacity before serving it "
              f"(python -m eval capacity --policies model:DIR,...)")
    else:
        print(f"no round cost less than the start beyond the paired interval: the learning did "
              f"not beat its start; keep {run}")
    return 0


if __name__ == "__main__":
    run_cli(main)
