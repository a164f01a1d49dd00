"""Train a budget policy with stable-baselines3 and compare it with the best fixed budget.

    python train.py                                  # PPO, h100-sxm + llama-3-8b
    python train.py --hardware a100-80g --run-dir runs/a100
    python train.py --resume runs/a100               # continue from the last checkpoint
    tensorboard --logdir runs

The policy acts in time: each pass's budget is a fraction of the ITL target, turned
into tokens with the cost model and that pass's decodes. It trains across conditions
of one hardware and model (prompt mixes, bursts, per-pass overheads of 0-5 ms, tight
and ample KV caches, SLO pairs), each loaded at 0.5-1.5 times its capacity, with the SLO
itself as reward. Before training, it checks that the reward ranks fixed choices as
their capacity does and that a reference controller finds room beyond the best fixed
choice; it starts from that choice. Afterwards it measures the policy's capacity under
the SLO on held-out arrivals against the best fixed budget on a fine ladder, the
time-budget rule and vLLM's default, and says which of DESIGN.md's two jobs it shows.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from agents.checks import (capacity_pick, condition_capacities, condition_teachers, constant_costs,
                           ranking_check, room_check, teacher_choice)
from agents.conditions import MIN_CAPACITY_RPS, draw_conditions, held_out, trained, with_capacities
from agents.setup import ACTION_TYPES, imitate, make_model
from agents.summary import (STARTED_FROM, final_comparison, final_figures, final_policies,
                            mixed_start, run_answer, selection_sentence, summary_text,
                            teacher_words)
from envs.actions import DEFAULT_LADDER, FRACTION_LADDER
from envs.cli import given_fields, parse
from envs.deployment import HELD_OUT_DEPLOYMENTS, TRAINING_DEPLOYMENTS, feature_range
from envs.episodes import draw_episodes
from envs.errors import ConfigError, integer, number, require, run_cli
from envs.files import check_output, write_atomic, write_json_atomic
from envs.scenario import WORKLOADS, Scenario, ScenarioArgs
from envs.seeds import EVAL_SEED_BASE, PERIODIC_EVAL_SEEDS
from envs.workload import check_num_requests
from eval.capacity_report import figure_count
from eval.parallel import make_executor, progress_bar
from eval.report import cap_words, git_commit
from policies.learned import check_observations, load_run, read_config, run_sampler
from policies.specs import make_policy

# stable-baselines3's modules (a few seconds to import) load once the arguments are known
# good: a bad flag or --help answers at once.


SERVING = "mixed-bursty"
"""The serving scenario's named workload by default (envs.scenario.WORKLOADS)."""


