"""What the table schedulers report: Prometheus metrics and the periodic summary line.

Metrics follow vLLM's naming (``vllm:num_requests_running``...): a ``chunkpilot:`` prefix,
seconds and tokens in the name, counters exposed with ``_total``, and the same
``model_name`` and ``engine`` labels.

==============================  =========  ===============================================
``chunkpilot:budget_tokens``    histogram  the token budget of each scheduler step
``chunkpilot:table_info``       gauge      1 for the table in use, 0 for tables replaced;
                                           labels: table, digest, hardware, model, tp,
                                           slo_ttft_s, slo_itl_s, exported
``chunkpilot:table_reloads``    counter    replaced table files seen; label outcome:
                                           applied or rejected
``chunkpilot:budget_fallbacks`` counter    steps whose lookup failed and took the default
``chunkpilot:budget_clamps``    counter    steps whose budget was raised to the running
                                           decodes
``chunkpilot:speed_scale``      gauge      the engine's measured step time per second
                                           its table's cost model prices
                                           (``policies.table.correction``; 1 until warmed
                                           up, and for token tables)
==============================  =========  ===============================================

How they reach ``/metrics``: vLLM 0.32 runs the scheduler in the engine-core process and
serves ``/metrics`` from the API server process, out of ``prometheus_client``'s default
registry, which holds that process's metrics only. Metrics recorded in the engine core
appear there only in Prometheus multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set,
every process writes its samples to files in that folder and the API server's registry
(``vllm.v1.metrics.prometheus.get_prometheus_registry``) collects them all. vLLM turns
this mode on by itself only for ``--api-server-count`` > 1; for one API server the
operator sets ``PROMETHEUS_MULTIPROC_DIR`` to an empty folder before starting vLLM
(docs/serving.md). With the engine in the API server's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) they are in the default registry directly.
"""

from __future__ import annotations

import collections
import os

BUDGET_BUCKETS = tuple(float(2**k) for k in range(4, 18))  # 16 .. 131,072 tokens
INFO_LABELS = ("table", "digest", "hardware", "model", "tp", "slo_ttft_s", "slo_itl_s",
               "exported")


def _multiprocess_value_class():
    """Make metrics created from now on in this process write to PROMETHEUS_MULTIPROC_DIR.

    prometheus_client picks its value class once, when it is first imported. An engine
    process forked from a parent that imported it before the folder was set (vLLM's
    front end does, for --api-server-count > 1) inherits in-memory values, which no
    other process can read; this process's own metrics then never reach /metrics.
    """
    from prometheus_client import values  # imported late: it picks its value class once, at import

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()


class Metrics:
    """chunkpilot's Prometheus metrics in this process (created once: a registry takes
    each name once)."""

    _instance: "Metrics | None" = None

    @classmethod
    def get(cls) -> "Metrics":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram  # late, as above: after the folder is set

        _multiprocess_value_class()
        labels = ("model_name", "engine")
        self.budget = Histogram("chunkpilot:budget_tokens",
                                "Token budget a chunkpilot table set for a scheduler step.",
                                labelnames=labels, buckets=BUDGET_BUCKETS)
        self.table_info = Gauge("chunkpilot:table_info",
                                "The chunkpilot table in use (1) and tables it replaced (0).",
                                labelnames=labels + INFO_LABELS, multiprocess_mode="mostrecent")
        self.reloads = Counter("chunkpilot:table_reloads",
                               "Replaced chunkpilot table files seen, applied or rejected.",
                               labelnames=labels + ("outcome",))
        self.fallbacks = Counter("chunkpilot:budget_fallbacks",
                                 "Steps whose table lookup failed and used the default budget.",
                                 labelnames=labels)
        self.clamps = Counter("chunkpilot:budget_clamps",
                              "Steps whose table budget was raised to the running decodes.",
                              labelnames=labels)
        self.speed_scale = Gauge("chunkpilot:speed_scale",
                                 "Measured step time per second the table's cost model prices.",
                                 labelnames=labels, multiprocess_mode="mostrecent")


class EngineMetrics:
    """The metrics of one engine (its labels bound once: a step records without lookups)."""

    def __init__(self, model_name: str, engine: str):
        m = Metrics.get()
        self._labels = {"model_name": model_name, "engine": engine}
        self.budget = m.budget.labels(**self._labels)
        self.fallbacks = m.fallbacks.labels(**self._labels)
        self.clamps = m.clamps.labels(**self._labels)
        self.speed_scale = m.speed_scale.labels(**self._labels)
        self.speed_scale.set(1.0)
        self._reloads = m.reloads
        for outcome in ("applied", "rejected"):  # 0 from the start, not absent until the first
            self._reloads.labels(**self._labels, outcome=outcome)
        self._info = m.table_info
        self._current: dict | None = None

    def table(self, table) -> None:
        """Mark ``table`` as the one in use (the previous one drops to 0)."""
        p = table.provenance
        info = {"table": table.path, "digest": table.digest or "",
                "hardware": p["hardware"]["name"], "model": p["model"]["name"],
                "tp": str(p["model"]["tensor_parallel"]), "slo_ttft_s": str(p["slo"]["ttft_s"]),
                "slo_itl_s": str(p["slo"]["itl_s"]), "exported": str(p.get("exported", ""))}
        if self._current is not None and self._current != info:
            self._info.labels(**self._labels, **self._current).set(0)
        self._info.labels(**self._labels, **info).set(1)
        self._current = info

    def reload(self, outcome: str) -> None:
        self._reloads.labels(**self._labels, outcome=outcome).inc()


class Summary:
    """Step figures since the last summary line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.budgets: collections.Counter = collections.Counter()
        self.clamps = 0
        self.fallbacks = 0
        self.lookup_s = 0.0

    def line(self, elapsed_s: float, table_path: str, scale: float | None = None) -> str:
        """``scale``: the speed correction in use (None: none, a token table or turned off)."""
        rate = self.steps / elapsed_s if elapsed_s > 0 else 0.0
        lookup_us = self.lookup_s / self.steps * 1e6 if self.steps else 0.0
        speed = "" if scale is None else f"; steps take {scale:.2f}x the table's cost model"
        return (f"chunkpilot: last {elapsed_s:.0f} s: {self.steps} steps ({rate:.1f} lookups/s, "
                f"{lookup_us:.1f} us each); budgets {histogram(self.budgets)}; raised to the "
                f"running decodes {self.clamps}x; default budget after a failed lookup "
                f"{self.fallbacks}x{speed}; table {table_path}")


def histogram(counts: collections.Counter, max_bins: int = 8) -> str:
    """``256:12 1024:340``; more distinct budgets than ``max_bins`` fall into power-of-two
    bins, named by their upper edge (``<=2048:...``)."""
    if not counts:
        return "none"
    if len(counts) <= max_bins:
        return " ".join(f"{b}:{n}" for b, n in sorted(counts.items()))
    bins: collections.Counter = collections.Counter()
    for b, n in counts.items():
        bins[1 << max(int(b) - 1, 0).bit_length()] += n
    return " ".join(f"<={b}:{n}" for b, n in sorted(bins.items()))
