"""The evaluation suite: named scenarios (hardware x model x workload x load).

Datacenter scenarios run twice: on DESIGN.md's pure roofline (no per-pass overhead)
and with 3 ms per pass (what real engines pay per step); their names end in
``+3ms``. One scenario puts the KV cache under pressure (preemptions happen).

The prefix-caching scenarios (:data:`PREFIX`, ``--scenarios prefix``) serve prompts that
share prefixes with prefix caching on: the Mooncake trace with its block ids,
conversations and agents at two hit rates each, and agents on a KV cache small enough
that eviction takes prefixes back (:mod:`envs.sharing`, :mod:`envs.prefix_cache`).
"""

from __future__ import annotations

from envs.scenario import Scenario, named_workload

MIX = dict(prompt="short-long", output="lognormal:128:0.8:1024")

_BASE: dict[str, Scenario] = {
    # DESIGN.md's worked example as a steady stream: ~2.3K-token conversations with an
    # 8K-token prompt in ten, Poisson arrivals keeping ~30 users decoding.
    "worked-example": Scenario(hardware="h100-sxm", model="llama-3-8b", rate=7.0,
                               prompt="mix:0.9*fixed:2304+0.1*fixed:8192",
                               output="lognormal:256:0.5:1024"),
    "mixed-medium": Scenario(hardware="h100-sxm", model="llama-3-8b", rate=5.0, **MIX),
    "mixed-high": Scenario(hardware="h100-sxm", model="llama-3-8b", rate=8.0, **MIX),
    "bursty-onoff": Scenario(hardware="h100-sxm", model="llama-3-8b",
                             **named_workload("mixed-onoff")),
    "azure-conv": Scenario(hardware="h100-sxm", model="llama-3-8b", trace="azure_conv_2023",
                           window_start_s=2800.0),
    # Prompts up to 191K tokens: no budget prefills the longest in 2 s on any part, so this
    # scenario's TTFT target is 30 s. Llama-3-70B on four H100s (the deployment a table
    # ships for).
    "mooncake": Scenario(hardware="h100-sxm", model="llama-3-70b-tp4", trace="mooncake_synthetic",
                         rate_scale=0.15, window_start_s=800.0, slo_ttft_s=30.0),
    # One user at a time: chunking can only cost here.
    "idle": Scenario(hardware="h100-sxm", model="llama-3-8b", rate=0.2, num_requests=100,
                     prompt="fixed:8192", output="fixed:128"),
    "kv-pressure": Scenario(hardware="h100-sxm", model="llama-3-8b", rate=6.0, num_kv_blocks=10000,
                            **MIX),
    "a100-mixed": Scenario(hardware="a100-80g", model="llama-3-8b", rate=2.0, **MIX),
    "h200-mixed": Scenario(hardware="h200", model="llama-3-8b", rate=8.0, **MIX),
    "l40s-mixed": Scenario(hardware="l40s", model="llama-3-8b", rate=1.5, **MIX),
    "laptop": Scenario(hardware="m5-max", model="llama-3-8b-q4", rate=0.05, num_requests=60,
                       prompt="mix:0.7*uniform:32:512+0.3*uniform:4000:8000",
                       output="lognormal:200:0.5:800", slo_ttft_s=10.0, slo_itl_s=0.2),
}

# Own texts of 64-1,024 tokens (a chat turn, a task), answers as in MIX.
_SHARED = dict(hardware="h100-sxm", model="llama-3-8b", rate=8.0, prompt="uniform:64:1024",
               output="lognormal:128:0.8:1024")

PREFIX: dict[str, Scenario] = {
    # The mooncake scenario's window with the trace's block ids: 64% of its prompt blocks
    # are a prefix seen before (envs/data/README.md).
    "mooncake-blocks": _BASE["mooncake"].with_fields(trace="mooncake_synthetic_blocks"),
    # Each turn resends the conversation so far: about 40% of prompt tokens repeat with 2
    # turns, 82% with 8 (envs.sharing.repeated_share over a 600-request stream). 300 and 75
    # users at a time: every conversation of a 600-request stream at once, and the same
    # gap between turns, in arrivals, whatever --requests asks for.
    "conversation-2": Scenario(sharing="conversation:2:300", **_SHARED),
    "conversation-8": Scenario(sharing="conversation:8:75", **_SHARED),
    # Eight agents' instructions, half and nine tenths of the prompt tokens.
    "agent-50": Scenario(sharing="agent:0.5:8", **_SHARED),
    "agent-90": Scenario(sharing="agent:0.9:8", **_SHARED),
    # The same in 3,000 blocks (48K tokens, a tenth of the H100's): at 8 req/s eviction
    # already takes back a fifth of the hits.
    "agent-90-tight-kv": Scenario(sharing="agent:0.9:8", num_kv_blocks=3000, **_SHARED),
}
"""Scenarios whose prompts share prefixes, served with prefix caching (no +3ms twins)."""

# Scenarios whose hardware pays no per-pass overhead by default get a +3ms twin.
SUITE: dict[str, Scenario] = {}
for _name, _sc in _BASE.items():
    SUITE[_name] = _sc
    if _sc.hardware_profile().per_pass_overhead_s == 0:
        SUITE[_name + "+3ms"] = _sc.with_fields(per_pass_overhead_s=0.003)
MAIN = list(SUITE)
SUITE.update(PREFIX)
GROUPS = {"all": list(SUITE), "main": MAIN, "prefix": list(PREFIX)}
"""Names ``--scenarios`` takes for several scenarios: every one, the main suite (the
reference results of docs/suite.md), the prefix-caching scenarios."""


def scenario_names() -> list[str]:
    return list(SUITE)


# --- a serving scenario's held-out variants -------------------------------------------------

TIGHT_KV_SHARE = 0.35
"""The held-out KV-pressure variant keeps this share of the device's KV blocks..."""
LONGEST_REQUEST_MARGIN = 1.25
"""...and at least this many times the blocks of the workload's longest request (a
Mooncake request of 191K tokens would not fit in a third of an H100 pair's cache)."""


def tight_kv_blocks(serving: Scenario) -> int:
    """The tight variant's KV blocks: a third of the device's cache, or enough for the
    longest request of the scenario's workload (a trace's whole window, or one synthetic
    draw) with a margin, whichever is larger; never more than the device holds."""
    blocks = serving.engine_config().kv_blocks(serving.hardware_profile(), serving.model_profile())
    w = serving.arrivals()
    bs = serving.engine_config().block_size
    longest = int(((w.prompt_tokens + w.output_tokens + bs - 1) // bs).max()) if len(w) else 0
    return min(blocks, max(int(blocks * TIGHT_KV_SHARE), int(longest * LONGEST_REQUEST_MARGIN)))


def final_scenarios(serving: Scenario) -> dict[str, Scenario]:
    """The serving scenario, and its variants where budgets behave differently: 3 ms more
    per pass, and a KV cache cut to a third (see :func:`tight_kv_blocks`)."""
    overhead = serving.hardware_profile().per_pass_overhead_s
    return {"serving": serving,
            "+3 ms per pass": serving.with_fields(per_pass_overhead_s=overhead + 0.003),
            "tight KV cache": serving.with_fields(num_kv_blocks=tight_kv_blocks(serving))}