@dataclass(frozen=True)
class Args(ScenarioArgs):
    """Train a budget policy on simulated serving conditions.

    The serving scenario is every flag of envs.scenario.Scenario (hardware, model, SLO,
    engine settings, traffic), its traffic from --workload unless a traffic flag says
    otherwise: the final comparison's scenario, and training's with --conditions 0."""

    workload: str = SERVING
    """The serving scenario's named workload (envs/scenario.py's WORKLOADS): the defaults of
    its traffic flags (trace, rate, arrival, burstiness, prompt, output); each such flag
    given overrides it."""
    rate: float = WORKLOADS[SERVING]["rate"]
    """Synthetic: the serving scenario's mean arrival rate, requests per second (--workload's)."""
    arrival: str = field(default=WORKLOADS[SERVING]["arrival"],
                         metadata={"choices": ["poisson", "gamma", "onoff"]})
    """Synthetic: the serving scenario's arrival process (--workload's)."""
    burstiness: float = WORKLOADS[SERVING]["burstiness"]
    """Synthetic: gamma shape for arrival=gamma (1 is Poisson, below 1 burstier; --workload's)."""
    exp_name: str = "chunkpilot"
    """Name of the experiment (part of the run directory's name)."""
    algo: str = field(default="ppo", metadata={"choices": ["ppo", "dqn", "a2c", "sac"]})
    """stable-baselines3 algorithm; sac trains on a continuous log-scale action."""
    seed: int = 1
    """Seed of the model, the conditions and the training episodes (the held-out streams
    have seeds of their own)."""
    total_timesteps: int = 500_000
    """Decision intervals to train on (all environments together)."""
    n_envs: int = 8
    """Parallel environments (vectorised)."""
    vec_env: str = field(default="dummy", metadata={"choices": ["dummy", "subproc"]})
    """Run the environments in this process (dummy) or in worker processes (subproc)."""
    conditions: int = 32
    """Training conditions drawn for this hardware and model (agents/conditions.py); 0 trains
    on the serving scenario alone."""
    all_deployments: bool = False
    """Train one policy across deployments (envs/deployment.py's TRAINING_DEPLOYMENTS:
    hardware presets, model sizes and tensor-parallel degrees, each condition's bandwidth
    and FLOP/s perturbed), observing each one's cost model against its SLO; the held-out
    deployments (h200, l40s, llama-3-70b-tp4 on h100-sxm, a made-up part) never enter
    training or model selection. The serving scenario must be a trained deployment."""
    load_low: float = 0.5
    """Lowest load drawn per episode, as a multiple of the condition's capacity."""
    load_high: float = 1.5
    """Highest load drawn per episode, as a multiple of the condition's capacity."""
    episode_s: float = 60.0
    """Simulated seconds of arrivals per training episode."""
    actions: str = field(default="time", metadata={"choices": ["time", "tokens"]})
    """Act in time (a fraction of the ITL target per pass) or in tokens (a budget ladder)."""
    decision_interval_s: float | None = None
    """Simulated seconds an action holds (default: a twentieth of the TTFT target)."""
    learning_rate: float | None = None
    """Learning rate (default: the algorithm's setup in agents/setup.py)."""
    n_steps: int | None = None
    """Rollout length per environment for PPO/A2C (default: agents/setup.py's)."""
    gamma: float = 0.975
    """Discount per decision interval: 0.975 looks about 40 intervals (two TTFT targets) ahead."""
    net_arch: str = "64,64"
    """Hidden layer sizes of the policy and value networks."""
    checks: bool = True
    """Before training, check the reward's ranking of fixed choices and the room beyond them."""
    clone_decisions: int = 20_000
    """Decisions of the teacher the policy is cloned on before learning (agents.setup.imitate),
    at most: a run of fewer timesteps clones on 4 times its timesteps (a smoke run of 2,048
    steps on 8,192), where cloning would otherwise take most of its time; 0 clones nothing."""
    condition_teachers: bool = True
    """Start from each training condition's best fixed choice (agents.checks.condition_teachers;
    with --all-deployments, DEPLOYMENT_TEACHERS' member that serves it most), not from the one
    best overall."""
    teacher_streams: int = 6
    """With --all-deployments: the streams of 200 requests (1-50) over whose mean each
    condition's teacher is picked by capacity; each stream adds a capacity search per
    member and condition."""
    teacher_tie: float = 0.01
    """With --all-deployments: capacities within this fraction (0.01 = 1%; 0-0.5) of a
    condition's highest count as tied, and the tie goes to the shortest passes
    (time-budget-deadline-kv:4, then :8, then :16). Each stream's capacity is searched to
    2%, and the mean over --teacher-streams streams more finely (docs/learning.md, "One
    policy for every deployment")."""
    teacher: str | None = None
    """The overall teacher (default: the checks' pick): a policy spec among the checks'
    fixed choices that act in time (time-budget:0.25 ... time-budget:1, and train.py's
    CHECK_RULES: time-budget-kv:1, time-budget-deadline:16, ...), with --actions time;
    conditions still get their own where they beat it (with --all-deployments every
    condition gets its own, and this is the rule the summary compares with)."""
    eval_every: int = 50_000
    """Evaluate on held-out episodes every this many steps (TensorBoard eval/*)."""
    eval_episodes: int = 24
    """Held-out episodes per periodic evaluation (the model selection's yardstick), each
    loaded at 0.9-1.3 times its condition's capacity, where choices decide the SLO."""
    final_seeds: int = 5
    """Streams per capacity in the final comparison. A 95% interval over 3 streams is 4.3
    standard errors (Student's t), over 5 2.8: with 3, a 10% difference is often a tie."""
    final_requests: int = 600
    """Requests per stream in the final comparison."""
    workers: int | None = None
    """Sweeps (capacities, checks, the final comparison) on a local Ray instance with this many
    CPUs (default: all cores; 1: in this process)."""
    ray_address: str | None = None
    """Run the sweeps on an existing Ray cluster instead."""
    checkpoint_every: int = 100_000
    """Save a checkpoint every this many steps."""
    run_dir: str | None = None
    """Run directory (default: runs/<exp>__<algo>__<hardware>__<model>__<seed>__<time>)."""
    resume: str | None = None
    """Continue a run directory from its latest loadable checkpoint (its config decides the
    scenario and algorithm)."""
    progress_bar: bool = True
    """Show a progress bar while training."""
    torch_threads: int = 1
    """Threads for torch (small networks run fastest on one)."""

    def validate(self) -> None:
        """Every argument in range before any work starts (one line naming it otherwise;
        the scenario's fields are checked as the arguments are made)."""
        integer("total_timesteps", self.total_timesteps, 1, 10**10)
        for f, high in (("n_envs", 256), ("eval_episodes", 1000), ("final_seeds", 50),
                        ("torch_threads", 256), ("conditions", 1000), ("clone_decisions", 10**7),
                        ("teacher_streams", 50)):
            integer(f, getattr(self, f), 0 if f in ("conditions", "clone_decisions") else 1, high)
        for f in ("eval_every", "checkpoint_every"):
            integer(f, getattr(self, f), 1, 10**10)
        integer("seed", self.seed, 0, 2**31 - 1)
        check_num_requests("final_requests", self.final_requests)
        if self.n_steps is not None:
            integer("n_steps", self.n_steps, 1, 10**6)
        if self.learning_rate is not None:
            number("learning_rate", self.learning_rate, 0, 1, low_open=True)
        if self.decision_interval_s is not None:
            number("decision_interval_s", self.decision_interval_s, 0, 3600)
        number("load_low", self.load_low, 0, 100, low_open=True)
        number("load_high", self.load_high, self.load_low, 100)
        number("episode_s", self.episode_s, 0, 86400, low_open=True)
        number("gamma", self.gamma, 0, 1, low_open=True)
        number("teacher_tie", self.teacher_tie, 0, 0.5)
        if self.teacher is not None:
            require(self.teacher_spec() in TEACHER_NAMES, "teacher", self.teacher,
                    f"must be one of {', '.join(TEACHER_NAMES)}")
            require(self.actions == "time", "teacher", self.teacher,
                    "needs --actions time (a teacher acts in time)")
        if self.all_deployments:
            why = ("is held out of --all-deployments (it is where the policy is measured, never "
                   "trained)" if held_out(self.hardware, self.model) else
                   "is not a deployment --all-deployments trains on")
            require(trained(self.hardware, self.model), "hardware", self.hardware,
                    f"with --model {self.model} {why}; serve a trained one: "
                    + ", ".join(f"{h} + {m}" for h, m in TRAINING_DEPLOYMENTS))
            require(not self.trace, "trace", self.trace, "is not used with --all-deployments (its "
                    "conditions are synthetic streams on each deployment)")
            require(self.conditions > 0, "conditions", self.conditions,
                    "must be > 0 with --all-deployments (the deployments are drawn as conditions)")
        require(self.max_pass_itl is None or self.actions == "time", "max_pass_itl",
                self.max_pass_itl, "needs --actions time (a token table cannot hold a cap on "
                "the pass's time)")
        self.layers()

    def teacher_spec(self) -> str | None:
        """The given teacher's spec as a policy names itself (``time-budget-deadline:4`` is
        ``time-budget-deadline``)."""
        if not self.teacher:
            return None
        try:
            return make_policy(self.teacher, self.scenario()).name
        except ConfigError:
            return self.teacher  # not a spec: validate refuses it, naming the field

    def layers(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(x) for x in self.net_arch.split(","))
        except ValueError:
            sizes = ()
        require(bool(sizes) and all(0 < s <= 4096 for s in sizes) and len(sizes) <= 8, "net_arch",
                self.net_arch[:60], "must be 1-8 comma-separated layer sizes in [1, 4096], e.g. 64,64")
        return sizes

    def scenario(self) -> Scenario:
        """The serving scenario (its synthetic stream's own seed stays the scenario's
        default: this seed is the model's)."""
        return Scenario(**{**self.fields_dict(), "seed": Scenario.seed})


