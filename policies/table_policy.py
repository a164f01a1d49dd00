"""A lookup table as a simulator policy: the features it reads from the scheduler state."""

from __future__ import annotations

from policies.base import BudgetPolicy
from policies.table import KNOWN_FEATURES, BudgetTable

# How the simulator's scheduler state provides each table feature.
FEATURE_GETTERS = {
    "running_decodes": lambda s: s.num_decodes,
    "waiting_requests": lambda s: s.num_waiting,
    "waiting_prefill_tokens": lambda s: s.waiting_prefill_tokens,
    "kv_usage": lambda s: s.kv_usage,
}
assert set(FEATURE_GETTERS) == set(KNOWN_FEATURES)


def state_features(state, names) -> list:
    return [FEATURE_GETTERS[n](state) for n in names]


class TablePolicy(BudgetPolicy):
    kind = "table"

    def __init__(self, table: BudgetTable, name: str | None = None):
        self.table = table
        self.name = name or f"table:{table.path}"
        self._getters = [FEATURE_GETTERS[n] for n in table.features]

    def budget(self, state) -> int:
        return self.table.lookup_values([g(state) for g in self._getters])
