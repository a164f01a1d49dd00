"""Static budgets and hand-written adaptive rules."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from envs.pricing import chunk_attention_pairs, pass_price, prefill_due_s, time_budget
from policies.base import BudgetPolicy


class StaticPolicy(BudgetPolicy):
    """The same budget every pass: what engines do today."""

    kind = "static"

    def __init__(self, tokens: int, name: str | None = None):
        self.tokens = int(tokens)
        self.name = name or f"static:{self.tokens}"

    def budget(self, state) -> int:
        return self.tokens



def vllm_default_budget(hardware, entry_point: str = "server") -> int:
    """vLLM's default ``max_num_batched_tokens`` (V1, ``EngineArgs``): 8,192 for the
    OpenAI server and 16,384 for the offline ``LLM`` class on parts with at least 70 GiB
    that are not A100s (H100/H200-class); 2,048 and 8,192 on A100 and smaller parts."""
    large = hardware.memory_bytes >= 70 * 2**30 and "a100" not in hardware.name.lower()
    if entry_point == "server":
        return 8192 if large else 2048
    if entry_point == "offline":
        return 16384 if large else 8192
    from envs.errors import ConfigError
    raise ConfigError(f"entry_point: got {entry_point!r}, must be 'server' or 'offline'")


class VllmDefaultPolicy(StaticPolicy):
    """vLLM's default budget for the hardware (see :func:`vllm_default_budget`)."""

    kind = "default"

    def __init__(self, hardware, entry_point: str = "server"):
        super().__init__(vllm_default_budget(hardware, entry_point),
                         name=f"vllm-default:{vllm_default_budget(hardware, entry_point)}")


class QueueDepthPolicy(BudgetPolicy):
    """The public queue-depth heuristic (DESIGN.md section 3): the prompt chunk is the base
    chunk times 4 when no decode is running, 2 under 10 decodes, 1 under 50, and half at
    50 or more; the pass's budget is that chunk plus the running decodes."""

    def __init__(self, base: int = 512):
        self.base = int(base)
        self.name = f"queue-depth:{self.base}"

    def budget(self, state) -> int:
        n = state.running_decodes
        if n == 0:
            factor = 4.0
        elif n < 10:
            factor = 2.0
        elif n < 50:
            factor = 1.0
        else:
            factor = 0.5
        return n + int(self.base * factor)


class NoDecodeBoostPolicy(BudgetPolicy):
    """A large budget when nothing is decoding (chunking then only costs), otherwise a
    small one (a rule proposed for vLLM)."""

    def __init__(self, low: int = 2048, high: int = 16384):
        self.low, self.high = int(low), int(high)
        self.name = f"no-decode-boost:{self.low}:{self.high}"

    def budget(self, state) -> int:
        return self.high if state.running_decodes == 0 else self.low


class FreeRidePolicy(BudgetPolicy):
    """Running decodes plus the exact free-ride capacity of this pass (the largest chunk
    that keeps it memory-bound, given the head request's prefilled prefix), floored and
    capped. With nothing decoding there is nothing to ride along with and chunking is
    pure loss, so it uses the cap (DESIGN.md section 2)."""

    def __init__(self, floor: int = 256, cap: int = 16384):
        self.floor, self.cap = int(floor), int(cap)
        self.name = "free-ride" if (floor, cap) == (256, 16384) else f"free-ride:{floor}:{cap}"

    def budget(self, state) -> int:
        n = state.running_decodes
        if n == 0:
            return self.cap
        return min(max(n + state.free_ride_tokens, self.floor), self.cap)


