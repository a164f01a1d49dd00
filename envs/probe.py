"""What-if probe: one long prompt arrives while users are decoding.

``running`` users decode with ``context_tokens`` of context each when a prompt of
``prompt_tokens`` arrives at a pass boundary; the simulator runs until the prompt's
first token, and the probe reports what that cost everyone (DESIGN.md's worked
example is the default scenario):

    python -m envs.probe --budget 16384          # unchunked: one ~208 ms pass (datasheet H100)
    python -m envs.probe --budget 2048 --json
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from envs.cli import parse
from envs.cost import PassShape, free_ride_formula_tokens, price
from envs.engine import EngineConfig, Simulator, check_static_budget
from envs.errors import integer, non_negative, require, run_cli, tokens
from envs.pricing import free_ride_chunk
from envs.profiles import MAX_OVERHEAD_S, get_hardware, get_model
from envs.workload import Workload

# Running users are given more output than any probe can consume, so none finishes.
_ENDLESS = 10**9


@dataclass(frozen=True)
class ProbeArgs:
    """Simulate one prompt arriving among decoding users, until its first token."""

    hardware: str = "h100-sxm-datasheet"
    """Hardware preset or profile file (.toml/.json); the default is the datasheet roofline
    DESIGN.md's worked example is written for."""
    model: str = "llama-3-8b"
    """Model preset or profile file (.toml/.json)."""
    running: int = 32
    """Users already decoding when the prompt arrives."""
    context_tokens: int = 2304
    """Tokens of context (prompt + output so far) each running user has."""
    prompt_tokens: int = 8192
    """Length of the arriving prompt."""
    budget: int = 2048
    """Token budget of every pass (vLLM's max_num_batched_tokens)."""
    max_num_seqs: int = 256
    """Most running requests; a static budget must be at least this (as vLLM requires)."""
    per_pass_overhead_s: float | None = None
    """Fixed cost per pass in seconds (default: the hardware profile's)."""
    json: bool = False
    """Print one JSON object instead of the table."""

    def __post_init__(self) -> None:
        tokens("max_num_seqs", self.max_num_seqs)
        integer("running", self.running, 0)
        require(self.running < self.max_num_seqs, "running", self.running,
                f"must be < max_num_seqs ({self.max_num_seqs}) so the prompt can be admitted")
        tokens("context_tokens", self.context_tokens)
        tokens("prompt_tokens", self.prompt_tokens)
        check_static_budget(self.budget, EngineConfig(max_num_seqs=self.max_num_seqs))
        if self.per_pass_overhead_s is not None:
            non_negative("per_pass_overhead_s", self.per_pass_overhead_s, MAX_OVERHEAD_S)


def probe(args: ProbeArgs) -> dict:
    """Run the probe; returns the JSON-ready figures."""
    hw = get_hardware(args.hardware, args.per_pass_overhead_s)
    model = get_model(args.model)
    config = EngineConfig(max_num_seqs=args.max_num_seqs)

    workload = Workload.from_arrays([0.0], [args.prompt_tokens], [1], name="probe")
    sim = Simulator(hw, model, workload, config)
    for _ in range(args.running):
        sim.add_running(args.context_tokens, _ENDLESS)
    n, ctx = args.running, args.running * args.context_tokens
    baseline = price(sim.roofline, PassShape(n, ctx))

    prompt_req = None
    while prompt_req is None or math.isnan(prompt_req.first_token_s):
        if not sim.advance():
            break
        sim.step(args.budget)
        prompt_req = sim.requests[args.running]
    pass_s = sim.pass_durations().tolist()
    ttft = prompt_req.first_token_s - prompt_req.arrival
    worst = max(pass_s) if n else 0.0
    return {
        "hardware": hw.name, "model": model.name, "running": n,
        "context_tokens": args.context_tokens, "prompt_tokens": args.prompt_tokens,
        "budget": args.budget,
        "passes": len(pass_s),
        "ttft_ms": ttft * 1e3,
        "pass_ms": [t * 1e3 for t in pass_s],
        "baseline_pass_ms": baseline.total_s * 1e3,
        "baseline_memory_gib": baseline.bytes_moved / 2**30,
        "baseline_gflop": baseline.flops / 1e9,
        "baseline_compute_ms": baseline.compute_s * 1e3,
        "worst_gap_ms": worst * 1e3,
        "worst_gap_ratio": worst / baseline.total_s if n else 0.0,
        "tokens_delivered": n * len(pass_s),
        "free_ride_tokens": free_ride_chunk(sim.cost, n, ctx),
        "free_ride_formula_tokens": free_ride_formula_tokens(sim.roofline, n, ctx),
        "unchunked_ttft_ms": price(sim.roofline, PassShape.of(
            [args.context_tokens] * n, [(args.prompt_tokens, 0)])).total_s * 1e3,
    }


def render(r: dict) -> str:
    idle = 1 - r["baseline_compute_ms"] / max(r["baseline_pass_ms"], 1e-12)
    ms = r["pass_ms"]
    shown = ", ".join(f"{t:.1f}" for t in ms[:6]) + (f", ... ({len(ms)} passes)" if len(ms) > 6 else "")
    lines = [
        f"{r['running']} user{'s' * (r['running'] != 1)} decoding at {r['context_tokens']:,} tokens of context on "
        f"{r['hardware']} + {r['model']}; a prompt of {r['prompt_tokens']:,} tokens arrives; "
        f"budget {r['budget']:,}",
        "",
        f"  decode-only pass        {r['baseline_pass_ms']:9.2f} ms   "
        f"({r['baseline_memory_gib']:.1f} GiB moved, {r['baseline_gflop']:.0f} GFLOP; "
        f"tensor cores idle {idle:.0%})",
        f"  free ride               {r['free_ride_tokens']:9d} tok   "
        f"(formula: {r['free_ride_formula_tokens']:.0f})",
        f"  passes to first token   {r['passes']:9d}",
        f"  TTFT                    {r['ttft_ms']:9.1f} ms   (unchunked: {r['unchunked_ttft_ms']:.1f} ms)",
        f"  pass durations (ms)     {shown}",
        f"  worst gap, running user {r['worst_gap_ms']:9.1f} ms   ({r['worst_gap_ratio']:.1f}x the "
        "decode-only pass)",
        f"  tokens delivered        {r['tokens_delivered']:9d}      (to the running users, by the "
        "prompt's first token)",
        "",
    ]
    sweet = r["running"] + r["free_ride_tokens"]
    if r["passes"] == 1:
        lines.append(f"Unchunked: the whole prompt rides in one pass, and every running user waits "
                     f"{r['worst_gap_ms']:.0f} ms for its next token. A budget near {sweet:,} "
                     "(running decodes + free ride) would cap the stall near the decode-only pass.")
    elif r["budget"] <= sweet:
        lines.append(f"Chunks fit in the free ride (budget <= {sweet:,}): running users barely notice, "
                     f"but the prompt needs {r['passes']} passes and re-reads the weights each time: "
                     f"TTFT is {r['ttft_ms'] / r['unchunked_ttft_ms']:.2f}x the unchunked one.")
    else:
        lines.append(f"Chunked beyond the free ride ({sweet:,}): each chunk stretches every running "
                     f"user's gap to up to {r['worst_gap_ratio']:.1f}x, for a TTFT "
                     f"{r['ttft_ms'] / r['unchunked_ttft_ms']:.2f}x the unchunked one.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(ProbeArgs, argv, prog="python -m envs.probe")
    result = probe(args)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    run_cli(main)
