"""Simulator speed: the full Azure conversation trace (19,366 requests, one hour).

    python benchmarks/bench_simulator.py [--repeat 9] [--budget 2048]

Prints passes per second and wall time (median of the repeats, one core) for the
simulation alone and with the metrics summary, and the peak Python heap; and the
simulation's time against a plain roofline loop's on the same requests
(``benchmarks/reference_loop.py``: pass by pass, no KV cache to manage, no records beyond
first-token and finish times and the passes), the two run in turn each repeat, with the
median of the repeats' ratios. It first checks that both give every request the same
first-token and finish times. Targets: under 1 s for the whole trace on h100-sxm +
llama-3-8b, and within 1.2 times the plain loop's time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

from envs.engine import Simulator
from envs.workload import load_trace

try:
    from benchmarks.reference_loop import simulate as plain_loop
except ImportError:  # run as a script: benchmarks/ is the path's first entry
    from reference_loop import simulate as plain_loop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--trace", default="azure_conv_2023")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-8b")
    args = ap.parse_args()
    workload = load_trace(args.trace)
    columns = (workload.arrival_s.tolist(), workload.prompt_tokens.tolist(),
               workload.output_tokens.tolist())
    sim_times, total_times, plain_times, ratios = [], [], [], []
    for _ in range(args.repeat):
        sim = Simulator(args.hardware, args.model, workload)
        t0 = time.perf_counter()
        result = sim.run(lambda state: args.budget)
        t1 = time.perf_counter()
        summary = result.summary()
        t2 = time.perf_counter()
        first, finish, _, _ = plain_loop(*columns, sim.cost, args.budget, sim.config.max_num_seqs)
        t3 = time.perf_counter()
        sim_times.append(t1 - t0)
        total_times.append(t2 - t0)
        plain_times.append(t3 - t2)
        ratios.append((t1 - t0) / (t3 - t2))
    same = (np.allclose([r.first_token_s for r in sim.requests], first, rtol=1e-9)
            and np.allclose([r.finish_s for r in sim.requests], finish, rtol=1e-9))
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
    print(f"  plain roofline loop:                  {statistics.median(plain_times):.3f} s median; "
          f"the simulator takes {statistics.median(ratios):.2f}x its time (median of {args.repeat} "
          f"interleaved pairs; target <= 1.2x); the same first-token and finish times: "
          f"{'yes' if same else 'NO'}")
    print(f"  TTFT p99 {summary['ttft_p99_s']:.3f} s, ITL p99 {summary['itl_p99_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
