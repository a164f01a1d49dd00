"""What a fit to Vidur's per-layer operator times shows: error tables and a plot.

Errors are absolute relative errors of each row's per-layer time, summarised as median
and 90th percentile, apart for tp 1 and tp 2-8 (one device's operators at every degree;
at tp > 1 the shapes are 1/tp of a layer's projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.calibrate.fit import Fit
from envs.calibrate.vidur import (VidurTable, abs_error, fit_layers, fitted_profile, flat_end, layer_parts,
                                  price_rows)
from envs.files import atomic_path
from envs.profiles import HardwareProfile

TP_GROUPS = (("tp 1", lambda tp: tp == 1), ("tp 2-8", lambda tp: tp > 1))


@dataclass(frozen=True)
class Errors:
    """Absolute relative errors of some rows, with each row's tp."""

    err: np.ndarray
    tp: np.ndarray

    @classmethod
    def of(cls, profile: HardwareProfile, tables: list[VidurTable]) -> "Errors":
        if not tables:
            return cls(np.zeros(0), np.zeros(0, dtype=int))
        return cls(np.concatenate([abs_error(price_rows(profile, t), t.seconds) for t in tables]),
                   np.concatenate([t.tp for t in tables]))

    def summary(self, group: str | None = None) -> tuple[int, float, float]:
        """(rows, median, p90) of one tp group (all rows for None); NaN without rows."""
        err = self.err if group is None else self.err[dict(TP_GROUPS)[group](self.tp)]
        if not len(err):
            return 0, float("nan"), float("nan")
        return len(err), float(np.median(err)), float(np.percentile(err, 90))


def pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def cell(fitted: Errors, plain: Errors, group: str) -> str:
    n, med, p90 = fitted.summary(group)
    if not n:
        return "-"
    _, dmed, dp90 = plain.summary(group)
    return f"{pct(med)} / {pct(p90)} ({pct(dmed)} / {pct(dp90)})"


def file_table(tables: list[VidurTable], held: set[str], fitted: HardwareProfile,
               datasheet: HardwareProfile) -> list[str]:
    """One line a file: rows, then median / p90 error at tp 1 and tp 2-8, fitted
    profile first and the datasheet's in brackets; held-out files starred."""
    width = max(len(t.name) for t in tables) + 2
    lines = [f"absolute error of the per-layer time, median / p90: {fitted.name} "
             f"({datasheet.name} in brackets); * = held out of the fit",
             f"  {'file':{width}} {'rows':>5}  {'tp 1':34} tp 2-8"]
    for t in tables:
        fe, de = Errors.of(fitted, [t]), Errors.of(datasheet, [t])
        mark = "*" if t.path in held else " "
        lines.append(f"  {t.name + mark:{width}} {len(t):5d}  {cell(fe, de, 'tp 1'):34} "
                     f"{cell(fe, de, 'tp 2-8')}")
    return lines


def held_out_lines(fitted: Errors, plain: Errors, datasheet_name: str) -> list[str]:
    lines = []
    for group, _ in TP_GROUPS:
        n, med, p90 = fitted.summary(group)
        if n:
            _, dmed, dp90 = plain.summary(group)
            lines.append(f"held-out rows, {group} ({n}): median {pct(med)}, p90 {pct(p90)}; "
                         f"{datasheet_name}: median {pct(dmed)}, p90 {pct(dp90)}")
    return lines


def free_ride_line(tables: list[VidurTable], fitted: HardwareProfile, datasheet: HardwareProfile) -> str:
    """Where the measured layer stops being flat, and where the fitted and datasheet
    rooflines put the crossing of memory and compute (a projection's arithmetic
    intensity is one FLOP per weight byte per token, so the crossing in tokens is
    FLOP/s / bandwidth)."""
    flat = [f"{flat_end(t)} ({t.name})" for t in tables if (t.tp == 1).any()]
    cross = lambda hw: hw.effective_flops_per_s / hw.effective_bytes_per_s  # noqa: E731
    return (f"free ride: the measured layer at tp 1 stays within 10% of its time at 1 token up "
            f"to {', '.join(flat)} tokens; memory and compute times cross at "
            f"{cross(fitted):.0f} tokens on {fitted.name}, {cross(datasheet):.0f} on {datasheet.name}")


