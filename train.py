"""Train a token-budget policy with stable-baselines3 and compare it with static budgets.

    python train.py                                  # PPO on the default scenario
    python train.py --algo dqn --total-timesteps 300000 --run-dir runs/dqn
    python train.py --resume runs/dqn                # continue from the last checkpoint
    tensorboard --logdir runs

The default scenario: h100-sxm + llama-3-8b serving DESIGN.md's mix (70% short
prompts, 30% 4K-16K) in bursts at about 8 requests/s, under a 2 s TTFT / 100 ms
ITL SLO; training episodes randomise the load between 0.6x and 1.2x. The run
directory holds the model, the config, TensorBoard logs, checkpoints and a
summary comparing the learned policy with static budgets (vLLM's default among
them) on the same held-out arrivals.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from envs.actions import STATIC_LADDER
from envs.cli import parse
from envs.errors import ConfigError, positive, positive_int, require, run_cli
from envs.scenario import Scenario, named_workload


@dataclass(frozen=True)
class Args:
    """Train a budget policy on a simulated serving scenario."""

    exp_name: str = "chunkpilot"
    """Name of the experiment (part of the run directory's name)."""
    algo: str = field(default="ppo", metadata={"choices": ["ppo", "dqn", "a2c", "sac"]})
    """stable-baselines3 algorithm; sac trains on the continuous log-budget action."""
    seed: int = 1
    """Seed of the model and of the training episodes."""
    total_timesteps: int = 150_000
    """Budget decisions to train on (all environments together)."""
    n_envs: int = 4
    """Parallel environments (vectorised)."""
    vec_env: str = field(default="dummy", metadata={"choices": ["dummy", "subproc"]})
    """Run the environments in this process (dummy) or in worker processes (subproc)."""
    hardware: str = "h100-sxm"
    """Hardware preset or profile file."""
    model: str = "llama-3-8b"
    """Model preset or profile file."""
    workload: str = "mixed-bursty"
    """Named workload (mixed-bursty, mixed-poisson, mixed-onoff, azure-conv, mooncake)."""
    trace: str | None = None
    """A trace to train on instead (bundled name or CSV path); the last 20% is held out."""
    rate: float | None = None
    """Override the workload's mean arrival rate, requests per second."""
    per_pass_overhead_s: float | None = None
    """Fixed cost per pass in seconds (default: the hardware profile's)."""
    num_kv_blocks: int | None = None
    """KV-cache capacity in 16-token blocks (default: from memory)."""
    slo_ttft_s: float = 2.0
    """TTFT target, seconds."""
    slo_itl_s: float = 0.1
    """ITL target, seconds."""
    episode_requests: int = 300
    """Requests per synthetic training episode."""
    rate_low: float = 0.6
    """Lowest load factor drawn per training episode."""
    rate_high: float = 1.2
    """Highest load factor drawn per training episode."""
    overhead_high_s: float = 0.0
    """Randomise each training episode's per-pass overhead in [0, this] seconds (0: off)."""
    kv_blocks_low: int | None = None
    """Randomise each training episode's KV capacity between this many 16-token blocks and
    the device's (log-uniform; unset: off)."""
    learning_rate: float | None = None
    """Learning rate (default: the algorithm's setup in agents/setup.py)."""
    n_steps: int | None = None
    """Rollout length per environment for PPO/A2C (default: agents/setup.py's)."""
    gamma: float = 0.99
    """Discount factor per decision."""
    net_arch: str = "64,64"
    """Hidden layer sizes of the policy and value networks."""
    eval_every: int = 25_000
    """Evaluate on held-out arrivals every this many steps (TensorBoard eval/*)."""
    eval_requests: int = 1000
    """Requests per periodic evaluation stream."""
    eval_seeds: int = 2
    """Streams per periodic evaluation."""
    final_eval_requests: int = 2000
    """Requests per stream of the final comparison."""
    final_eval_seeds: int = 3
    """Streams of the final comparison (disjoint from training and periodic evaluation)."""
    static_budgets: str = ",".join(map(str, STATIC_LADDER))
    """Static budgets to compare against."""
    checkpoint_every: int = 25_000
    """Save a checkpoint every this many steps."""
    run_dir: str | None = None
    """Run directory (default: runs/<exp>__<algo>__<workload>__<seed>__<time>)."""
    resume: str | None = None
    """Continue from a checkpoint (.zip) or from the latest checkpoint of a run directory."""
    progress_bar: bool = True
    """Show a progress bar while training."""
    torch_threads: int = 1
    """Threads for torch (small networks run fastest on one)."""

    def validate(self) -> None:
        positive_int("total_timesteps", self.total_timesteps)
        positive_int("n_envs", self.n_envs)
        positive_int("episode_requests", self.episode_requests)
        positive_int("eval_every", self.eval_every)
        positive_int("eval_requests", self.eval_requests)
        positive_int("eval_seeds", self.eval_seeds)
        positive_int("final_eval_requests", self.final_eval_requests)
        positive_int("final_eval_seeds", self.final_eval_seeds)
        positive_int("checkpoint_every", self.checkpoint_every)
        positive_int("torch_threads", self.torch_threads)
        if self.n_steps is not None:
            positive_int("n_steps", self.n_steps)
        require(self.overhead_high_s >= 0, "overhead_high_s", self.overhead_high_s, "must be >= 0")
        if self.kv_blocks_low is not None:
            positive_int("kv_blocks_low", self.kv_blocks_low)
        positive("rate_low", self.rate_low)
        require(self.rate_high >= self.rate_low, "rate_high", self.rate_high,
                f"must be >= rate_low ({self.rate_low})")
        require(0 < self.gamma <= 1, "gamma", self.gamma, "must lie in (0, 1]")
        self.layers()
        self.statics()

    def layers(self) -> tuple[int, ...]:
        try:
            sizes = tuple(int(x) for x in self.net_arch.split(","))
        except ValueError:
            sizes = ()
        require(bool(sizes) and all(s > 0 for s in sizes), "net_arch", self.net_arch,
                "must be comma-separated positive layer sizes, e.g. 64,64")
        return sizes

    def statics(self) -> list[int]:
        try:
            budgets = [int(x) for x in self.static_budgets.split(",")]
        except ValueError:
            budgets = []
        require(bool(budgets) and all(b > 0 for b in budgets), "static_budgets", self.static_budgets,
                "must be comma-separated positive integers")
        return budgets

    def scenario(self) -> Scenario:
        fields = named_workload(self.workload)
        if self.trace:
            fields["trace"] = self.trace
        if self.rate is not None:
            positive("rate", self.rate)
            fields["rate"] = self.rate
        return Scenario(hardware=self.hardware, model=self.model,
                        per_pass_overhead_s=self.per_pass_overhead_s,
                        num_kv_blocks=self.num_kv_blocks, slo_ttft_s=self.slo_ttft_s,
                        slo_itl_s=self.slo_itl_s, **fields)


def prepare_run_dir(args: Args) -> tuple[Path, Path | None]:
    """(the run directory, the checkpoint to resume from or None)."""
    from agents.runs import latest_checkpoint

    if not args.resume:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path(args.run_dir or f"runs/{args.exp_name}__{args.algo}__{args.workload}__"
                                    f"{args.seed}__{stamp}"), None
    resume_from = latest_checkpoint(Path(args.resume))
    if resume_from is None:
        raise ConfigError(f"resume: no checkpoint (ckpt_*_steps.zip) found in {args.resume!r}")
    run_dir = Path(args.run_dir) if args.run_dir else (
        resume_from.parent.parent if resume_from.parent.name == "checkpoints" else resume_from.parent)
    return run_dir, resume_from


def write_config(run_dir: Path, args: Args, scenario: Scenario, action_type: str) -> dict:
    from envs.actions import DEFAULT_LADDER
    from envs.seeds import EVAL_SEED_BASE
    from eval.report import git_commit

    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    config = {"args": asdict(args), "scenario": scenario.fields_dict(), "commit": git_commit(),
              "python": platform.python_version(), "action_type": action_type,
              "ladder": list(DEFAULT_LADDER), "eval_seed_base": EVAL_SEED_BASE}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return config


def held_out_workloads(args: Args, scenario: Scenario):
    """(periodic evaluation streams, final comparison streams): different seeds, both
    disjoint from every training episode's."""
    from envs.seeds import FINAL_EVAL_SEEDS
    from eval.harness import evaluation_workloads

    periodic = evaluation_workloads(scenario, args.eval_seeds, args.eval_requests)
    if scenario.trace:
        return periodic, evaluation_workloads(scenario, 1)
    return periodic, evaluation_workloads(scenario, args.final_eval_seeds, args.final_eval_requests,
                                          seed_base=FINAL_EVAL_SEEDS)


def best_static_baseline(scenario: Scenario, statics, workloads) -> dict:
    """The best static budget's figures on the periodic evaluation's arrivals (the
    TensorBoard ``baseline/*`` curves)."""
    from eval.harness import best_of, run_policies

    runs = run_policies(scenario, statics, workloads)
    best = best_of(runs)
    baseline = {k: runs[best].mean(k) for k in ("goodput", "ttft_p99_s", "itl_p99_s", "itl_max_s")}
    baseline["budget"] = next(p.tokens for p in statics if p.name == best)
    print(f"best static budget on the evaluation arrivals: {best} (goodput {baseline['goodput']:.3f})")
    return baseline


def make_vec_env(args: Args, scenario: Scenario, action_type: str):
    import gymnasium as gym
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    import envs
    from envs.episodes import EpisodeSampler

    kv_range = None
    if args.kv_blocks_low:
        kv_range = (args.kv_blocks_low, scenario.engine_config().kv_blocks(
            scenario.hardware_profile(), scenario.model_profile()))
    sampler = EpisodeSampler(rate_range=(args.rate_low, args.rate_high),
                             episode_requests=args.episode_requests,
                             overhead_range_s=(0.0, args.overhead_high_s) if args.overhead_high_s else None,
                             kv_blocks_range=kv_range)

    def factory(rank: int):
        def make():
            env = gym.make(envs.ENV_ID, scenario=scenario, sampler=sampler, action_type=action_type)
            env.reset(seed=args.seed * 1000 + rank)
            return Monitor(env)
        return make

    cls = SubprocVecEnv if args.vec_env == "subproc" else DummyVecEnv
    return cls([factory(i) for i in range(args.n_envs)])


def build_or_resume_model(args: Args, scenario: Scenario, action_type: str, run_dir: Path,
                          resume_from: Path | None):
    """(model, its VecNormalize-wrapped environments), fresh or from a checkpoint."""
    from stable_baselines3.common.vec_env import VecNormalize

    from agents.setup import load_model, make_model

    venv = make_vec_env(args, scenario, action_type)
    tb_dir = str(run_dir / "tensorboard")
    if resume_from is None:
        venv = VecNormalize(venv, norm_obs=False, norm_reward=True, gamma=args.gamma)
        return make_model(args.algo, venv, args.seed, tb_dir, args.learning_rate, args.gamma,
                          args.layers(), args.n_steps), venv
    norm_path = resume_from.with_name(resume_from.name.replace("ckpt_", "ckpt_vecnormalize_")
                                      .replace(".zip", ".pkl"))
    venv = VecNormalize.load(str(norm_path), venv) if norm_path.exists() else VecNormalize(
        venv, norm_obs=False, norm_reward=True, gamma=args.gamma)
    model = load_model(args.algo, resume_from, env=venv)
    model.tensorboard_log = tb_dir
    print(f"resuming from {resume_from} at {model.num_timesteps} timesteps")
    return model, venv


def train_model(args: Args, model, venv, evaluator, run_dir: Path, resumed: bool) -> tuple[float, bool]:
    """Learn the remaining timesteps with checkpoints; (training seconds, interrupted).
    Saves a checkpoint where a resume finds it, whether training finished or not."""
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback

    ckpt_dir = run_dir / "checkpoints"
    remaining = max(args.total_timesteps - model.num_timesteps, 0)
    checkpoints = CheckpointCallback(save_freq=max(args.checkpoint_every // args.n_envs, 1),
                                     save_path=str(ckpt_dir), name_prefix="ckpt",
                                     save_vecnormalize=True)
    t0 = time.perf_counter()
    interrupted = False
    if remaining:
        try:
            model.learn(remaining, callback=CallbackList([evaluator, checkpoints]),
                        reset_num_timesteps=not resumed, tb_log_name="run",
                        progress_bar=args.progress_bar)
        except KeyboardInterrupt:
            interrupted = True
    train_s = time.perf_counter() - t0
    model.save(str(ckpt_dir / f"ckpt_{model.num_timesteps}_steps.zip"))
    venv.save(str(ckpt_dir / f"ckpt_vecnormalize_{model.num_timesteps}_steps.pkl"))
    return train_s, interrupted


def final_comparison(args: Args, scenario: Scenario, run_dir: Path, model, action_type: str,
                     statics, workloads) -> tuple[tuple[str, str], str, dict]:
    """The learned policy, vLLM's default and the statics on arrivals neither training nor
    model selection saw; ((learned policy's name, the default's), policy file used,
    summaries)."""
    from agents.setup import load_model
    from envs.actions import DEFAULT_LADDER
    from eval.harness import run_policies
    from policies.baselines import VllmDefaultPolicy
    from policies.learned import ModelPolicy

    chosen, learned_model = "model.zip", model
    best_path = run_dir / "best_model.zip"
    if best_path.exists():
        learned_model = load_model(args.algo, best_path)
        chosen = "best_model.zip (best periodic evaluation)"
    learned = ModelPolicy(learned_model, scenario.slo(), DEFAULT_LADDER, action_type,
                          name=f"learned ({args.algo})")
    default = VllmDefaultPolicy(scenario.hardware_profile())
    results = run_policies(scenario, [learned, default, *statics], workloads)
    return (learned.name, default.name), chosen, {name: r.summary() for name, r in results.items()}


def verdict(learned: dict, best_name: str, best: dict, default_name: str, default: dict) -> str:
    """Say which of DESIGN.md's two jobs the result shows, plainly."""
    from eval.harness import against_best
    from eval.report import verdict_sentence

    g, d = learned["goodput"], default["goodput"]
    kind, rel = against_best(g, best["goodput"])
    first = f"It {verdict_sentence(kind, rel, best_name)}."
    if kind == "short":
        first += " Train longer or check the reward weights."
    return first + (f" Against vLLM's default ({default_name}): {g - d:+.3f} goodput "
                    f"({g:.3f} vs {d:.3f}).")


def write_summary(args: Args, scenario: Scenario, run_dir: Path, config: dict, timesteps: int,
                  train_s: float, names: tuple[str, str], chosen: str, summaries: dict, statics,
                  n_streams: int, history: list) -> str:
    from envs.seeds import FINAL_EVAL_SEEDS
    from eval.harness import PolicyResult, best_of
    from eval.report import short_table

    static_names = [p.name for p in statics]
    ranked = {n: PolicyResult(n, runs=[summaries[n]]) for n in static_names}
    best_name = best_of(ranked)
    learned_name, default_name = names
    rows = [(learned_name, summaries[learned_name]),
            (f"{default_name} (vLLM's default)", summaries[default_name])]
    rows += [(n + (" (best static)" if n == best_name else ""), summaries[n]) for n in static_names]
    text = verdict(summaries[learned_name], best_name, summaries[best_name], default_name,
                   summaries[default_name])
    desc = (f"{scenario.hardware} + {scenario.model}, workload {args.trace or args.workload}"
            f"{'' if args.rate is None else f' at {args.rate} req/s'}, SLO TTFT {args.slo_ttft_s:g} s / "
            f"ITL {args.slo_itl_s * 1e3:g} ms")
    where = (f"{n_streams} held-out streams of {args.final_eval_requests} requests "
             f"(seeds {FINAL_EVAL_SEEDS}+, never used in training)" if not scenario.trace
             else "the last 20% of the trace, held out of training")
    report = "\n".join([
        f"# chunkpilot training run: {run_dir.name}", "",
        f"- scenario: {desc}",
        f"- algorithm: {args.algo}, {timesteps:,} timesteps, {train_s:.0f} s of training",
        f"- evaluated on {where}; policy file: {chosen}",
        f"- commit: {config['commit']}", "",
        short_table(rows), "", text, "",
        "Goodput: share of requests with TTFT and TPOT within the SLO (vLLM bench's definition); "
        "± is a 95% interval over streams. Smooth share: requests whose worst gap stays within "
        "twice the ITL target.", ""])
    (run_dir / "summary.md").write_text(report)
    (run_dir / "summary.json").write_text(json.dumps(
        {"scenario": desc, "timesteps": timesteps, "train_s": train_s, "policy_file": chosen,
         "best_static": best_name, "results": summaries, "verdict": text,
         "eval_history": history}, indent=2, default=float))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, argv, prog="python train.py")
    args.validate()
    scenario = args.scenario()
    scenario.hardware_profile(), scenario.model_profile(), scenario.engine_config(), scenario.slo()

    import torch

    from agents.callbacks import SimEvalCallback
    from agents.setup import ACTION_TYPES
    from envs.actions import DEFAULT_LADDER
    from policies.baselines import StaticPolicy

    torch.set_num_threads(args.torch_threads)
    action_type = ACTION_TYPES[args.algo]
    run_dir, resume_from = prepare_run_dir(args)
    config = write_config(run_dir, args, scenario, action_type)
    print(f"run directory: {run_dir}")
    periodic, final_workloads = held_out_workloads(args, scenario)
    statics = [StaticPolicy(b) for b in args.statics()]
    baseline = best_static_baseline(scenario, statics, periodic)
    model, venv = build_or_resume_model(args, scenario, action_type, run_dir, resume_from)
    evaluator = SimEvalCallback(scenario, periodic, baseline, DEFAULT_LADDER, action_type,
                                args.eval_every, best_path=run_dir / "best_model.zip")
    train_s, interrupted = train_model(args, model, venv, evaluator, run_dir, resume_from is not None)
    if interrupted:
        print(f"interrupted at {model.num_timesteps} timesteps; checkpoint saved in "
              f"{run_dir / 'checkpoints'}; continue with: python train.py --resume {run_dir}",
              file=sys.stderr)
        return 130
    model.save(str(run_dir / "model.zip"))
    venv.save(str(run_dir / "vecnormalize.pkl"))
    if not evaluator.history or evaluator.history[-1]["timesteps"] != model.num_timesteps:
        if evaluator.model is None:  # learn() did not run: nothing was left to train
            evaluator.init_callback(model)
        evaluator.evaluate()
    names, chosen, summaries = final_comparison(args, scenario, run_dir, model, action_type,
                                                       statics, final_workloads)
    report = write_summary(args, scenario, run_dir, config, model.num_timesteps, train_s,
                           names, chosen, summaries, statics, len(final_workloads),
                           evaluator.history)
    print()
    print(report)
    print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
