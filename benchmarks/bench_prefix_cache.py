"""The simulator's speed with prefix caching: the Mooncake blocks trace (3,993 requests,
prompts of 11,587 tokens at the median, 64% of their blocks a prefix seen before).

    python benchmarks/bench_prefix_cache.py [--repeat 7] [--budget 8192]
    python benchmarks/bench_prefix_cache.py --scenario conversation-8 [--requests 3000]

Times, one core, median of the repeats run in turn: the plain roofline loop
(``benchmarks/reference_loop.py``, no KV cache), the simulator with prefix caching off,
with it on over the deployment's own KV pool (where eviction bites), and on over a pool
that never evicts; and the ratios of each to the loop and to caching off, and the time
per pass (hits change the schedule, so the runs differ in passes). Prints the hit rates
each run found. ``--scenario`` times one of the prefix suite's synthetic scenarios
(``eval/scenarios.py``'s ``PREFIX``) at its base load instead of the trace.
"""

from __future__ import annotations

import argparse
import statistics
import time

from envs.engine import EngineConfig, Simulator
from envs.workload import load_trace

try:
    from benchmarks.reference_loop import simulate as plain_loop
except ImportError:  # run as a script: benchmarks/ is the path's first entry
    from reference_loop import simulate as plain_loop

UNBOUNDED = 2**26
"""KV blocks of a pool that holds the whole trace's prefixes (1 billion tokens)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--trace", default="mooncake_synthetic_blocks")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-70b-tp4")
    ap.add_argument("--scenario", default=None, help="a synthetic scenario of eval/scenarios.py's PREFIX")
    ap.add_argument("--requests", type=int, default=3000, help="with --scenario: its stream's requests")
    args = ap.parse_args()
    if args.scenario:
        from eval.scenarios import PREFIX
        scenario = PREFIX[args.scenario].with_fields(num_requests=args.requests)
        w = scenario.arrivals(1)
        args.trace, args.hardware, args.model = args.scenario, scenario.hardware, scenario.model
    else:
        w = load_trace(args.trace)
    columns = (w.arrival_s.tolist(), w.prompt_tokens.tolist(), w.output_tokens.tolist())
    arms = {"off": EngineConfig(enable_prefix_caching=False), "on": EngineConfig(),
            "on, unbounded pool": EngineConfig(num_kv_blocks=UNBOUNDED)}
    times = {name: [] for name in ["plain loop", *arms]}
    summaries = {}
    for _ in range(args.repeat):
        cost = None
        for name, config in arms.items():
            sim = Simulator(args.hardware, args.model, w, config)
            cost = sim.cost
            t0 = time.perf_counter()
            result = sim.run(lambda state: args.budget)
            times[name].append(time.perf_counter() - t0)
            summaries[name] = result.summary()
        t0 = time.perf_counter()
        plain_loop(*columns, cost, args.budget, 256)
        times["plain loop"].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"trace {args.trace}: {len(w)} requests, {args.hardware} + {args.model}, budget "
          f"{args.budget}, median of {args.repeat}")
    for name, t in med.items():
        line = f"  {name:<20} {t:7.3f} s  {t / med['plain loop']:5.2f}x the plain loop"
        if name in summaries:
            s = summaries[name]
            line += (f", {t / med['off']:5.2f}x caching off, {s['passes']:,} passes, "
                     f"{t / s['passes'] * 1e6:.1f} us a pass")
            if "prefix_hit_rate_tokens" in s:
                line += (f", hits {s['prefix_hit_rate_requests']:.1%} of requests, "
                         f"{s['prefix_hit_rate_tokens']:.1%} of prompt tokens")
        print(line)


if __name__ == "__main__":
    main()