class SarathiSLOPolicy(StaticPolicy):
    """Sarathi-Serve's way: the largest static budget whose pass stays within the ITL
    target at the scenario's typical decode batch, from the cost model.

    The typical batch is measured by a pilot run of the scenario at vLLM's default
    budget: the median number of running decodes and their median mean context over
    passes that carried prefill. The chunk is priced as the last chunk of a long prompt
    (the 90th-percentile prompt: its prefix is that length minus the chunk), because
    late chunks of long prompts pay the most attention and set the worst ITL.
    """

    kind = "rule"  # a static number, but derived by a rule from the scenario

    def __init__(self, tokens: int, typical: dict | None = None):
        super().__init__(tokens, name=f"sarathi-slo:{tokens}")
        self.typical = typical or {}

    @classmethod
    def fit(cls, scenario, workload=None, max_budget: int = 65536,
            prompt_percentile: float = 90.0) -> "SarathiSLOPolicy":
        sim = scenario.simulator(workload)
        pilot = VllmDefaultPolicy(sim.hardware)
        decodes, contexts = [], []

        def record(state):
            if state.running_decodes:
                decodes.append(state.running_decodes)
                contexts.append(state.decode_context_tokens / state.running_decodes)
            return pilot(state)

        sim.run(record)
        n = int(np.median(decodes)) if decodes else 0
        ctx = float(np.median(contexts)) if contexts else 0.0
        prompts = sim.workload.prompt_tokens
        prompt = int(np.percentile(prompts, prompt_percentile)) if len(prompts) else 0
        itl = scenario.slo_itl_s
        floor = scenario.max_num_seqs

        def pass_time(budget: int) -> float:
            chunk = max(budget - n, 0)
            prefix = max(prompt - chunk, 0)
            return pass_price(sim.cost, n, int(n * ctx), chunk, prefix if chunk else 0,
                              chunk_attention_pairs(chunk, prefix))

        lo, hi = floor, max_budget
        if pass_time(lo) > itl:
            best = lo  # even the smallest allowed budget misses the target: use it
        else:
            while lo < hi:  # largest budget with pass_time <= itl
                mid = (lo + hi + 1) // 2
                if pass_time(mid) <= itl:
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        return cls(best, {"decodes": n, "mean_context": ctx, "prompt_tokens": prompt,
                          "pass_s": pass_time(best)})


class TimeBudgetPolicy(BudgetPolicy):
    """Each pass, the largest budget whose priced duration stays within ``fraction`` of
    the ITL target: the cost model prices this pass's decodes (their contexts) and one
    chunk after the head request's prefilled prefix, and the chunk grows until the pass
    would take longer (:func:`envs.cost.chunk_within`). Sarathi-Serve's SLO-derived
    budget, worked out per pass instead of once. With nothing decoding no one's ITL is
    at stake and chunking only delays the prompt, so it uses the cap."""

    def __init__(self, itl_s: float, fraction: float = 0.9, cap: int = 16384):
        self.itl_s, self.fraction, self.cap = float(itl_s), float(fraction), int(cap)
        self.target_s = self.fraction * self.itl_s
        self.name = "time-budget" if fraction == 0.9 else f"time-budget:{fraction:g}"

    def chunk(self, state) -> int:
        """Prompt tokens this pass may carry within the target (the cap with no decodes)."""
        return self.budget(state) - state.running_decodes

    def budget(self, state) -> int:
        return time_budget(state.cost, state.running_decodes, state.decode_context_tokens,
                           state.head_prefilled_tokens, self.target_s, self.cap)


class TimeBudgetKVPolicy(TimeBudgetPolicy):
    """The time-budget rule, throttled as the KV cache fills: its fraction of the ITL
    target shrinks linearly from ``fraction`` at ``kv_low`` usage to ``floor`` at
    ``kv_high``. Under KV pressure, admitting prompts faster than decodes free blocks only
    buys preemptions (recomputation); a shorter time budget admits less per pass, as a
    small static budget does, while partial prefills still progress. Measured on
    h100-sxm + llama-3-8b with a third of the KV cache: 5.56 req/s against 4.83 for the
    unthrottled rule and 5.31 for the best static budget."""

    def __init__(self, itl_s: float, fraction: float = 0.9, kv_low: float = 0.6,
                 kv_high: float = 0.95, floor: float = 0.25, cap: int = 16384):
        super().__init__(itl_s, fraction, cap)
        self.kv_low, self.kv_high, self.floor = float(kv_low), float(kv_high), float(floor)
        self.name = "time-budget-kv" if fraction == 0.9 else f"time-budget-kv:{fraction:g}"

    def fraction_at(self, kv_usage: float) -> float:
        room = min(max((self.kv_high - kv_usage) / (self.kv_high - self.kv_low), 0.0), 1.0)
        return self.floor + (self.fraction - self.floor) * room

    def budget(self, state) -> int:
        seconds = self.fraction_at(state.kv_usage) * self.itl_s
        return time_budget(state.cost, state.running_decodes, state.decode_context_tokens,
                           state.head_prefilled_tokens, seconds, self.cap)


