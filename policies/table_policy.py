"""A lookup table as a simulator policy: the state quantities it reads from the scheduler."""

from __future__ import annotations

from policies.base import BudgetPolicy
from policies.table import STATE, BudgetTable

# How the simulator's scheduler state provides each quantity a table may need, for a
# table serving an ITL target of ``itl`` seconds.
FEATURE_GETTERS = {
    "running_decodes": lambda s, itl: s.num_decodes,
    "waiting_requests": lambda s, itl: s.num_waiting,
    "waiting_prefill_tokens": lambda s, itl: s.waiting_prefill_tokens,
    "kv_usage": lambda s, itl: s.kv_usage,
    "decode_context_tokens": lambda s, itl: s.decode_context_tokens,
    "head_prefilled_tokens": lambda s, itl: s.head_prefilled_tokens,
    "head_remaining_tokens": lambda s, itl: s.head_prompt_tokens - s.head_prefilled_tokens,
    "oldest_wait_s": lambda s, itl: s.oldest_wait_s,
    "last_step_s": lambda s, itl: s.last_pass_s,
    "itl_slow_tokens": lambda s, itl: s.simulator.itl_slack(itl).slow,
    "itl_decode_tokens": lambda s, itl: s.simulator.itl_slack(itl).tokens,
}
assert set(FEATURE_GETTERS) == set(STATE)


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
        self._getters = tuple((n, FEATURE_GETTERS[n]) for n in table.needs)
        self._time = table.action.kind == "time_fraction" and not stored_cost
        self._itl_s = table.itl_s

    def values(self, state) -> dict:
        """The quantities the table reads, from the scheduler's state."""
        itl = self._itl_s
        return {n: g(state, itl) for n, g in self._getters}

    def cell(self, state) -> int:
        """The index of the cell this state looks up."""
        return self.table.action.cell(self.values(state))

    def budget(self, state) -> int:
        return self.budget_of(self.values(state), state)

    def budget_of(self, values: dict, state) -> int:
        """The budget for ``values`` (:meth:`values` of ``state``)."""
        if self._time:
            return self.table.action.budget(values, state.simulator.roofline.coefficients())
        return self.table.budget(values)
