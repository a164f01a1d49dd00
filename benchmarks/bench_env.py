"""Environment speed: steps per second with random actions on one core.

    python benchmarks/bench_env.py [--steps 50000]

Target: at least 20,000 steps/s on the default scenario.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the environment)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--workload", default="mixed-bursty")
    args = ap.parse_args()
    env = gym.make(envs.ENV_ID, workload=args.workload)
    env.reset(seed=0)
    actions = np.random.default_rng(0).integers(env.action_space.n, size=args.steps).tolist()
    t0, c0 = time.perf_counter(), time.process_time()
    episodes = 0
    for action in actions:
        _, _, term, trunc, _ = env.step(action)
        if term or trunc:
            episodes += 1
            env.reset()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{args.steps:,} random steps ({episodes} episodes) in {wall:.2f} s wall, {cpu:.2f} s CPU: "
          f"{args.steps / wall:,.0f} steps/s wall, {args.steps / cpu:,.0f} steps/s CPU "
          f"(workload {args.workload})")


if __name__ == "__main__":
    main()
