"""Measured engine steps as calibration data: read them, fit the cost model to them.

The CSV has columns ``decode_contexts`` (each decode's context, ';'-separated),
``chunks`` ('size@prefix;...') and ``seconds``; ``benchmarks/sim_vs_vllm.py`` records
vLLM's steps in this form.
"""

from __future__ import annotations

import math

import numpy as np

from envs.calibrate.fit import Fit, fit_of, fit_overhead, fit_passes, held_out, shape_parts, unit_roofline
from envs.cost import PassShape
from envs.errors import MAX_TOKENS, ConfigError, show
from envs.files import csv_rows
from envs.profiles import HardwareProfile


STEPS_MAX_BYTES = 1 << 30
STEP_MAX_S = 3600.0
"""Longest plausible engine step, seconds."""
COLUMNS = ("decode_contexts", "chunks", "seconds")


def _count(path: str, line: int, column: str, text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:  # not an integer, or one of over 4,300 digits
        value = None
    if value is None or not low <= value <= MAX_TOKENS:
        raise ConfigError(f"steps: {show(path, 200)} line {line}: {column}: got {show(text)}, must be "
                          f"an integer >= {low} and <= {MAX_TOKENS}")
    return value


def _step(path: str, line: int, contexts: str, chunks: str, seconds: str):
    ctx = [_count(path, line, "decode_contexts", c, 1) for c in contexts.split(";") if c.strip()]
    parts = []
    for c in (c for c in chunks.split(";") if c.strip()):
        size, at, prefix = c.partition("@")
        if not at or "@" in prefix:
            raise ConfigError(f"steps: {show(path, 200)} line {line}: chunks: got {show(c)}, each chunk "
                              "must be SIZE@PREFIX")
        parts.append((_count(path, line, "chunks size", size, 1),
                      _count(path, line, "chunks prefix", prefix, 0)))
    try:
        sec = float(seconds)
    except ValueError:
        sec = math.nan
    if not (math.isfinite(sec) and 0 < sec <= STEP_MAX_S):
        raise ConfigError(f"steps: {show(path, 200)} line {line}: seconds: got {show(seconds)}, must be "
                          f"a finite number > 0 and <= {STEP_MAX_S:g}")
    if not ctx and not parts:
        raise ConfigError(f"steps: {show(path, 200)} line {line}: a step must carry a decode or a chunk")
    return ctx, parts, sec


def read_steps(path: str) -> list[tuple[list[int], list[tuple[int, int]], float]]:
    """Every measured step; a bad row is refused with its line and field."""
    rows = csv_rows("steps", path, STEPS_MAX_BYTES)
    line, header = next(rows, (1, []))
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise ConfigError(f"steps: {show(path, 200)} line {line}: needs columns {', '.join(COLUMNS)}; "
                          f"missing {', '.join(missing)}")
    at = [names.index(c) for c in COLUMNS]
    steps = []
    for line, row in rows:
        if len(row) < len(names):
            raise ConfigError(f"steps: {show(path, 200)} line {line}: expected {len(names)} fields, "
                              f"got {len(row)}")
        steps.append(_step(path, line, *(row[i] for i in at)))
    if len(steps) < 6:
        raise ConfigError(f"steps: {show(path, 200)} holds {len(steps)} steps, need at least 6")
    return steps


def fit_steps(steps, model, refined: bool = True,
              base: HardwareProfile | None = None) -> tuple[Fit, Fit | None, np.ndarray, np.ndarray]:
    """Fit on two thirds of measured engine steps: (fit, plain-roofline fit, parts, seconds).
    With ``base``, its device figures are kept and only the per-step overhead is fitted
    (no plain fit then: None)."""
    # Parts are one device's share of each step, so the fitted rates are one device's.
    parts = shape_parts(unit_roofline(model), [PassShape.of(c, k) for c, k, _ in steps])
    secs = np.array([t for _, _, t in steps])
    held = held_out(len(steps))
    if base is not None:
        return fit_overhead(fit_of(base), parts[~held], secs[~held]), None, parts, secs
    plain = fit_passes(parts[~held], secs[~held], refined=False)
    fit = fit_passes(parts[~held], secs[~held]) if refined else plain
    return fit, plain, parts, secs





JITTER_POINTS = 101
"""Quantiles a measured jitter keeps: every 1% from 0 to 1 (the tail a p99 target counts)."""
JITTER_MIN_STEPS = 40
"""Fewer steps with prefill than this measure no jitter."""


def step_jitter(priced: np.ndarray, measured: np.ndarray,
                points: int = JITTER_POINTS) -> tuple[tuple[float, ...], float, float]:
    """A profile's ``(step_jitter, step_jitter_s, step_jitter_share)`` from steps' priced and
    measured seconds (steps with prefill work, where a policy's choice sets the time).

    Each step's jitter is its measured seconds less its price times the running median of
    measured / priced along the price (a window of a tenth of the steps, at least 11), so
    that what the fit gets wrong as a function of size, which a jitter would blur into
    noise, is left out. Its scale ``a + b * price`` is the least-squares line (a, b >= 0)
    through the jitters' absolute values; the quantiles are those of jitter / scale at
    ``points`` evenly spaced probabilities, centred on their median. ((), 0, 0) when fewer
    than ``JITTER_MIN_STEPS`` steps are given."""
    priced, measured = np.asarray(priced, dtype=float), np.asarray(measured, dtype=float)
    if len(priced) < JITTER_MIN_STEPS:
        return (), 0.0, 0.0
    order = np.argsort(priced, kind="stable")
    priced, measured = priced[order], measured[order]
    ratio = measured / priced
    half = max(5, len(ratio) // 20)
    trend = np.array([np.median(ratio[max(0, i - half):i + half + 1]) for i in range(len(ratio))])
    extra = measured - trend * priced
    a, b = _nonnegative_line(priced, np.abs(extra))
    typical = float(np.median(priced))
    if a + b * typical <= 1e-6 * typical:  # every step on its trend: no jitter to measure
        return (), 0.0, 0.0
    z = extra / (a + b * priced)
    q = np.quantile(z, np.linspace(0.0, 1.0, points))
    return tuple(float(x) for x in q - np.median(z)), float(a), float(b)


def _nonnegative_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ~ a + b x with a, b >= 0 (the best of the free fit, if it qualifies,
    and the two one-parameter fits)."""
    options = [(float(np.mean(y)), 0.0), (0.0, float(x @ y / (x @ x)) if x @ x > 0 else 0.0)]
    if np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            options.append((float(a), float(b)))
    return min(options, key=lambda ab: float(np.sum((y - ab[0] - ab[1] * x) ** 2)))


def jitter_line(jitter: tuple[tuple[float, ...], float, float], steps: int) -> str:
    """``step jitter (N steps with prefill): (A ms + B x price) x z, z p1 ... p99 ...``."""
    z, a, b = jitter
    if not z:
        return f"no step jitter: {steps} steps with prefill, need {JITTER_MIN_STEPS} off their trend"
    grid = np.linspace(0.0, 1.0, len(z))
    at = ", ".join(f"p{round(p * 100)} {float(np.interp(p, grid, z)):+.2f}" for p in (0.01, 0.1, 0.9, 0.99))
    return (f"step jitter ({steps} steps with prefill, around the price): ({a * 1e3:.2f} ms + "
            f"{b:.3f} x price) x z, z {at}, max {z[-1]:+.2f}; at 10 ms p90 "
            f"{(a + b * 0.01) * float(np.interp(0.9, grid, z)) * 1e3:+.1f} ms, at 90 ms p90 "
            f"{(a + b * 0.09) * float(np.interp(0.9, grid, z)) * 1e3:+.1f} ms")
