"""Figures (matplotlib, PNG): Pareto front, pass timeline, budget against state, capacity."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from envs.files import atomic_path  # noqa: E402


def _save(fig, path: Path) -> Path:
    """Written atomically (a temporary file with the same suffix, renamed over ``path``)."""
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path


def pareto(points: dict[str, tuple[float, float]], statics: dict[int, tuple[float, float]],
           slo: tuple[float, float], path: Path, title: str) -> Path:
    """p99 TTFT against p99 ITL: every policy, and the static ladder as a line."""
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    if statics:
        b = sorted(statics)
        xs = [statics[k][1] * 1e3 for k in b]
        ys = [statics[k][0] for k in b]
        ax.plot(xs, ys, "-o", color="0.6", label="static budgets", zorder=1)
        for k, x, y in zip(b, xs, ys):
            ax.annotate(str(k), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color="0.4")
    for name, (ttft, itl) in points.items():
        ax.scatter([itl * 1e3], [ttft], s=50, zorder=2, label=name)
    ax.axhline(slo[0], color="tab:red", lw=0.8, ls="--")
    ax.axvline(slo[1] * 1e3, color="tab:red", lw=0.8, ls="--")
    ax.set_xlabel("p99 ITL (ms)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def timeline(result, window: tuple[int, int], path: Path, title: str) -> Path:
    """Lanes over passes: the budget applied, the pass duration, the running decodes (one
    token each per pass), and the prompt tokens each pass prefilled."""
    lo, hi = window
    dur = result.pass_duration_s[lo:hi]
    t = result.pass_end_s[lo:hi] - dur  # each pass drawn from its start
    fig, axes = plt.subplots(4, 1, figsize=(8, 6.4), sharex=True)
    budget = result.pass_budget[lo:hi].astype(float)
    budget[budget < 0] = np.nan
    axes[0].step(t, budget, where="post", color="tab:blue")
    axes[0].set_ylabel("budget")
    axes[1].step(t, dur * 1e3, where="post", color="tab:orange")
    axes[1].set_ylabel("pass (ms)")
    axes[2].step(t, result.pass_decodes[lo:hi], where="post", color="tab:green")
    axes[2].set_ylabel("decodes")
    axes[3].bar(t, result.pass_prefill_tokens[lo:hi], width=dur, align="edge", color="tab:purple")
    axes[3].set_ylabel("prefill tok")
    axes[3].set_xlabel("time (s)")
    axes[0].set_title(title, fontsize=10)
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
        ax.set_xlabel("running decodes")
        ax.set_ylabel("budget")
        ax.set_title(name, fontsize=9)
        fig.colorbar(sc, ax=ax, label="log1p(prompt tokens in the pass)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def capacity_bars(capacities: dict[str, float], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 0.4 * len(capacities) + 1.2))
    names = list(capacities)
    vals = [capacities[n] for n in names]
    ax.barh(names, vals, color="tab:blue")
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("capacity under the SLO (req/s)")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
