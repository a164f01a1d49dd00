"""Fitting the cost model's device figures to measured passes (numpy only).

A fit is least squares on the relative error of the pass price (``envs.cost``) over
measured passes, each described by its (weight bytes, KV bytes, weight-product FLOPs,
attention FLOPs). Every third measurement is held out and reported apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from envs.cost import Roofline, pass_parts
from envs.errors import ConfigError
from envs.profiles import HardwareProfile


@dataclass(frozen=True)
class Fit:
    """Fitted device figures: weight-streaming bandwidth, weight-product FLOP/s, the
    attention kernels' rates relative to those, the overlap of memory and compute, and
    the per-pass overhead (see envs.cost)."""

    bytes_per_s: float
    flops_per_s: float
    attention_bandwidth_ratio: float = 1.0
    attention_flops_ratio: float = 1.0
    overlap: float = 1.0
    overhead_s: float = 0.0

    def predict(self, parts: np.ndarray) -> np.ndarray:
        """Pass seconds for rows of (weight bytes, KV bytes, product FLOPs, attention FLOPs)."""
        wb, kvb, lf, af = parts.T
        mem = wb / self.bytes_per_s + kvb / (self.bytes_per_s * self.attention_bandwidth_ratio)
        comp = lf / self.flops_per_s + af / (self.flops_per_s * self.attention_flops_ratio)
        return np.maximum(mem, comp) + (1 - self.overlap) * np.minimum(mem, comp) + self.overhead_s

    def profile(self, name: str, memory_bytes: float, overhead_s: float | None = None) -> HardwareProfile:
        return HardwareProfile(
            name=name, hbm_bytes_per_s=float(self.bytes_per_s), peak_flops_per_s=float(self.flops_per_s),
            memory_bytes=memory_bytes, bandwidth_fraction=1.0, flops_fraction=1.0,
            per_pass_overhead_s=float(self.overhead_s if overhead_s is None else overhead_s),
            attention_bandwidth_ratio=float(self.attention_bandwidth_ratio),
            attention_flops_ratio=float(self.attention_flops_ratio), overlap=float(self.overlap))

    def describe(self) -> str:
        return (f"{self.bytes_per_s / 1e9:.1f} GB/s, {self.flops_per_s / 1e9:.1f} GFLOP/s, attention at "
                f"{self.attention_bandwidth_ratio:.2f}x bandwidth and {self.attention_flops_ratio:.2f}x "
                f"FLOP/s, overlap {self.overlap:.2f}, {self.overhead_s * 1e3:.2f} ms per pass")


RATIO_PRIOR = 0.02
"""Weight of the pull of log attention ratios towards 0 (ratio 1) in the fit."""


def shape_parts(rf: Roofline, shapes) -> np.ndarray:
    """(weight bytes, KV bytes, product FLOPs, attention FLOPs) per pass shape."""
    return np.array([pass_parts(rf, sh) for sh in shapes], dtype=float)


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
        x = np.clip(x, -60.0, 60.0)  # keeps exp() finite while the search wanders
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

    def solve(x: np.ndarray) -> tuple[float, np.ndarray]:
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

    b0 = math.log(float(np.max(total_bytes / seconds)))
    f0 = math.log(float(np.max(total_flops / seconds)))
    starts = []
    for db, df in ((0, 0), (1, 1), (-1, 0), (0, -1)):
        base = [b0 + db, f0 + df, 0.0]
        if refined:
            starts += [np.array(base + [a, a, z]) for a in (0.0, -2.0) for z in (3.0, -3.0)]
        else:
            starts.append(np.array(base))
    best = min((solve(x) for x in starts), key=lambda lx: lx[0])
    return unpack(best[1])



def unit_roofline(model) -> Roofline:
    """A roofline whose coefficients are the model's bytes and FLOPs themselves."""
    return Roofline.of(HardwareProfile("unit", hbm_bytes_per_s=1.0, peak_flops_per_s=1.0,
                                       memory_bytes=1.0, bandwidth_fraction=1.0,
                                       flops_fraction=1.0), model)


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
    return Fit(profile.effective_bytes_per_s, profile.effective_flops_per_s,
               profile.attention_bandwidth_ratio, profile.attention_flops_ratio, profile.overlap,
               profile.per_pass_overhead_s)


