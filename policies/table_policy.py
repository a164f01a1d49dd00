"""A lookup table as a simulator policy: it reads the quantities it needs from the
scheduler's state, by their ``envs.state`` names."""

from __future__ import annotations

from envs.state import SLACK_COUNTS
from policies.base import BudgetPolicy
from policies.table import BudgetTable


def read_inputs(state, names, itl_s: float) -> dict:
    """The table inputs ``names`` (``envs.state.TABLE_INPUTS``) from a scheduler's state,
    the slack counts at the ITL target ``itl_s``."""
    out = {n: getattr(state, n) for n in names if n not in SLACK_COUNTS}
    if any(n in SLACK_COUNTS for n in names):
        meter = state.itl_slack(itl_s)
        out["itl_slow_tokens"], out["itl_decode_tokens"] = meter.slow, meter.tokens
    return out


class TablePolicy(BudgetPolicy):
    """A table driving the simulator. A time-fraction table turns its fractions into tokens
    with the simulated engine's own cost model (as an engine calibrated for its per-step
    overhead would), not the coefficients stored for the hardware and model alone; with
    ``stored_cost``, with the stored ones as a serving engine does (for a table built for
    other hardware or another model: ``table.with_step_overhead`` adds the engine's own
    cost per step beyond them)."""

    kind = "table"

    def __init__(self, table: BudgetTable, name: str | None = None, stored_cost: bool = False):
        self.table = table
        self.name = name or f"table:{table.path}"
        self._needs = tuple(table.needs)
        self._time = table.action.kind == "time_fraction" and not stored_cost
        self._itl_s = table.itl_s

    def values(self, state) -> dict:
        """The quantities the table reads, from the scheduler's state (the slack counts at
        the table's ITL target)."""
        return read_inputs(state, self._needs, self._itl_s)

    def cell(self, state) -> int:
        """The index of the cell this state looks up."""
        return self.table.action.cell(self.values(state))

    def budget(self, state) -> int:
        return self.budget_of(self.values(state), state)

    def budget_of(self, values: dict, state) -> int:
        """The budget for ``values`` (:meth:`values` of ``state``)."""
        if self._time:
            return self.table.action.budget(values, state.cost)
        return self.table.budget(values)