# A resumed run takes these from its config.json; anything else given differently is refused.
RUN_FIELDS_ON_RESUME = ("total_timesteps", "resume", "run_dir", "progress_bar", "workers",
                        "ray_address", "torch_threads", "vec_env", "eval_every", "checkpoint_every")


RUN_FIELDS_KEPT = ("total_timesteps", "eval_every", "checkpoint_every")
"""Run-control flags a resume records in the run's config.json as its own."""


FIELDS_ADDED = {"teacher": None, "clone_decisions": 20_000, "max_pass_itl": None,
                "teacher_streams": 2, "teacher_tie": 0.02,
                "all_deployments": False}
"""Fields newer than some runs, with the value an older run behaved as: its resume takes it."""


def resumed_args(args: Args, argv: list[str] | None) -> tuple[Args, dict]:
    """The run's own arguments (from its config.json), with only the run-control flags of
    this command line applied; a conflicting flag is refused, naming it."""
    config = read_config(args.resume, "resume")
    saved = {**FIELDS_ADDED, **config["args"]}
    missing = [f for f in Args.__dataclass_fields__ if f not in saved and f not in RUN_FIELDS_ON_RESUME]
    if missing:
        raise ConfigError(f"resume: {str(Path(args.resume) / 'config.json')!r} has no {missing[0]!r} "
                          f"in its args{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                          "written by another version, or edited")
    given = given_fields(Args, sys.argv[1:] if argv is None else argv)
    if "run_dir" in given and Path(args.run_dir) != Path(args.resume):
        raise ConfigError(f"run_dir: got {args.run_dir!r}, not used with --resume: the run goes on "
                          f"in {args.resume!r}; copy that folder to continue it elsewhere")
    for name in sorted(given - set(RUN_FIELDS_ON_RESUME)):
        value = getattr(args, name)
        if name in saved and value != saved[name]:
            was = (f"without --{name.replace('_', '-')}" if saved[name] is None
                   else f"with {saved[name]!r}")
            raise ConfigError(f"{name}: got {value!r}, but the run being resumed was trained "
                              f"{was}; drop the flag or start a new run")
    # The run's own values, run-control flags included (its checkpoint and evaluation
    # periods, its total), except those this command line sets.
    merged = {**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__},
              **{k: getattr(args, k) for k in RUN_FIELDS_ON_RESUME if k in given or k not in saved}}
    merged["resume"] = args.resume
    # A raised total or new periods become the run's own: a later bare --resume (the one
    # an interrupted run suggests) continues to them.
    kept = {k: merged[k] for k in RUN_FIELDS_KEPT if k in given and saved.get(k) != merged[k]}
    if kept:
        config["args"] = {**saved, **kept}
        write_json_atomic(Path(args.resume) / "config.json", config)
    return Args(**merged), config


