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
:data:`WINDOW` ratios, within :data:`BOUNDS`. The table then budgets each pass at its
fraction of the ITL target divided by the scale: a pass the model prices at ``t``
takes about ``scale * t`` on this engine. The median is robust to the odd slow step (a
garbage collection, a page fault); the window lets the scale follow an engine whose
speed changes (a neighbour's job starting on a shared host) within a few dozen steps;
the bounds keep a broken clock or a table for another model from budgeting passes
absurdly (a scale held at a bound is logged, since the table is then far from this
engine). Until :data:`WARMUP` steps are seen the scale is 1: the stored model.

One scale multiplies the whole price. An engine whose fixed cost per step differs from
the model's more than its per-token costs do is corrected exactly at the pass sizes it
serves most and approximately elsewhere; ``python -m envs.calibrate --steps`` refits
the model itself from recorded steps.
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
        ratio = measured_s / priced_s
        self._ratios.append(ratio)
        bisect.insort(self._sorted, ratio)
        if len(self._ratios) > self.window:
            old = self._ratios.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self.seen += 1
        if self.seen >= self.warmup:
            k = len(self._sorted)
            mid = (self._sorted[(k - 1) // 2] + self._sorted[k // 2]) / 2
            self.value = min(max(mid, self.low), self.high)
        return self.value

    @property
    def at_bound(self) -> bool:
        """Whether the scale is held at a bound (the engine is far from the table's model)."""
        return self.seen >= self.warmup and self.value in (self.low, self.high)
