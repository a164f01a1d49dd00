"""vLLM V1 schedulers that take each step's token budget from a chunkpilot table.

Serve with (the engine's ``max_num_batched_tokens`` is the ceiling every budget must
fit under, so start it at the table's largest budget)::

    CHUNKPILOT_TABLE=tables/h100-sxm__llama-3-8b.json \\
    python -m vllm.entrypoints.openai.api_server --model ... \\
        --scheduler-cls policies.vllm_scheduler.AsyncTableScheduler \\
        --max-num-batched-tokens 16384

(``TableScheduler`` is the synchronous variant, for engines run without async
scheduling.) The repository root must be importable (``pip install -e .`` or
``PYTHONPATH``); this module imports only vLLM and ``policies.table``, which is
standard library only.

Before every ``schedule()`` the scheduler reads its own state: running requests
that are decoding (prompt fully computed), requests waiting, prompt tokens left to
prefill (waiting and partially prefilled), and KV-cache usage; looks up the budget;
raises it to the number of running decodes if needed (each must get its token) and
caps it at the engine's ceiling; stores it in ``max_num_scheduled_tokens`` (which
``Scheduler.schedule`` reads as its token budget); then calls the parent.
"""

from __future__ import annotations

import collections
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from policies.table import BudgetTable, TableError

TABLE_ENV = "CHUNKPILOT_TABLE"


class _TableBudget:
    """Mixin over a vLLM Scheduler; see the module docstring."""

    chunkpilot_table: BudgetTable

    def _chunkpilot_init(self, table: BudgetTable | str | None = None) -> None:
        if table is None:
            table = os.environ.get(TABLE_ENV)
            if not table:
                raise TableError(f"{TABLE_ENV}: set it to the path of a chunkpilot table (JSON)")
        if not isinstance(table, BudgetTable):
            table = BudgetTable.load(table)
        self.chunkpilot_table = table
        # The engine's configured budget is the ceiling: vLLM sized its buffers for it.
        self.chunkpilot_ceiling = self.max_num_scheduled_tokens
        if table.max_budget > self.chunkpilot_ceiling:
            raise TableError(
                f"{table.path}: its largest budget ({table.max_budget}) exceeds the engine's "
                f"max_num_batched_tokens ({self.chunkpilot_ceiling}); start vLLM with "
                f"--max-num-batched-tokens {table.max_budget}")
        self._chunkpilot_getters = [getattr(self, f"_chunkpilot_{name}") for name in table.features]
        # (features, budget) of recent steps, for logs and tests.
        self.chunkpilot_history: collections.deque = collections.deque(maxlen=4096)

    # Features, computed from the scheduler's own queues.
    def _chunkpilot_running_decodes(self) -> int:
        return sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)

    def _chunkpilot_waiting_requests(self) -> int:
        return len(self.waiting)

    def _chunkpilot_waiting_prefill_tokens(self) -> int:
        partial = sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.running
                      if r.num_computed_tokens < r.num_prompt_tokens)
        return partial + sum(max(r.num_tokens - r.num_computed_tokens, 0) for r in self.waiting)

    def _chunkpilot_kv_usage(self) -> float:
        return self.kv_cache_manager.usage

    def chunkpilot_budget(self) -> int:
        values = [g() for g in self._chunkpilot_getters]
        budget = self.chunkpilot_table.lookup_values(values)
        budget = max(budget, self._chunkpilot_running_decodes(), 1)
        budget = min(budget, self.chunkpilot_ceiling)
        self.chunkpilot_history.append((dict(zip(self.chunkpilot_table.features, values)), budget))
        return budget

    def schedule(self, *args, **kwargs):
        self.max_num_scheduled_tokens = self.chunkpilot_budget()
        return super().schedule(*args, **kwargs)


class TableScheduler(_TableBudget, Scheduler):
    def __init__(self, *args, chunkpilot_table: BudgetTable | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._chunkpilot_init(chunkpilot_table)


class AsyncTableScheduler(_TableBudget, AsyncScheduler):
    def __init__(self, *args, chunkpilot_table: BudgetTable | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._chunkpilot_init(chunkpilot_table)
