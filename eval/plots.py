"""Figures (matplotlib, PNG), each naming the SLO it is judged by:

- :func:`ladder_figure`: a figure (capacity, or goodput at one load) against the static
  budget, the fine ladder as a curve with its intervals, each policy as a band;
- :func:`latency_tails`: TTFT and ITL tails per policy (the share of requests, or of
  tokens, above each latency) with the targets and the p99 level drawn;
- :func:`goodput_vs_load`: goodput against the arrival rate, one band per policy;
- :func:`budget_timeline`: every policy's budget and pass times over the same window (the
  one around the worst gap), with the ITL target drawn;
- :func:`pareto`: p99 TTFT against p99 ITL, the static ladder as a line.

Every policy keeps its colour and marker across the figures of one report (:func:`styles`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

from envs.files import atomic_path  # noqa: E402

MARKERS = "osD^vP*Xh<>p"
TARGET = dict(color="black", lw=1.0, ls="--")
"""How an SLO target is drawn."""


def styles(names) -> dict[str, dict]:
    """A distinct (colour, marker) for each of up to 20 policies, in order: tab10's colours
    with one marker each, then tab10 again with other markers; the same name keeps its
    style across a report's figures."""
    cmap = plt.get_cmap("tab10")
    return {n: dict(color=cmap(i % 10), marker=MARKERS[i % len(MARKERS)],
                    ls="-" if i < 10 else ":") for i, n in enumerate(names)}


def _save(fig, path: Path) -> Path:
    """Written atomically (a temporary file with the same suffix, renamed over ``path``)."""
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path


def _plain(v: float, _pos=None) -> str:
    """A tick label without exponents: 0.05, 2, 250, 16,384."""
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:g}"
    return f"{v:.3g}"


def _log_ticks(axis, low: float, high: float) -> None:
    """Readable ticks on a log axis: 1-2-5 steps within the data's span, plain numbers, no
    minor labels (matplotlib's defaults collide on spans under a decade)."""
    low, high = max(low, 1e-9), max(high, low * 1.0001)
    ticks = [m * 10.0 ** e for e in range(int(np.floor(np.log10(low))) - 1, int(np.ceil(np.log10(high))) + 1)
             for m in (1, 2, 5)]
    inside = [t for t in ticks if low <= t <= high]
    if len(inside) > 8:
        inside = [t for t in inside if f"{t:.1e}"[0] == "1"] or inside
    if len(inside) < 2:
        inside = [low, high]
    axis.set_major_locator(FixedLocator(inside))
    axis.set_major_formatter(FuncFormatter(_plain))
    axis.set_minor_locator(NullLocator())


def _budget_axis(ax, budgets) -> None:
    """A base-2 log axis of token budgets labelled at the powers of two it spans."""
    ax.set_xscale("log", base=2)
    lo, hi = min(budgets), max(budgets)
    powers = [2 ** k for k in range(6, 16) if lo / 1.5 <= 2 ** k <= hi * 1.5]
    ax.xaxis.set_major_locator(FixedLocator(powers or [lo, hi]))
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis="x", labelsize=7)