class TimeBudgetFewPolicy(TimeBudgetPolicy):
    """The time-budget rule that spends the p99 ITL slack when few decodes run: with ``n``
    decodes below ``decodes``, the time budget grows to ``fraction * decodes / n`` (at most
    ``top`` times the ITL target). A long pass then slows only a few tokens, and a p99
    target tolerates 1% of tokens over it, while the waiting prompts are prefilled in
    fewer, cheaper passes (each pass re-reads the weights). Measured on a100-80g +
    llama-3-8b with bursty long prompts: 0.316 req/s against 0.253 for the plain rule and
    0.33 for the best static budget (6,889); on the M5 Max laptop part it loses 80%, so it
    is one of the teachers a training run chooses among, not a default."""

    def __init__(self, itl_s: float, fraction: float = 0.9, decodes: int = 4, top: float = 8.0,
                 cap: int = 16384):
        super().__init__(itl_s, fraction, cap)
        self.decodes, self.top = int(decodes), float(top)
        self.name = "time-budget-few" if fraction == 0.9 else f"time-budget-few:{fraction:g}"

    def fraction_at(self, num_decodes: int) -> float:
        if not num_decodes:
            return self.fraction
        return self.fraction * min(max(1.0, self.decodes / num_decodes), self.top / self.fraction)

    def budget(self, state) -> int:
        seconds = self.fraction_at(state.running_decodes) * self.itl_s
        return time_budget(state.cost, state.running_decodes, state.decode_context_tokens,
                           state.head_prefilled_tokens, seconds, self.cap)


class TimeBudgetSlackPolicy(TimeBudgetPolicy):
    """The time-budget rule that spends the p99 ITL slack: a pass may take up to ``top``
    times the ITL target while the decode tokens over the target stay under 0.8% of all
    decode tokens (the last few minutes' count, :mod:`envs.slack`); otherwise it keeps to
    ``fraction`` of it. A p99 target tolerates 1% of tokens over it; where the TTFT target
    is tight for the longest prompts, each pass within the ITL target re-reads the weights
    and carries the decodes, so a long prompt chunked to fit it arrives later than in a
    few long passes (a 16K prompt on an A100 with ten 600-token decodes: 1.65 s in 17
    passes at 100 ms, 1.55 s in 3 passes of 6,889 tokens, against a 2 s TTFT target). Only
    the slow tokens the engine actually produced are counted: passes over the target with
    nothing decoding cost nothing.

    ``kv_aware``: the base fraction shrinks as the KV cache fills (the time-budget-kv
    rule), and the slack is spent only below its ``kv_low`` usage: under KV pressure,
    admitting a long prompt sooner only buys preemptions."""

    def __init__(self, itl_s: float, top: float = 4.0, fraction: float = 1.0, cap: int = 16384,
                 kv_aware: bool = False):
        super().__init__(itl_s, fraction, cap)
        self.top = float(top)
        self.kv = TimeBudgetKVPolicy(itl_s, fraction, cap=cap) if kv_aware else None
        name = "time-budget-slack-kv" if kv_aware else "time-budget-slack"
        self.name = name if top == 4.0 else f"{name}:{top:g}"

    def spend(self, state) -> bool:
        """Whether this pass may spend the slack beyond what :meth:`fraction_at` checks
        (always, for this rule)."""
        return True

    def fraction_at(self, num_decodes: int, slack_passes: float, kv_usage: float = 0.0) -> float:
        """``top`` while the slack covers one more pass over the target (and, KV-aware, the
        cache is below ``kv_low``), else the base fraction."""
        kv = self.kv
        if num_decodes and slack_passes >= 1.0 and (kv is None or kv_usage < kv.kv_low):
            return self.top
        return self.fraction if kv is None else kv.fraction_at(kv_usage)

    def budget(self, state) -> int:
        n = state.running_decodes
        # The slack is read every pass, spent or not: the count starts at its first reading.
        slack = state.itl_slack(self.itl_s).passes(n) if n else 0.0
        if slack >= 1.0 and not self.spend(state):
            slack = 0.0
        fraction = self.fraction_at(n, slack, state.kv_usage if self.kv is not None else 0.0)
        return time_budget(state.cost, n, state.decode_context_tokens, state.head_prefilled_tokens,
                           fraction * self.itl_s, self.cap)


