"""Simulate serving a workload at one static budget and print the aggregate metrics.

    python -m envs.simulate --trace shared/traces/azure_conv_2023.csv --budget 2048
    python -m envs.simulate --rate 6 --arrival gamma --burstiness 0.5 --budget 8192 --json
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from envs.cli import parse
from envs.engine import check_static_budget
from envs.errors import run_cli
from envs.scenario import Scenario


@dataclass(frozen=True)
class SimulateArgs(Scenario):
    """Serve a trace or a synthetic workload at a static token budget."""

    budget: int = 2048
    """Static token budget of every pass (vLLM's max_num_batched_tokens)."""
    json: bool = False
    """Print one JSON object instead of the table."""
    summary_only: bool = False
    """Keep no record of finished requests or past passes, only the summary's figures: memory
    stays flat however long the run (TTFT, TPOT and ITL percentiles within 0.05%; without
    it they are exact and a run keeps ~250 bytes a request)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_static_budget(self.budget, self.engine_config())


_ROWS = [
    ("requests", "requests_finished", "{:.0f}"), ("passes", "passes", "{:.0f}"),
    ("simulated time", "sim_time_s", "{:.1f} s"),
    ("TTFT p50 / p90 / p99", ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"), "{:.3f} s"),
    ("ITL p50 / p90 / p99", ("itl_p50_s", "itl_p90_s", "itl_p99_s"), "{:.1f} ms"),
    ("worst gap", "itl_max_s", "{:.1f} ms"),
    ("TPOT p50 / p99", ("tpot_p50_s", "tpot_p99_s"), "{:.1f} ms"),
    ("throughput", "throughput_tok_s", "{:.0f} tok/s"),
    ("requests/s", "request_throughput_rps", "{:.3f}"),
    ("goodput (TTFT & TPOT)", "goodput", "{:.1%}"),
    ("goodput req/s", "goodput_rps", "{:.3f}"),
    ("smooth (worst gap <= 2x ITL)", "smooth_share", "{:.1%}"),
    ("generation stalls", "stall_passes", "{:.0f} passes"),
    ("stall ITL mean / max", ("stall_itl_mean_s", "stall_itl_max_s"), "{:.1f} ms"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("KV usage mean / max", ("kv_usage_mean", "kv_usage_max"), "{:.1%}"),
    ("p95 prompt / budget", "prefill_passes_per_prompt_p95", "{:.0f} passes"),
]
_PREFIX_ROWS = [
    ("prefix hits: requests / tokens", ("prefix_hit_rate_requests", "prefix_hit_rate_tokens"), "{:.1%}"),
    ("cached tokens per prefill pass", "prefix_cached_tokens_per_pass", "{:.0f}"),
    ("prefill tokens saved", "prefill_tokens_saved", "{:,.0f}"),
]
"""Rows of a run with prefix caching (``envs.metrics.prefix_figures``)."""


def format_summary(summary: dict) -> str:
    lines = []
    for label, keys, fmt in _ROWS + (_PREFIX_ROWS if "prefill_tokens_saved" in summary else []):
        keys = keys if isinstance(keys, tuple) else (keys,)
        vals = []
        for k in keys:
            v = summary[k]
            if "ms" in fmt:
                v = v * 1e3
            vals.append("n/a" if isinstance(v, float) and math.isnan(v) else fmt.format(v))
        lines.append(f"  {label:<30} {' / '.join(vals)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(SimulateArgs, argv, prog="python -m envs.simulate")
    sim = args.simulator(summary_only=args.slo() if args.summary_only else None)
    t0 = time.perf_counter()
    result = sim.run(lambda state: args.budget)
    wall = time.perf_counter() - t0
    summary = result.summary(args.slo())
    summary["wall_s"] = wall
    summary["passes_per_s"] = summary["passes"] / wall if wall > 0 else math.nan
    summary["workload"] = sim.workload.describe()
    summary["budget"] = args.budget
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{sim.workload.name}: {len(sim.workload)} requests on {sim.hardware.name} + "
              f"{sim.model.name}, static budget {args.budget}, SLO TTFT {args.slo_ttft_s:g} s / "
              f"ITL {args.slo_itl_s * 1e3:g} ms")
        print(format_summary(summary))
        print(f"  {'wall time':<30} {wall:.2f} s ({summary['passes_per_s']:,.0f} passes/s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
