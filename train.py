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
import math
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    static_budgets: str = "256,512,1024,2048,4096,8192,16384"
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


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def latest_checkpoint(path: Path) -> Path | None:
    """The checkpoint with the most timesteps in ``path``/checkpoints (or ``path`` itself)."""
    if path.suffix == ".zip":
        return path if path.exists() else None
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = sorted(folder.glob("ckpt_*_steps.zip"), key=lambda p: int(p.stem.split("_")[-2]))
    return found[-1] if found else None


def make_vec_env(args: Args, scenario: Scenario, action_type: str):
    import gymnasium as gym
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    import envs
    from envs.chunk_budget_env import EpisodeSampler

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


def fmt(v: float, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}f}"


def comparison_table(rows: list[tuple[str, dict]]) -> str:
    head = ("| policy | goodput | TTFT p99 (s) | ITL p99 (ms) | worst gap (ms) | smooth share "
            "| mean budget |\n|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for name, s in rows:
        lines.append(f"| {name} | {fmt(s['goodput'])} ± {fmt(s['goodput_ci95'])} | "
                     f"{fmt(s['ttft_p99_s'], digits=2)} | {fmt(s['itl_p99_s'], 1e3, 1)} | "
                     f"{fmt(s['itl_max_s'], 1e3, 0)} | {fmt(s['smooth_share'])} | "
                     f"{fmt(s['budget_mean'], digits=0)} |")
    return "\n".join(lines)


def verdict(learned: dict, best_name: str, best: dict, default_name: str, default: dict) -> str:
    """Say which of DESIGN.md's two jobs the result shows, plainly."""
    from eval.harness import against_best

    g, d = learned["goodput"], default["goodput"]
    kind, rel = against_best(g, best["goodput"])
    first = {
        "beats": (f"It beats the best static budget ({best_name}) by {rel:+.1%} goodput (job 2: "
                  "beating the best static where the dynamics give room)."),
        "matches": (f"It matches the best static budget ({best_name}) within 1% ({rel:+.1%} "
                    "goodput) with one policy and no tuning (job 1); it does not beat it by more "
                    "than 1%."),
        "short": (f"It falls short of the best static budget ({best_name}) by {-rel:.1%} goodput: "
                  "train longer or check the reward weights."),
    }[kind]
    second = (f"Against vLLM's default ({default_name}): {g - d:+.3f} goodput "
              f"({g:.3f} vs {d:.3f}).")
    return first + " " + second


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, argv, prog="python train.py")
    args.validate()
    scenario = args.scenario()
    hardware = scenario.hardware_profile()
    scenario.model_profile()
    scenario.engine_config()
    scenario.slo()

    import torch
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
    from stable_baselines3.common.vec_env import VecNormalize

    from agents.callbacks import SimEvalCallback
    from agents.setup import ACTION_TYPES, load_model, make_model
    from envs.chunk_budget_env import DEFAULT_LADDER, EVAL_SEED_BASE
    from eval.harness import evaluation_workloads, run_policies
    from policies.baselines import StaticPolicy, vllm_default_budget
    from policies.learned import ModelPolicy

    torch.set_num_threads(args.torch_threads)
    action_type = ACTION_TYPES[args.algo]
    ladder = DEFAULT_LADDER

    resume_from = None
    if args.resume:
        resume_from = latest_checkpoint(Path(args.resume))
        if resume_from is None:
            raise ConfigError(f"resume: no checkpoint (ckpt_*_steps.zip) found in {args.resume!r}")
        run_dir = Path(args.run_dir) if args.run_dir else (
            resume_from.parent.parent if resume_from.parent.name == "checkpoints" else resume_from.parent)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(args.run_dir or f"runs/{args.exp_name}__{args.algo}__{args.workload}__"
                                       f"{args.seed}__{stamp}")
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config = {"args": asdict(args), "scenario": scenario.fields_dict(), "commit": git_commit(),
              "python": platform.python_version(), "action_type": action_type,
              "ladder": list(ladder), "eval_seed_base": EVAL_SEED_BASE}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    print(f"run directory: {run_dir}")

    # Held-out arrivals: periodic evaluation and the final comparison use different seeds,
    # both disjoint from every training episode's.
    eval_workloads = evaluation_workloads(scenario, args.eval_seeds, args.eval_requests)
    final_scenario = scenario
    if not scenario.trace:
        final_workloads = [scenario.with_fields(num_requests=args.final_eval_requests)
                           .workload(EVAL_SEED_BASE + 1000 + i) for i in range(args.final_eval_seeds)]
    else:
        final_workloads = evaluation_workloads(scenario, 1)
    statics = [StaticPolicy(b) for b in args.statics()]
    default_budget = vllm_default_budget(hardware)
    default_policy = StaticPolicy(default_budget, name=f"vllm-default:{default_budget}")

    baseline_runs = run_policies(scenario, statics, eval_workloads)
    best_static = max(baseline_runs.values(), key=lambda r: (r.mean("goodput"), -r.mean("ttft_p99_s")))
    baseline = {k: best_static.mean(k) for k in ("goodput", "ttft_p99_s", "itl_p99_s", "itl_max_s")}
    baseline["budget"] = statics[[p.name for p in statics].index(best_static.name)].tokens
    print(f"best static budget on the evaluation arrivals: {best_static.name} "
          f"(goodput {baseline['goodput']:.3f})")

    venv = make_vec_env(args, scenario, action_type)
    tb_dir = str(run_dir / "tensorboard")
    if resume_from is not None:
        norm_path = resume_from.with_name(resume_from.name.replace("ckpt_", "ckpt_vecnormalize_")
                                          .replace(".zip", ".pkl"))
        venv = VecNormalize.load(str(norm_path), venv) if norm_path.exists() else VecNormalize(
            venv, norm_obs=False, norm_reward=True, gamma=args.gamma)
        model = load_model(args.algo, resume_from, env=venv)
        model.tensorboard_log = tb_dir
        print(f"resuming from {resume_from} at {model.num_timesteps} timesteps")
    else:
        venv = VecNormalize(venv, norm_obs=False, norm_reward=True, gamma=args.gamma)
        model = make_model(args.algo, venv, args.seed, tb_dir, args.learning_rate, args.gamma,
                           args.layers(), args.n_steps)
    done = model.num_timesteps
    remaining = max(args.total_timesteps - done, 0)

    evaluator = SimEvalCallback(scenario, eval_workloads, baseline, ladder, action_type,
                                args.eval_every, best_path=run_dir / "best_model.zip")
    checkpoints = CheckpointCallback(save_freq=max(args.checkpoint_every // args.n_envs, 1),
                                     save_path=str(ckpt_dir), name_prefix="ckpt",
                                     save_vecnormalize=True)
    t0 = time.perf_counter()
    interrupted = False
    if remaining:
        try:
            model.learn(remaining, callback=CallbackList([evaluator, checkpoints]),
                        reset_num_timesteps=resume_from is None, tb_log_name="run",
                        progress_bar=args.progress_bar)
        except KeyboardInterrupt:
            interrupted = True
    train_s = time.perf_counter() - t0
    # Save where a resume finds it, whether training finished or was interrupted.
    model.save(str(ckpt_dir / f"ckpt_{model.num_timesteps}_steps.zip"))
    venv.save(str(ckpt_dir / f"ckpt_vecnormalize_{model.num_timesteps}_steps.pkl"))
    if interrupted:
        print(f"interrupted at {model.num_timesteps} timesteps; checkpoint saved in {ckpt_dir}; "
              f"continue with: python train.py --resume {run_dir}", file=sys.stderr)
        return 130
    model.save(str(run_dir / "model.zip"))
    venv.save(str(run_dir / "vecnormalize.pkl"))
    if not evaluator.history or evaluator.history[-1]["timesteps"] != model.num_timesteps:
        if evaluator.model is None:  # learn() did not run: nothing was left to train
            evaluator.init_callback(model)
        evaluator.evaluate()

    # The final comparison, on arrivals neither training nor model selection saw.
    chosen = "model.zip"
    learned_model = model
    best_path = run_dir / "best_model.zip"
    if best_path.exists():
        learned_model = load_model(args.algo, best_path)
        chosen = "best_model.zip (best periodic evaluation)"
    learned = ModelPolicy(learned_model, scenario.slo(), ladder, action_type,
                          name=f"learned ({args.algo})")
    results = run_policies(final_scenario, [learned, default_policy, *statics], final_workloads)
    summaries = {name: r.summary() for name, r in results.items()}
    static_names = [p.name for p in statics]
    best_name = max(static_names, key=lambda n: (summaries[n]["goodput"], -summaries[n]["ttft_p99_s"]))
    rows = [(learned.name, summaries[learned.name]),
            (f"{default_policy.name} (vLLM's default)", summaries[default_policy.name])]
    rows += [(n + (" (best static)" if n == best_name else ""), summaries[n]) for n in static_names]
    table = comparison_table(rows)
    text = verdict(summaries[learned.name], best_name, summaries[best_name], default_policy.name,
                   summaries[default_policy.name])
    desc = (f"{scenario.hardware} + {scenario.model}, workload {args.trace or args.workload}"
            f"{'' if args.rate is None else f' at {args.rate} req/s'}, SLO TTFT {args.slo_ttft_s:g} s / "
            f"ITL {args.slo_itl_s * 1e3:g} ms")
    where = (f"{len(final_workloads)} held-out streams of {args.final_eval_requests} requests "
             f"(seeds {EVAL_SEED_BASE + 1000}+, never used in training)" if not scenario.trace
             else "the last 20% of the trace, held out of training")
    report = "\n".join([
        f"# chunkpilot training run: {run_dir.name}", "",
        f"- scenario: {desc}",
        f"- algorithm: {args.algo}, {model.num_timesteps:,} timesteps, {train_s:.0f} s of training",
        f"- evaluated on {where}; policy file: {chosen}",
        f"- commit: {config['commit']}", "",
        table, "", text, "",
        "Goodput: share of requests with TTFT and TPOT within the SLO (vLLM bench's definition); "
        "± is a 95% interval over streams. Smooth share: requests whose worst gap stays within "
        "twice the ITL target.", ""])
    (run_dir / "summary.md").write_text(report)
    (run_dir / "summary.json").write_text(json.dumps(
        {"scenario": desc, "timesteps": model.num_timesteps, "train_s": train_s, "policy_file": chosen,
         "best_static": best_name, "results": summaries, "verdict": text,
         "eval_history": evaluator.history}, indent=2, default=float))
    print()
    print(report)
    print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