SMOKE_TIMESTEPS = 20_000
"""A fresh run asked for fewer timesteps is a smoke run: it checks that the pipeline works,
and measures less (:data:`SMOKE`) so that it ends within a minute on 2 cores."""
SMOKE = {"conditions": 8, "checks": False, "final_seeds": 3, "final_requests": 300}
"""What a smoke run measures less of, each unless its flag is given: 8 training conditions
(measuring 32 takes most of a smoke run's time), no ranking, per-condition teacher or
room checks (the fixed choice of lowest cost is the teacher), and the final comparison on
3 streams of 300 requests."""


def smoke_args(args: Args, argv: list[str] | None) -> tuple[Args, list[str]]:
    """(the arguments of a smoke run, the notes saying what it left out): a fresh run below
    :data:`SMOKE_TIMESTEPS` takes :data:`SMOKE`'s values for the flags not given."""
    if args.resume or args.total_timesteps >= SMOKE_TIMESTEPS:
        return args, []
    given = given_fields(Args, sys.argv[1:] if argv is None else argv)
    less = {k: v for k, v in SMOKE.items() if k not in given and getattr(args, k) != v
            and not (k == "conditions" and args.conditions < v)}
    if not less:
        return args, []
    left = []
    if "conditions" in less:
        left.append(f"{less['conditions']} training conditions instead of {args.conditions}")
    if "checks" in less:
        left.append("no ranking, per-condition teacher or room checks")
    if "final_seeds" in less or "final_requests" in less:
        left.append(f"the final comparison on {less.get('final_seeds', args.final_seeds)} streams of "
                    f"{less.get('final_requests', args.final_requests)} requests")
    flags = ", ".join(f"--{k.replace('_', '-')}" for k in less)
    note = (f"A smoke run (--total-timesteps under {SMOKE_TIMESTEPS:,}): {'; '.join(left)}. It shows "
            f"that the pipeline works, not what to serve; give {flags} to measure more.")
    return replace(args, **less), [note]


def prepare_run(args: Args) -> Path:
    """The run directory, created; refused when it is a file or already holds another run."""
    if args.resume:
        return Path(args.resume)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{args.exp_name}__{args.algo}__{Path(args.hardware).stem}__"
                                   f"{Path(args.model).stem}__{args.seed}__{stamp}")
    check_output("run_dir", run_dir, "folder")
    require(not (run_dir / "config.json").exists(), "run_dir", str(run_dir),
            "already holds a run: continue it with --resume, or pick another --run-dir")
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run_dir: cannot create {str(run_dir)!r} ({err.strerror})") from None
    return run_dir


def draw_training_conditions(args: Args, scenario: Scenario, executor) -> list[dict]:
    if not args.conditions or scenario.trace:
        return []
    drawn = draw_conditions(scenario, args.conditions, args.seed,
                            TRAINING_DEPLOYMENTS if args.all_deployments else None)
    print(f"measuring the capacity of {len(drawn)} training conditions ...", flush=True)
    with progress_bar(len(drawn) * 2, "conditions") as bar:
        kept = with_capacities(scenario, drawn, executor=executor, progress=bar)
    if len(kept) < len(drawn):
        print(f"dropped {len(drawn) - len(kept)} of {len(drawn)} conditions: under "
              f"{MIN_CAPACITY_RPS:g} req/s of capacity under their SLO, the budget hardly matters"
              + ("; training on the scenario alone, at its own load" if not kept else ""))
    return kept


def make_sampler(args: Args, conditions: list[dict], stream_seed_base: int = 0):
    return run_sampler(args, conditions, stream_seed_base)


SELECTION_LOADS = (0.9, 1.3)
"""Loads (times a condition's capacity) of the model selection's held-out episodes."""
CHECK_FRACTIONS = tuple(f"time-budget:{f:g}" for f in (0.25, 0.3536, 0.5, 0.7071, 0.8409, 0.917, 1.0))
CHECK_RULES = ("time-budget-kv:0.917", "time-budget-kv:1", "time-budget-few:1", "time-budget-slack",
               "time-budget-slack:16", "time-budget-slack-kv", "time-budget-slack-kv:16",
               "time-budget-deadline", "time-budget-deadline:16", "time-budget-deadline-kv",
               "time-budget-deadline-kv:16")
