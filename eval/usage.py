"""What a policy does: the share of the passes it decides per action value (a fraction of
the ITL target, or a token budget), per token-budget bin of 2^(1/4), and the budget
against the running decodes. Training reports its model's (agents.callbacks), the
export and the capacity reports their tables' (eval.table_use)."""

from __future__ import annotations

import numpy as np

from envs.actions import FINE_LADDER

DECODE_GROUPS = ((0, 0), (1, 3), (4, 15), (16, 63), (64, None))
"""Running decodes, grouped for the budget-against-state table."""


def budget_bin_edges() -> tuple[int, ...]:
    """Lower edges of the token-budget bins: 1 (budgets under 64), then the fine ladder's
    rungs, 64 to 16,384 in steps of 2^(1/4) (the last bin takes every budget from 16,384)."""
    return (1, *FINE_LADDER)


class ActionTrace:
    """Drives the simulator with ``policy`` and keeps, for each pass it records, the action
    value chosen, the token budget it became and the running decodes (what
    :func:`action_histogram` reads). Subclasses say which passes and values in
    ``__call__``."""

    def __init__(self, policy):
        self.policy, self.name, self.kind = policy, policy.name, policy.kind
        self.values: list[float] = []
        self.budgets: list[int] = []
        self.decodes: list[int] = []

    def reset(self) -> None:
        self.policy.reset()

    def record(self, value: float, budget: int, decodes: int) -> None:
        self.values.append(value)
        self.budgets.append(budget)
        self.decodes.append(decodes)


USED_SHARE = 0.05
"""A value counts as used when it holds at least this share of the passes."""


def used_text(shares: dict, label=str) -> str:
    """The values holding at least ``USED_SHARE`` of the passes, most used first, each as
    ``label(value) share`` (``1 85%, 0.25 5%``); empty when none does."""
    top = sorted(shares.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{label(k)} {v:.0%}" for k, v in top if v >= USED_SHARE)


def budget_label(low: str) -> str:
    """A token-budget bin, keyed by its lower edge, as the range it holds: ``2,896-3,443``;
    ``under 64`` for the first, ``16,384+`` for the last."""
    lows = budget_bin_edges()
    k = lows.index(int(low))
    if k == 0:
        return f"under {lows[1]}"
    return f"{lows[k]:,}+" if k == len(lows) - 1 else f"{lows[k]:,}-{lows[k + 1] - 1:,}"


def action_histogram(values, ladder, budgets=None, decodes=None, time_fractions: bool = False) -> dict:
    """Share of passes per action value, and how many values are each used in >= 5%; with
    each pass's token budget and running decodes, also the share of passes per budget bin
    (:func:`budget_bin_edges`, keyed by the bin's lower edge) and, per group of running
    decodes, the share of passes, the median budget and, where the values are
    ``time_fractions``, the share above the ITL target (a fraction over 1)."""
    values = np.asarray(values, dtype=float)
    shares = {f"{v:g}": float(np.mean(np.isclose(values, v))) for v in ladder} if len(values) else {}
    out = {"shares": shares, "used_5pct": int(sum(s >= USED_SHARE for s in shares.values())),
           "passes": int(len(values))}
    if budgets is None or not len(values):
        return out
    budgets, decodes = np.asarray(budgets, dtype=float), np.asarray(decodes)
    lows = budget_bin_edges()
    bins = np.clip(np.searchsorted(np.asarray(lows, dtype=float), budgets, side="right") - 1,
                   0, len(lows) - 1)
    counts = np.bincount(bins, minlength=len(lows)) / len(budgets)
    out["budget_shares"] = {str(lows[i]): float(c) for i, c in enumerate(counts) if c > 0}
    out["budgets_5pct"] = int((counts >= USED_SHARE).sum())
    rows = []
    for lo, hi in DECODE_GROUPS:
        m = (decodes >= lo) & (decodes <= (hi if hi is not None else np.inf))
        if m.any():
            row = {"decodes": f"{lo}" if hi == lo else f"{lo}-{hi}" if hi else f"{lo}+",
                   "share": float(m.mean()), "median_budget": float(np.median(budgets[m]))}
            if time_fractions:
                row["over_target"] = float(np.mean(values[m] > 1.0))
            rows.append(row)
    out["by_decodes"] = rows
    return out
