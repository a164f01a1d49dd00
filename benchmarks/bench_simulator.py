"""Simulator speed: the full Azure conversation trace (19,366 requests, one hour).

    python benchmarks/bench_simulator.py [--repeat 5] [--budget 2048]

Prints passes per second and wall time (median of the repeats, one core) for the
simulation alone and with the metrics summary, and the peak Python heap.
Target: under 1 s of wall time for the whole trace on h100-sxm + llama-3-8b.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from envs.engine import Simulator
from envs.workload import load_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--trace", default="azure_conv_2023")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-8b")
    args = ap.parse_args()
    workload = load_trace(args.trace)
    sim_times, total_times = [], []
    for _ in range(args.repeat):
        sim = Simulator(args.hardware, args.model, workload)
        t0 = time.perf_counter()
        result = sim.run(lambda state: args.budget)
        t1 = time.perf_counter()
        summary = result.summary()
        t2 = time.perf_counter()
        sim_times.append(t1 - t0)
        total_times.append(t2 - t0)
    passes = summary["passes"]
    tracemalloc.start()
    Simulator(args.hardware, args.model, workload).run(lambda state: args.budget).summary()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sim_s = statistics.median(sim_times)
    total_s = statistics.median(total_times)
    print(f"trace {args.trace}: {len(workload)} requests, {passes:,} passes, "
          f"{args.hardware} + {args.model}, budget {args.budget}")
    print(f"  run (simulate + per-request results): {sim_s:.3f} s median of {args.repeat} "
          f"(min {min(sim_times):.3f}), {passes / sim_s:,.0f} passes/s")
    print(f"  run + summary:                        {total_s:.3f} s median")
    print(f"  peak Python heap:                     {peak / 2**20:.1f} MiB")
    print(f"  TTFT p99 {summary['ttft_p99_s']:.3f} s, ITL p99 {summary['itl_p99_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