"""Fixed choices the checks compare, by their specs (policies/specs.py): fractions of the
ITL target, the same shrinking as the KV cache fills (-kv) or growing when few decodes run
(-few), up to 4x and 16x the target while the p99 ITL slack lasts (-slack), the same over
the KV-aware rule (-slack-kv), only while the prefill queue is due late (-deadline), the
same stepping down as the KV cache fills (-deadline-kv), and static budgets; the best of
them is the policy's teacher."""
TEACHER_NAMES = (*CHECK_FRACTIONS, *CHECK_RULES)
"""The fixed choices that act in time: the checks' fractions and rules (``--teacher``)."""
CONDITION_TEACHERS = ("time-budget:1", *CHECK_RULES)
"""The fixed choices each training condition's teacher is picked from..."""
CONDITION_EPISODES = 4
"""...on this many episodes of that condition, loaded at SELECTION_LOADS."""
DEPLOYMENT_TEACHERS = tuple(f"time-budget-deadline-kv:{top}" for top in (4, 8, 16))
"""With --all-deployments, each condition's teacher is the member of this family that
serves it most requests/s (agents.checks.capacity_pick), the mean over --teacher-streams
streams of 200 requests: the member that serves moves with the deployment, and an
episode's cost misranks them there. Ties (within --teacher-tie) go to the first, the
shortest passes: the same capacity with shorter stalls for the running users (on the
L40S TOP 4's worst gap at capacity is 400 ms, TOP 16's 1,322 ms; docs/learning.md, "One
policy for every deployment")."""
CHECK_STATICS = (256, 512, 1024, 2048, 4096, 8192)



def pretraining_checks(args: Args, scenario: Scenario, conditions: list[dict], executor) -> dict:
    """The reward's ranking of fixed choices against their capacity, and the room a
    reference controller finds beyond the best of them (see agents/checks.py)."""
    sampler = make_sampler(args, conditions, EVAL_SEED_BASE)
    episodes = draw_episodes(scenario, sampler, 24, PERIODIC_EVAL_SEEDS + 500)
    names = (list(TEACHER_NAMES) if args.actions == "time" else []) + [
        f"static:{b}" for b in CHECK_STATICS if b >= scenario.max_num_seqs]
    with progress_bar(len(names) * len(episodes), "checks: returns") as bar:
        costs = constant_costs(episodes, names, executor=executor, progress=bar)
    best = min(costs, key=lambda n: costs[n].mean())
    teacher = args.teacher_spec()
    out = {"costs": {n: float(c.mean()) for n, c in costs.items()},
           "best_constant": teacher or best, "lowest_cost": best, "checks_pick": best}
    if args.teacher:
        out["teacher_given"] = True
    if not args.checks or not conditions:
        return out
    with progress_bar(5 * len(names) * 2, "checks: capacity ranking") as bar:
        out["ranking"] = ranking_check(scenario, conditions, costs, executor=executor, progress=bar)
    out["checks_pick"] = teacher_choice(costs, out["ranking"])
    out["best_constant"] = best = teacher or out["checks_pick"]
    if not make_policy(best, scenario).acts_in_time:
        return out
    if args.condition_teachers and args.all_deployments:
        names, seeds = list(DEPLOYMENT_TEACHERS), args.teacher_streams
        with progress_bar(len(conditions) * len(names) * seeds, "checks: teachers by capacity",
                          "stream") as bar:
            caps = condition_capacities(scenario, conditions, names, seeds, executor=executor,
                                        progress=bar)
        out["condition_teachers"] = [capacity_pick(names, c, args.teacher_tie) for c in caps]
        out["teacher_capacities"] = {"policies": names, "capacity_rps": caps}
    elif args.condition_teachers:
        with progress_bar(len(conditions) * CONDITION_EPISODES * len(CONDITION_TEACHERS),
                          "checks: teachers per condition") as bar:
            out["condition_teachers"] = condition_teachers(
                scenario, replace(sampler, load_range=SELECTION_LOADS), list(CONDITION_TEACHERS),
                best, CONDITION_EPISODES, PERIODIC_EVAL_SEEDS + 2000, executor=executor,
                progress=bar)
    with progress_bar(6, "checks: room") as bar:
        out["room"] = room_check(episodes[:6], best, costs[best], executor=executor, progress=bar)
    return out


def print_checks(checks: dict) -> None:
    best, low = checks["best_constant"], checks.get("lowest_cost", checks["best_constant"])
    if checks.get("teacher_given"):
        pick = checks.get("checks_pick", low)
        print(f"teacher as given (--teacher): {best} (cost {checks['costs'][best]:.2f}, SLO "
              f"violations in % of requests)" + ("" if pick == best else
              f"; the checks' pick: {pick} ({checks['costs'][pick]:.2f})"))
    else:
        print(f"best constant choice on held-out training episodes: {best} (cost "
              f"{checks['costs'][best]:.2f}, SLO violations in % of requests)"
              + (f"; ties on cost with the lowest, {low} ({checks['costs'][low]:.2f}), and serves "
                 "more" if low != best else ""))
    rk, room = checks.get("ranking"), checks.get("room")
    if rk:
        warn = "" if rk["spearman"] >= 0.7 else "  WARNING: the reward does not rank choices as capacity does"
        print(f"check: return vs capacity ranking of {len(rk['rows'])} constants, Spearman "
              f"{rk['spearman']:.2f}{warn}")
    if room:
        print(f"check: reference controller gain over {teacher_words(checks)} "
              f"{room['gain']:+.2f} ± {room['gain_ci95']:.2f} ({room['episodes']} episodes)")