def tile_line(fit_tables: list[VidurTable], held_tables: list[VidurTable], peak: HardwareProfile) -> str:
    """Held-out error of the same fit with the products' tokens rounded up to a tile: what
    tile quantisation would buy the cost model (which does not carry it)."""
    def held_error(tile: int) -> str:
        tiled = fit_layers(fit_tables, peak, tile)
        err = np.concatenate([abs_error(tiled.predict(layer_parts(t, tile)), t.seconds) for t in held_tables])
        return f"{pct(float(np.median(err)))} / {pct(float(np.percentile(err, 90)))}"

    return ("tile quantisation of the products (not in the cost model), all held-out rows, median / "
            "p90: " + ", ".join(f"{label} {held_error(tile)}" for tile, label in
                                ((1, "none"), (64, "64 tokens"), (128, "128 tokens"))))


def cross_validation_lines(tables: list[VidurTable], peak: HardwareProfile) -> list[str]:
    """Each file's error when the fit is made on all the others."""
    lines = ["each file held out in turn (fitted on the others), median / p90:"]
    for t in tables:
        others = [u for u in tables if u is not t]
        err = Errors.of(fitted_profile(fit_layers(others, peak), peak, "cross-validation"), [t])
        groups = [f"{g} {pct(err.summary(g)[1])} / {pct(err.summary(g)[2])}" for g, _ in TP_GROUPS
                  if err.summary(g)[0]]
        lines.append(f"  {t.name}: {'; '.join(groups)}")
    return lines


def report_lines(fit: Fit, profile: HardwareProfile, peak: HardwareProfile, fit_tables: list[VidurTable],
                 held_tables: list[VidurTable], cross_validate: bool = False) -> list[str]:
    """The fitted figures, the error per file and on held-out rows against the datasheet,
    what tiles would buy, where the free ride ends, and optionally each file held out."""
    tables = fit_tables + held_tables
    lines = [f"fitted {profile.name} to {sum(len(t) for t in fit_tables)} rows of "
             f"{', '.join(t.name for t in fit_tables)} against {peak.name}:",
             f"  weight products: {fit.bytes_per_s / 1e12:.3f} TB/s ({profile.bandwidth_fraction:.3f} of "
             f"peak), {fit.flops_per_s / 1e12:.1f} TFLOP/s ({profile.flops_fraction:.3f} of peak), "
             f"overlap {fit.overlap:.3f}",
             f"  {fit.per_layer_overhead_s * 1e6:.1f} us per layer; small kernels at "
             f"{fit.elementwise_bytes_per_s / 1e12:.3f} TB/s "
             f"({fit.elementwise_bytes_per_s / peak.hbm_bytes_per_s:.3f} of peak)", ""]
    lines += file_table(tables, {t.path for t in held_tables}, profile, peak) + [""]
    lines += held_out_lines(Errors.of(profile, held_tables), Errors.of(peak, held_tables), peak.name)
    if held_tables:
        lines.append(tile_line(fit_tables, held_tables, peak))
    lines.append(free_ride_line(tables, profile, peak))
    if cross_validate and len(tables) > 1:
        lines += [""] + cross_validation_lines(tables, peak)
    return lines


def plot_vidur(path: str, tables: list[VidurTable], held: set[str], fitted: HardwareProfile,
               datasheet: HardwareProfile) -> None:
    """Per-layer time against tokens, log-log, one panel a file: measured rows at tp 1 and
    at the largest tp, the fitted profile's price as a line, the datasheet's dashed."""
    import matplotlib  # heavy: only the report's figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    cols = min(3, len(tables))
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, t in zip(axes.flat, tables):
        tps = sorted({1, int(t.tp.max())})
        for tp, color in zip(tps, ("C0", "C3")):
            sub = t.with_tp(tp)
            order = np.argsort(sub.tokens, kind="stable")
            sub = sub.select(order)
            ax.scatter(sub.tokens, sub.seconds * 1e3, s=4, color=color, alpha=0.5,
                       label=f"measured, tp {tp}")
            ax.plot(sub.tokens, price_rows(fitted, sub) * 1e3, color=color, lw=1.2,
                    label=f"{fitted.name}, tp {tp}")
            ax.plot(sub.tokens, price_rows(datasheet, sub) * 1e3, color=color, lw=1, ls="--",
                    label=f"{datasheet.name}, tp {tp}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(t.name + (" (held out)" if t.path in held else ""), fontsize=9)
        ax.set_xlabel("tokens in the pass")
        ax.set_ylabel("one layer, one device (ms)")
        ax.grid(True, which="major", lw=0.3)
    for ax in list(axes.flat)[len(tables):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
