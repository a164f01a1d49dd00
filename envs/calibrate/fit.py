"""Fitting the cost model's device figures to measured passes (numpy only).

A fit is least squares on the relative error of the pass price (``envs.pricing``'s
formula, over fitted rates) over measured passes, each described by its parts on one
device (:data:`PART_COLUMNS`).
Every third measurement is held out and reported apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from envs.cost import Roofline, pass_parts
from envs.errors import ConfigError
from envs.pricing import combine
from envs.profiles import MAX_BYTES_PER_S, MAX_FLOPS_PER_S, MAX_RATIO, MIN_RATE, HardwareProfile

PART_COLUMNS = ("weight_bytes", "kv_bytes", "product_flops", "attention_flops", "elementwise_bytes",
                "allreduce_bytes", "allreduce_calls", "layers")
"""What a pass moves and computes on one device of its group, the columns of ``parts``:
bytes and FLOPs on the roofline, bytes of the small kernels, bytes and count of the
all-reduces (as busBw counts them), and decoder layers (each costs a fixed time)."""


@dataclass(frozen=True)
class Fit:
    """Fitted device figures: weight-streaming bandwidth, weight-product FLOP/s, the
    attention kernels' rates relative to those, the overlap of memory and compute, the
    per-pass and per-layer overheads, the small kernels' bandwidth and the all-reduce's
    bus bandwidth and latency (see envs.cost; an infinite rate costs nothing)."""

    bytes_per_s: float
    flops_per_s: float
    attention_bandwidth_ratio: float = 1.0
    attention_flops_ratio: float = 1.0
    overlap: float = 1.0
    overhead_s: float = 0.0
    per_layer_overhead_s: float = 0.0
    elementwise_bytes_per_s: float = math.inf
    interconnect_bytes_per_s: float = math.inf
    allreduce_latency_s: float = 0.0

    def predict(self, parts: np.ndarray) -> np.ndarray:
        """Pass seconds for rows of parts (:data:`PART_COLUMNS`; missing trailing columns
        are 0, so the roofline's four alone will do)."""
        parts = np.asarray(parts, dtype=float)
        parts = np.pad(parts, ((0, 0), (0, len(PART_COLUMNS) - parts.shape[1])))
        wb, kvb, lf, af, ewb, arb, calls, layers = parts.T
        mem = wb / self.bytes_per_s + kvb / (self.bytes_per_s * self.attention_bandwidth_ratio)
        comp = lf / self.flops_per_s + af / (self.flops_per_s * self.attention_flops_ratio)
        outside = (self.overhead_s + layers * self.per_layer_overhead_s
                   + ewb / self.elementwise_bytes_per_s + arb / self.interconnect_bytes_per_s
                   + calls * self.allreduce_latency_s)
        return combine(mem, comp, 1 - self.overlap, outside, np.maximum, np.minimum)

    def profile(self, name: str, memory_bytes: float, overhead_s: float | None = None) -> HardwareProfile:
        def finite(rate: float) -> float | None:
            # A rate beyond any device's is a term the fit found no cost in: left out.
            return float(rate) if math.isfinite(rate) and rate <= MAX_BYTES_PER_S else None

        return HardwareProfile(
            name=name, hbm_bytes_per_s=float(self.bytes_per_s), peak_flops_per_s=float(self.flops_per_s),
            memory_bytes=memory_bytes, bandwidth_fraction=1.0, flops_fraction=1.0,
            per_pass_overhead_s=float(self.overhead_s if overhead_s is None else overhead_s),
            attention_bandwidth_ratio=float(self.attention_bandwidth_ratio),
            attention_flops_ratio=float(self.attention_flops_ratio), overlap=float(self.overlap),
            per_layer_overhead_s=float(self.per_layer_overhead_s),
            elementwise_bytes_per_s=finite(self.elementwise_bytes_per_s),
            interconnect_bytes_per_s=finite(self.interconnect_bytes_per_s),
            allreduce_latency_s=float(self.allreduce_latency_s))

    def describe(self) -> str:
        text = (f"{self.bytes_per_s / 1e9:.1f} GB/s, {self.flops_per_s / 1e9:.1f} GFLOP/s, attention at "
                f"{self.attention_bandwidth_ratio:.2f}x bandwidth and {self.attention_flops_ratio:.2f}x "
                f"FLOP/s, overlap {self.overlap:.2f}, {self.overhead_s * 1e3:.2f} ms per pass")
        if self.per_layer_overhead_s:
            text += f", {self.per_layer_overhead_s * 1e6:.1f} us per layer"
        if math.isfinite(self.elementwise_bytes_per_s):
            text += f", small kernels at {self.elementwise_bytes_per_s / 1e9:.0f} GB/s"
        return text


LOG_LOW = np.log([MIN_RATE, MIN_RATE, 1.0, 1 / MAX_RATIO, 1 / MAX_RATIO, 1.0])
LOG_HIGH = np.log([MAX_BYTES_PER_S, MAX_FLOPS_PER_S, 1.0, MAX_RATIO, MAX_RATIO, 1.0])
LOG_LOW[[2, 5]], LOG_HIGH[[2, 5]] = -60.0, 60.0  # logistic overhead and overlap: exp() stays finite
RATIO_PRIOR = 0.02
"""Weight of the pull of log attention ratios towards 0 (ratio 1) in the fit."""


def shape_parts(rf: Roofline, shapes) -> np.ndarray:
    """Parts (:data:`PART_COLUMNS`) of each pass shape on one device, from the model's
    :func:`unit_roofline` (whose coefficients are those quantities themselves)."""
    rows = []
    for sh in shapes:
        wb, kvb, lf, af = pass_parts(rf, sh)
        rows.append((wb * rf.seconds_per_byte, kvb * rf.seconds_per_kv_byte, lf * rf.seconds_per_flop,
                     af * rf.seconds_per_attention_flop, rf.elementwise_s_per_token * sh.tokens,
                     rf.allreduce_s_per_token * sh.tokens, rf.allreduce_fixed_s, rf.overhead_s))
    return np.array(rows, dtype=float).reshape(-1, len(PART_COLUMNS))


def fit_passes(parts: np.ndarray, seconds: np.ndarray, *, refined: bool = True,
               overhead_s: float | None = None) -> Fit:
    """Least squares on the relative error of the pass price (envs.cost) over measured
    passes. ``refined=False`` fits the plain roofline (bandwidth, FLOP/s, overhead);
    ``refined`` also fits the attention ratios and the overlap. ``overhead_s`` pins the
    overhead (measured apart), which a fixed model's weight time is otherwise
    indistinguishable from.

    Levenberg-Marquardt from several starts, on log rates, a logistic overlap and a
    bounded overhead, so every fitted figure stays in its allowed range.
    """
    if len(seconds) < (6 if refined else 3):
        raise ConfigError(f"fit: {len(seconds)} measured passes are too few for the "
                          f"{'refined' if refined else 'roofline'} fit")
    parts = np.asarray(parts, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    total_bytes = parts[:, 0] + parts[:, 1]
    total_flops = parts[:, 2] + parts[:, 3]
    o_cap = float(seconds.min())

    def unpack(x: np.ndarray) -> Fit:
        # Rates stay within what a profile accepts: where the measured passes do not pin a
        # rate down (no pass is memory-bound, say), it rests at its bound, where its term
        # costs next to nothing, instead of wandering off to 1e26.
        x = np.clip(x, LOG_LOW[:len(x)], LOG_HIGH[:len(x)])
        o = overhead_s if overhead_s is not None else o_cap / (1 + math.exp(-x[2]))
        if not refined:
            return Fit(math.exp(x[0]), math.exp(x[1]), overhead_s=o)
        return Fit(math.exp(x[0]), math.exp(x[1]), math.exp(x[3]), math.exp(x[4]),
                   1 / (1 + math.exp(-x[5])), o)

    def residual(x: np.ndarray) -> np.ndarray:
        rel = unpack(x).predict(parts) / seconds - 1
        if not refined:
            return rel
        # A weak pull of the attention ratios towards 1: where the measured shapes carry
        # too little attention to pin one down, it stays at the plain roofline's value.
        return np.concatenate([rel, RATIO_PRIOR * x[3:5]])

    b0 = math.log(float(np.max(total_bytes / seconds)))
    f0 = math.log(float(np.max(total_flops / seconds)))
    starts = []
    for db, df in ((0, 0), (1, 1), (-1, 0), (0, -1)):
        base = [b0 + db, f0 + df, 0.0]
        if refined:
            starts += [np.array(base + [a, a, z]) for a in (0.0, -2.0) for z in (3.0, -3.0)]
        else:
            starts.append(np.array(base))
    best = min((least_squares(residual, x) for x in starts), key=lambda lx: lx[0])
    return unpack(best[1])


def least_squares(residual, x: np.ndarray) -> tuple[float, np.ndarray]:
    """Levenberg-Marquardt with a forward-difference Jacobian: (loss, x) at the minimum
    of ``sum(residual(x)**2)`` reached from ``x``."""
    lam, r = 1e-2, residual(x)
    loss = float(r @ r)
    for _ in range(200):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = 1e-6 * max(1.0, abs(x[j]))
            jac[:, j] = (residual(x + dx) - r) / dx[j]
        g, h = jac.T @ r, jac.T @ jac
        while lam < 1e12:
            step = np.linalg.solve(h + lam * (np.diag(np.diag(h)) + 1e-9 * np.eye(len(x))), -g)
            r_new = residual(x + step)
            new = float(r_new @ r_new)
            if np.isfinite(new) and new < loss:
                break
            lam *= 4
        else:
            break
        improved = loss - new
        x, r, loss, lam = x + step, r_new, new, max(lam / 3, 1e-9)
        if improved < 1e-12 * max(loss, 1e-30):
            break
    return loss, x


def unit_roofline(model) -> Roofline:
    """A roofline whose coefficients are the model's bytes, FLOPs, all-reduce calls and
    layers themselves (every rate and fixed cost of the device is 1)."""
    return Roofline.of(HardwareProfile("unit", hbm_bytes_per_s=1.0, peak_flops_per_s=1.0,
                                       memory_bytes=1.0, bandwidth_fraction=1.0,
                                       flops_fraction=1.0, per_layer_overhead_s=1.0,
                                       elementwise_bytes_per_s=1.0, interconnect_bytes_per_s=1.0,
                                       allreduce_latency_s=1.0), model)


def held_out(n: int) -> np.ndarray:
    """Every third measurement is held out of the fit."""
    return np.arange(n) % 3 == 2


def ape(fit: Fit, parts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Absolute percentage error of each predicted pass."""
    return np.abs(fit.predict(parts) - seconds) / seconds


def error_line(label: str, err: np.ndarray) -> str:
    return f"{label}: median APE {np.median(err):.1%}, p90 {np.percentile(err, 90):.1%}"


def fit_overhead(base: Fit, parts: np.ndarray, seconds: np.ndarray) -> Fit:
    """``base`` with only its per-pass overhead refitted (least squares on the relative
    error, in closed form; never below 0)."""
    rest = replace(base, overhead_s=0.0).predict(parts)
    w = 1 / seconds**2
    return replace(base, overhead_s=max(float(np.sum(w * (seconds - rest)) / np.sum(w)), 0.0))


def fit_of(profile: HardwareProfile) -> Fit:
    """A profile's figures as a :class:`Fit` (one device's rates)."""
    def rate(value: float | None) -> float:
        return math.inf if value is None else value

    return Fit(profile.effective_bytes_per_s, profile.effective_flops_per_s,
               profile.attention_bandwidth_ratio, profile.attention_flops_ratio, profile.overlap,
               profile.per_pass_overhead_s, profile.per_layer_overhead_s,
               rate(profile.elementwise_bytes_per_s), rate(profile.interconnect_bytes_per_s),
               profile.allreduce_latency_s)