def write_config(run_dir: Path, args: Args, scenario: Scenario, conditions: list[dict],
                 checks: dict, notes: list[str] = ()) -> dict:
    """The run's config.json: its arguments (a resume takes them), scenario, conditions,
    checks and the notes on what it left out (a smoke run's)."""
    config = {"args": asdict(args), "scenario": scenario.fields_dict(), "commit": git_commit(),
              "notes": list(notes),
              "python": platform.python_version(), "actions": args.actions,
              "action_type": ACTION_TYPES[args.algo],
              "ladder": list(FRACTION_LADDER if args.actions == "time" else DEFAULT_LADDER),
              "eval_seed_base": EVAL_SEED_BASE, "conditions": conditions, "checks": checks}
    if args.all_deployments:
        config["deployments"] = {
            "trained": [list(d) for d in TRAINING_DEPLOYMENTS],
            "held_out": [list(d) for d in HELD_OUT_DEPLOYMENTS],
            "range": feature_range(scenario.with_fields(**{k: v for k, v in c.items()
                                                             if k != "capacity_rps"}).deployment()
                                   for c in conditions)}
    write_json_atomic(run_dir / "config.json", config)
    return config


def cloned_teacher(args: Args, config: dict, scenario: Scenario, model) -> str | None:
    """The fixed choice a fresh model is cloned from before learning (the checks' pick, or
    --teacher), or None where none is: a run acting in tokens, one told to clone nothing
    (--clone-decisions 0), a teacher that does not act in time, or an algorithm without a
    discrete distribution to clone into (DQN, SAC)."""
    best = config["checks"].get("best_constant", "")
    if args.actions == "time" and best and args.clone_decisions \
            and make_policy(best, scenario).acts_in_time \
            and config["action_type"] == "discrete" and hasattr(model.policy, "get_distribution"):
        return best
    return None


def build_model(args: Args, config: dict, scenario: Scenario, run_dir: Path):
    """(model, its environments, whether it was resumed): fresh, started at the best
    constant action, or from the run's newest loadable checkpoint."""
    from stable_baselines3.common.vec_env import VecNormalize  # stable-baselines3: heavy

    from agents.training import attach_env, make_vec_env, resumable_checkpoint  # stable-baselines3

    sampler = make_sampler(args, config["conditions"])
    venv = make_vec_env(scenario, sampler, config["actions"], config["action_type"], args.n_envs,
                        args.seed, args.vec_env, args.decision_interval_s)
    tb_dir = str(run_dir / "tensorboard")
    if args.resume:
        ckpt, model, stats = resumable_checkpoint(run_dir, args.algo)
        check_observations(model, run_dir, resuming=True)
        model, venv = attach_env(model, venv, stats, tb_dir)
        print(f"resuming from {ckpt} at {model.num_timesteps} timesteps")
        return model, venv, True
    venv = VecNormalize(venv, norm_obs=True, norm_reward=True, gamma=args.gamma)
    model = make_model(args.algo, venv, args.seed, tb_dir, args.learning_rate, args.gamma,
                       args.layers(), args.n_steps)
    best = cloned_teacher(args, config, scenario, model)
    decisions = min(args.clone_decisions, 4 * args.total_timesteps)
    if best and decisions:
        per = config["checks"].get("condition_teachers")
        with progress_bar(2 * decisions, "cloning the teacher", "decision") as bar:
            agree = imitate(model, best, config["ladder"], decisions, seed=args.seed,
                            teachers=per, conditions=config["conditions"], progress=bar)
        if per:
            counts = Counter(per)
            which = ", ".join(f"{n} on {k}" for n, k in counts.most_common())
            by = " by capacity" if "teacher_capacities" in config["checks"] else ""
            print(f"starting from each condition's best fixed choice{by} ({which} of {len(per)} "
                  f"conditions): cloned on {decisions:,} decisions ({agree:.1%} agreement)")
        else:
            print(f"starting from {teacher_words(config['checks'])}, {best}: cloned on "
                  f"{decisions:,} decisions ({agree:.1%} agreement)")
    return model, venv, False