DEADLINE_MARGIN = 0.8
"""Share of the TTFT target past which the deadline rule counts the prefill queue as late."""
KV_STEP_LOW, KV_STEP_HIGH, KV_STEP_FLOOR = 0.75, 0.95, 0.25
"""The KV-aware deadline rule's throttle: the whole base fraction below 75% KV usage, the
floor from 95% on. Chosen by the training return over three presets' training conditions
(48 episodes each, loaded at 0.5-1.5 times capacity): a throttle from 60% (the
time-budget-kv rule's) costs the most on h100-sxm and h200, one from 85% the most on the
L40S, one from 75% is never the worst."""


@dataclass(frozen=True)
class KVSteps:
    """A KV throttle on the action ladder: the base fraction while the cache is below
    ``kv_low``, then the ladder's rungs down to ``floor`` as usage climbs to ``kv_high``
    (the linear ramp of :class:`TimeBudgetKVPolicy`, rounded up to the next rung). The
    steps sit at fixed KV usages (:attr:`edges`), so a table with those edges holds the
    throttle exactly: the same ``bisect_right`` on the same numbers."""

    fraction: float = 1.0
    kv_low: float = KV_STEP_LOW
    kv_high: float = KV_STEP_HIGH
    floor: float = KV_STEP_FLOOR

    def __post_init__(self) -> None:
        from envs.errors import require

        require(0 <= self.kv_low < self.kv_high <= 1, "kv_high", self.kv_high,
                f"must lie in (kv_low {self.kv_low:g}, 1], with kv_low >= 0")
        require(0 < self.floor <= self.fraction, "floor", self.floor,
                f"must lie in (0, the base fraction {self.fraction:g}]")

    @cached_property
    def fractions(self) -> tuple[float, ...]:
        """The base fraction, then each rung of the ladder below it down to the floor."""
        from envs.actions import FRACTION_LADDER

        rungs = sorted((r for r in FRACTION_LADDER if self.floor <= r < self.fraction), reverse=True)
        return (self.fraction, *rungs)

    @cached_property
    def edges(self) -> tuple[float, ...]:
        """Where the ramp reaches each rung below the base fraction (increasing, above
        ``kv_low``); none where the base fraction is the floor."""
        if self.fraction == self.floor:
            return ()
        span = (self.kv_high - self.kv_low) / (self.fraction - self.floor)
        return tuple(self.kv_high - (r - self.floor) * span for r in self.fractions[1:])

    def fraction_at(self, kv_usage: float) -> float:
        return self.fractions[bisect_right(self.edges, kv_usage)]


class TimeBudgetDeadlinePolicy(TimeBudgetSlackPolicy):
    """The slack rule that spends the p99 ITL slack only for TTFT deadlines: a pass goes
    beyond the base fraction (up to ``top`` times the ITL target, while the slack lasts)
    only when the prefill queue is due late: the oldest waiting request's wait plus the
    time passes of the base fraction take to prefill every waiting prompt token exceeds
    ``margin`` of the TTFT target (:func:`envs.cost.prefill_due_s`). The plain slack rule
    spends the slack on every long prompt, also on a lone one that makes its deadline
    anyway, and has none left when two long prompts arrive together. Measured on the
    suite (5 streams): within 2% of the best static budget on 22 of 23 scenarios, where
    the slack rule is within 2% on 17; the margin was chosen on a100-mixed alone (0.7,
    0.8 and 0.9 within 1% of each other there).

    ``kv_aware``: the base fraction steps down the action ladder as the KV cache fills
    (:class:`KVSteps`, from 75% usage), and the slack is spent only below 75%: under KV
    pressure a prompt admitted sooner only buys preemptions (recomputation)."""

    def __init__(self, itl_s: float, ttft_s: float, top: float = 4.0, fraction: float = 1.0,
                 margin: float = DEADLINE_MARGIN, cap: int = 16384, kv_aware: bool = False):
        super().__init__(itl_s, top, fraction, cap)
        self.ttft_s, self.margin = float(ttft_s), float(margin)
        self.kv = KVSteps(self.fraction) if kv_aware else None
        name = "time-budget-deadline-kv" if kv_aware else "time-budget-deadline"
        self.name = name if top == 4.0 else f"{name}:{top:g}"

    def spend(self, state) -> bool:
        """Whether the prefill queue is due later than ``margin`` of the TTFT target."""
        return prefill_due_s(state.cost, state.running_decodes, state.decode_context_tokens,
                             state.head_prefilled_tokens, state.waiting_prefill_tokens,
                             state.oldest_wait_s, self.fraction * self.itl_s) > self.margin * self.ttft_s
