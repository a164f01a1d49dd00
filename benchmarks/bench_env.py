"""Environment speed: steps per second with random actions on one core.

    python benchmarks/bench_env.py [--steps 30000]

Two settings: the default (time-fraction actions, one step per decision interval of a
twentieth of the TTFT target, every pass in it priced and converted) and the per-pass
token ladder (``actions="tokens"``, ``decision_interval_s=0``: one step per pass with
prefill work, the first version's environment). The default's steps carry more
simulated work each; PPO trains at about 1,600 steps/s on top of it (train.py's summary).
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the environment)


def measure(steps: int, **kwargs) -> tuple[float, float, int]:
    env = gym.make(envs.ENV_ID, workload="mixed-bursty", **kwargs)
    env.reset(seed=0)
    actions = np.random.default_rng(0).integers(env.action_space.n, size=steps).tolist()
    t0, c0 = time.perf_counter(), time.process_time()
    episodes = passes = 0
    for action in actions:
        _, _, term, trunc, info = env.step(action)
        passes += info["passes"]
        if term or trunc:
            episodes += 1
            env.reset()
    return steps / (time.perf_counter() - t0), steps / (time.process_time() - c0), passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30000)
    args = ap.parse_args()
    for label, kwargs in (("time fractions, decision intervals (default)", {}),
                          ("token ladder, one step per pass", dict(actions="tokens",
                                                                   decision_interval_s=0))):
        wall, cpu, passes = measure(args.steps, **kwargs)
        print(f"{label}: {wall:,.0f} steps/s wall, {cpu:,.0f} steps/s CPU "
              f"({passes / args.steps:.1f} decision passes per step)")


if __name__ == "__main__":
    main()