def evaluator(args: Args, config: dict, scenario: Scenario, run_dir: Path, timesteps: int = 0):
    """The periodic evaluation; a resumed run's keeps its best cost, its last evaluation
    and its history, but not past ``timesteps`` (a resume from an older checkpoint
    evaluates again the steps it learns again)."""
    # Near the boundary: below capacity every sensible policy meets the SLO, far beyond it
    # every policy fails by the queue it cannot drain; between, the choices differ.
    from agents.callbacks import SimEvalCallback  # stable-baselines3: heavy

    sampler = replace(make_sampler(args, config["conditions"], EVAL_SEED_BASE),
                      load_range=SELECTION_LOADS)
    episodes = draw_episodes(scenario, sampler, args.eval_episodes, PERIODIC_EVAL_SEEDS)
    best_constant = config["checks"]["best_constant"]
    baseline = constant_costs(episodes, [best_constant])[best_constant]
    best = read_best(run_dir / "best.json")
    return SimEvalCallback(episodes, float(baseline.mean()), tuple(config["ladder"]),
                           config["actions"], config["action_type"], args.eval_every, run_dir,
                           best_cost=best["cost"], last_eval=min(best["last_eval"], timesteps),
                           history=[h for h in best["history"] if h["timesteps"] <= timesteps],
                           baseline_costs=baseline, kept=best["kept"])


def read_best(path: Path) -> dict:
    """A run's best.json (best cost, last evaluation, history); a missing one is a fresh
    start, and a damaged one too, with a warning (it holds no model, only the figures)."""
    fresh = {"cost": float("inf"), "last_eval": 0, "history": [], "kept": None}
    if not path.exists():
        return fresh
    try:
        best = json.loads(path.read_text())
        kept = best.get("kept")
        out = {"cost": float(best.get("cost", fresh["cost"])), "last_eval": int(best.get("last_eval", 0)),
               "history": [h for h in best.get("history", [])
                           if isinstance(h, dict) and isinstance(h.get("timesteps"), int)],
               "kept": kept if isinstance(kept, int) else None}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        print(f"warning: {path} cannot be read ({type(err).__name__}); evaluating afresh",
              file=sys.stderr)
        return fresh
    return out


def train(args: Args, model, venv, callback, run_dir: Path, resumed: bool) -> tuple[float, int, int | None]:
    """Learn with checkpoints; save the final model (or a checkpoint when a signal stopped
    it); (seconds, the steps learned in them, that signal or None)."""
    from agents.callbacks import save_model  # stable-baselines3: heavy
    from agents.training import Checkpoints, TrainedSteps, learn, write_checkpoint  # the same
    trained = TrainedSteps()
    ckpts = Checkpoints(run_dir / "checkpoints", args.checkpoint_every, trained)
    before = model.num_timesteps
    seconds, stopped_by = learn(model, args.total_timesteps, [callback, ckpts], args.progress_bar,
                                resumed, trained)
    write_checkpoint(model, run_dir / "checkpoints", model.num_timesteps)
    write_best(run_dir, callback)
    if stopped_by is None:
        save_model(model, run_dir / "model.zip", run_dir / "vecnormalize.pkl")
    return seconds, model.num_timesteps - before, stopped_by


def write_best(run_dir: Path, callback) -> None:
    """best.json: the kept model's cost and timesteps, the last evaluation and every
    evaluation's figures (each episode's cost, and the pairings against the start and the
    best fixed choice)."""
    write_json_atomic(run_dir / "best.json", {"cost": callback.best, "kept": callback.kept,
                                              "last_eval": callback._last, "history": callback.history})


def training_speed(timesteps: int, learned_steps: int, train_s: float,
                   total: int | None = None) -> str:
    """The run's timesteps and how fast they were learned: a resumed run's speed is that
    of the steps learned since the resume. Past a requested ``total`` it says so: learning
    stops at the end of the rollout that reaches it (the steps of every environment
    between updates)."""
    over = (f" (--total-timesteps {total:,}, reached within the last rollout)"
            if total is not None and timesteps > total else "")
    if not learned_steps or train_s <= 0:
        return f"{timesteps:,} timesteps{over}, trained before this resume"
    rate = f"{train_s:.0f} s ({learned_steps / train_s:,.0f} steps/s)"
    if learned_steps == timesteps:
        return f"{timesteps:,} timesteps{over} trained in {rate}"
    return (f"{timesteps:,} timesteps{over}, {learned_steps:,} of them trained since the resume "
            f"at {timesteps - learned_steps:,} in {rate}")