def ladder_figure(panels: list[dict], path: Path, ylabel: str, title: str, unit: str = "req/s") -> Path:
    """One panel per scenario: the static ladder as a curve (each rung's mean with its 95%
    interval), each policy as a line with its interval shaded, the best rung circled. A
    panel is ``{"title", "rungs": {budget: (mean, half)}, "policies": {name: (mean, half)},
    "best": budget, "relative": bool, "failing": budgets}``; a relative panel's figures are
    shares of the best rung's (1 = 100%); the rungs in ``failing`` (at a fixed load: those
    breaking the p99 targets on some stream) are crossed."""
    names = list(dict.fromkeys(n for p in panels for n in p["policies"]))
    st = styles(names)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rel = panel.get("relative", False)
        scale = 100.0 if rel else 1.0
        b = sorted(panel["rungs"])
        means = [panel["rungs"][k][0] * scale for k in b]
        halves = [panel["rungs"][k][1] * scale for k in b]
        ax.errorbar(b, means, yerr=halves, color="0.35", marker="o", ms=3, lw=1.2, capsize=2,
                    label="static budgets (fine ladder)", zorder=3)
        failing = [k for k in b if k in panel.get("failing", ())]
        if failing:
            ax.scatter(failing, [panel["rungs"][k][0] * scale for k in failing], marker="x", s=40,
                       color="tab:red", zorder=5, label="breaks p99 TTFT or ITL on some stream")
        if panel.get("best") in panel["rungs"]:
            best = panel["best"]
            ax.scatter([best], [panel["rungs"][best][0] * scale], s=90, facecolor="none",
                       edgecolor="black", zorder=4, label=f"best fixed budget: {best:,}")
        for name, (mean, half) in panel["policies"].items():
            s = st[name]
            if not np.isfinite(mean):
                continue
            shown = f"{mean * scale:.1f}%" if rel else f"{mean:.2f}"
            ax.axhline(mean * scale, color=s["color"], ls=s["ls"], lw=1.6, label=f"{name}: {shown}")
            if half > 0:
                ax.axhspan((mean - half) * scale, (mean + half) * scale, color=s["color"], alpha=0.10,
                           lw=0)
        _budget_axis(ax, b)
        ax.set_xlabel("static budget (tokens)")
        ax.set_ylabel(f"{ylabel}, % of the best fixed budget's" if rel else f"{ylabel} ({unit})")
        ax.set_ylim(bottom=0)
        ax.set_title(textwrap.fill(panel["title"], 70), fontsize=8)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _tail(values: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, share of the total weight strictly above each)."""
    order = np.argsort(values)
    v = values[order]
    w = np.ones(len(v)) if weights is None else weights[order].astype(float)
    above = 1.0 - np.cumsum(w) / w.sum()
    return v, above


def latency_tails(samples: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                  slo: tuple[float, float], path: Path, title: str) -> Path:
    """TTFT and ITL tails, per policy: the share of requests (TTFT) or of decode tokens (ITL)
    whose latency exceeds x, on log axes; the SLO's targets as vertical lines and the 1%
    level as a horizontal one: a policy meets a p99 target where its curve is under 1% at
    the target. ``samples``: name -> (TTFT per request, pass durations, decodes per pass:
    every decode in a pass waits that pass)."""
    st = styles(samples)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    spans = [[], []]
    for name, (ttft, dur, dec) in samples.items():
        s = st[name]
        for ax, (v, w), span in ((axes[0], (ttft[np.isfinite(ttft)], None), spans[0]),
                                 (axes[1], (dur[dec > 0], dec[dec > 0]), spans[1])):
            if not len(v):
                continue
            x, y = _tail(v, w)
            keep = y > 0
            ax.step(x[keep], y[keep], where="post", color=s["color"], ls=s["ls"], lw=1.3, label=name)
            span += [float(x[keep].min(initial=np.inf)), float(x.max())]
    for ax, target, what, span in ((axes[0], slo[0], "TTFT", spans[0]), (axes[1], slo[1], "ITL", spans[1])):
        ax.axvline(target, **TARGET, label=f"{what} target: {_plain(target)} s")
        ax.axhline(0.01, color="0.5", lw=0.8, ls=":", label="1% (p99)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        finite = [x for x in span + [target] if np.isfinite(x) and x > 0]
        if finite:
            _log_ticks(ax.xaxis, min(finite), max(finite))
        ax.set_xlabel(f"{what} (s)")
        ax.set_ylabel("share of " + ("requests" if what == "TTFT" else "tokens") + " above")
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_title("time to first token", fontsize=9)
    axes[1].set_title("inter-token latency (every decode token's gap)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def goodput_vs_load(loads: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: Path,
                    title: str, xlabel: str) -> Path:
    """Goodput (the share of requests meeting their TTFT and TPOT targets) against the load,
    each policy's mean over streams with its 95% interval shaded. ``loads``: name -> (loads,
    mean goodput, half-interval)."""
    st = styles(loads)
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for name, (x, mean, half) in loads.items():
        s = st[name]
        ax.plot(x, mean, color=s["color"], ls=s["ls"], marker=s["marker"], ms=4, lw=1.3, label=name)
        ax.fill_between(x, np.maximum(mean - half, 0.0), np.minimum(mean + half, 1.0),
                        color=s["color"], alpha=0.08, lw=0)
    ax.axvline(1.0, color="0.4", lw=0.8, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (share of requests)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def budget_timeline(runs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                    window: tuple[float, float], itl_s: float, path: Path, title: str) -> Path:
    """Every policy over the same window of the same arrivals: the budget each pass was
    given (top) and how long each pass that carried decodes took, which is the gap every
    running user saw (bottom), with the ITL target drawn. ``runs``: name -> (pass start
    times, budgets (-1 where nothing was decided), durations, decodes)."""
    st = styles(runs)
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.0), sharex=True)
    lo, hi = window
    for name, (t, budget, dur, dec) in runs.items():
        s = st[name]
        inside = (t >= lo) & (t <= hi)
        b = budget[inside].astype(float)
        b[b < 0] = np.nan
        axes[0].step(t[inside], b, where="post", color=s["color"], ls=s["ls"], lw=1.2, label=name)
        gap = inside & (dec > 0)
        axes[1].plot(t[gap], dur[gap] * 1e3, color=s["color"], ls="none", marker=s["marker"], ms=3,
                     label=name)
    axes[1].axhline(itl_s * 1e3, **TARGET, label=f"ITL target: {itl_s * 1e3:g} ms")
    axes[0].set_yscale("log", base=2)
    axes[0].yaxis.set_major_locator(FixedLocator([2 ** k for k in range(4, 17)]))
    axes[0].yaxis.set_major_formatter(FuncFormatter(_plain))
    axes[0].yaxis.set_minor_locator(NullLocator())
    axes[0].set_ylabel("budget (tokens)")
    axes[1].set_yscale("log")
    shown = [itl_s * 1e3]
    for t, _, dur, dec in runs.values():
        d = dur[(t >= lo) & (t <= hi) & (dec > 0)] * 1e3
        if len(d):
            shown += [float(d.min()), float(d.max())]
    _log_ticks(axes[1].yaxis, min(shown), max(shown))
    axes[1].set_ylabel("pass with decodes (ms)")
    axes[1].set_xlabel("time (s)")
    axes[0].legend(fontsize=7, loc="upper left", ncol=2)
    axes[1].legend(fontsize=7, loc="upper left", ncol=2)
    axes[0].set_title(title, fontsize=9)
    return _save(fig, path)


def pareto(points: dict[str, tuple[float, float]], statics: dict[int, tuple[float, float]],
           slo: tuple[float, float], path: Path, title: str) -> Path:
    """p99 TTFT against p99 ITL: every policy, and the static ladder as a line; the SLO's
    corner is the lower left of the dashed targets."""
    st = styles(points)
    fig, ax = plt.subplots(figsize=(6.8, 4.8))
    xs_all, ys_all = [slo[1]], [slo[0]]
    if statics:
        b = sorted(statics)
        xs = [statics[k][1] for k in b]
        ys = [statics[k][0] for k in b]
        ax.plot(xs, ys, "-o", color="0.6", ms=3, label="static budgets (labelled)", zorder=1)
        for k, x, y in zip(b, xs, ys):
            ax.annotate(f"{k:,}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6,
                        color="0.4")
        xs_all += xs
        ys_all += ys
    for name, (ttft, itl) in points.items():
        s = st[name]
        ax.scatter([itl], [ttft], s=45, zorder=2, color=s["color"], marker=s["marker"], label=name)
        xs_all.append(itl)
        ys_all.append(ttft)
    ax.axhline(slo[0], **TARGET, label=f"TTFT target: {_plain(slo[0])} s")
    ax.axvline(slo[1], color="0.3", lw=1.0, ls="-.", label=f"ITL target: {slo[1] * 1e3:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs_ok = [x for x in xs_all if np.isfinite(x) and x > 0]
    ys_ok = [y for y in ys_all if np.isfinite(y) and y > 0]
    _log_ticks(ax.xaxis, min(xs_ok), max(xs_ok))
    _log_ticks(ax.yaxis, min(ys_ok), max(ys_ok))
    ax.set_xlabel("p99 ITL (s)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def budget_vs_state(samples: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: Path,
                    title: str) -> Path:
    """What adaptive policies do: budget chosen against running decodes, coloured by the
    prompt tokens the pass carried."""
    n = max(len(samples), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (name, (decodes, prefill, budgets)) in zip(axes[0], samples.items()):
        sc = ax.scatter(decodes, budgets, c=np.log1p(prefill), s=6, cmap="viridis", alpha=0.6)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax.set_xlabel("running decodes")
        ax.set_ylabel("budget (tokens)")
        ax.set_title(name, fontsize=9)
        fig.colorbar(sc, ax=ax, label="log1p(prompt tokens in the pass)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