def finish(args: Args, config: dict, scenario: Scenario, run_dir: Path, model, callback,
           train_s: float, learned_steps: int, executor) -> str:
    """The final comparison on held-out arrivals and the run's summary."""
    from agents.callbacks import evaluate_model  # stable-baselines3: heavy

    if not callback.history or callback.history[-1]["timesteps"] != model.num_timesteps:
        callback.init_callback(model)
        callback.evaluate()
        write_best(run_dir, callback)
    learned = load_run(run_dir, scenario.slo())
    teacher = cloned_teacher(args, config, scenario, model)
    policies = final_policies(learned, teacher, scenario)
    with progress_bar(3 * (len(policies) + 13) * args.final_seeds, "final comparison") as bar:
        studies = final_comparison(learned, scenario, args.final_seeds, args.final_requests,
                                   executor, bar, teacher)
    with progress_bar(figure_count(policies, True, args.final_seeds), "figures") as bar:
        figures = final_figures(studies, learned, teacher, run_dir, args.final_seeds,
                                args.final_requests, executor, bar)
    with progress_bar(len(callback.episodes), "what the policy does", "episode") as bar:
        _, _, actions = evaluate_model(learned.model, learned.obs_norm, callback.episodes,
                                       learned.ladder, learned.actions, learned.action_type,
                                       progress=bar)
    desc = (f"{scenario.hardware} + {scenario.model}; serving {args.trace or args.workload}"
            f"{'' if scenario.trace else f' at {scenario.rate:g} req/s'}, SLO TTFT {scenario.slo_ttft_s:g} s "
            f"/ ITL {scenario.slo_itl_s * 1e3:g} ms; trained on {len(config['conditions'])} conditions"
            + (f"; {cap_words(scenario.max_pass_itl)}" if scenario.max_pass_itl is not None else ""))
    checks = config["checks"]
    speed = training_speed(model.num_timesteps, learned_steps, train_s, args.total_timesteps)
    facts = {"algorithm": f"{args.algo}, {speed}",
             "policy file": f"best_model.zip (the model kept at step {callback.kept:,})"
             if (run_dir / "best_model.zip").exists() and callback.kept is not None else "model.zip",
             "best constant cost on them": f"{callback.baseline_cost:.2f}",
             "commit": config["commit"]}
    selection = selection_sentence(callback.history, callback.kept, teacher is not None, str(run_dir))
    if selection:
        facts["model selection"] = selection[0].lower() + selection[1:].rstrip(".")
    mixed = any(t != teacher for t in checks.get("condition_teachers") or [])
    answer = run_answer(studies, learned.name, teacher, config.get("notes"), selection,
                        mixed_start(checks) if teacher and mixed else STARTED_FROM)
    text = summary_text(run_dir.name, desc, facts, checks, callback.history, studies, learned.name,
                        actions, answer, figures, args.final_seeds, args.final_requests)
    write_atomic(run_dir / "summary.md", text)
    write_json_atomic(run_dir / "summary.json", {
        "answer": answer.text, "next": list(answer.commands),
        "scenario": desc, "timesteps": model.num_timesteps, "trained_steps": learned_steps,
        "train_s": train_s, "figures": [p.name for p, _ in figures],
        "capacity": {n: st.as_json() for n, st in studies.items()}, "actions": actions,
        "eval_history": callback.history, "kept_timesteps": callback.kept,
        "selection": selection, "checks": checks})
    return text


def check_teacher_flags(args: Args, argv: list[str] | None) -> None:
    """--teacher-streams and --teacher-tie pick the teachers of a run across deployments;
    given to any other run, they are refused in one line (it picks its teachers by episode
    cost)."""
    given = given_fields(Args, sys.argv[1:] if argv is None else argv) & {"teacher_streams", "teacher_tie"}
    for name in sorted(given):
        require(args.all_deployments and args.condition_teachers, name, getattr(args, name),
                "needs --all-deployments (and its teachers per condition): a run on one "
                "deployment picks its conditions' teachers by episode cost")


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, argv, prog="python train.py")
    config = None
    if args.resume:
        args, config = resumed_args(args, argv)
    args.validate()
    check_teacher_flags(args, argv)
    args, smoke = smoke_args(args, argv)
    scenario = args.scenario()
    scenario.hardware_profile(), scenario.model_profile(), scenario.engine_config(), scenario.slo()
    run_dir = prepare_run(args)
    print(f"run directory: {run_dir}")

    import torch  # heavy: imported once the arguments are known good

    torch.set_num_threads(args.torch_threads)
    executor = make_executor(args.workers, args.ray_address)
    for note in smoke:
        print(note)
    if config is None:
        conditions = draw_training_conditions(args, scenario, executor)
        checks = pretraining_checks(args, scenario, conditions, executor)
        print_checks(checks)
        config = write_config(run_dir, args, scenario, conditions, checks, smoke)
    model, venv, resumed = build_model(args, config, scenario, run_dir)
    callback = evaluator(args, config, scenario, run_dir, model.num_timesteps)
    if resumed and model.num_timesteps >= args.total_timesteps and (run_dir / "summary.md").exists():
        print(f"{run_dir} has already trained {model.num_timesteps:,} of {args.total_timesteps:,} "
              "timesteps; raise --total-timesteps to train on")
        venv.close()
        return 0
    try:
        train_s, learned_steps, stopped_by = train(args, model, venv, callback, run_dir, resumed)
        if stopped_by is not None:
            print(f"interrupted after {model.num_timesteps} trained timesteps; checkpoint saved in "
                  f"{run_dir / 'checkpoints'}; continue with: python train.py --resume {run_dir}",
                  file=sys.stderr)
            return 128 + int(stopped_by)  # 130 for SIGINT, 143 for SIGTERM
        print()
        print(finish(args, config, scenario, run_dir, model, callback, train_s, learned_steps,
                     executor))
    finally:
        from agents.training import close_logger  # stable-baselines3: loaded by now

        close_logger(model)
        venv.close()  # subprocess workers wait for their next command until told to end
    print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
