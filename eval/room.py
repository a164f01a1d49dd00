"""The room beyond the best rule on a table's deployment, as the table records it.

The export ships a rule's exact table where it kept more of the run's model's capacity
and goodput than every table built from the model. Whether a learned table could serve
more than the rule there is what the rollout reference says (``rollout:HORIZON:RULE``,
policies/reference.py): it re-plans over the rule seeing the stream's future, so its lead
over the rule, paired stream by stream, is room a controller could take. It is not an
upper bound (a rollout improves on its rule, no more); where it finds no room beyond the
interval, a learned table is unlikely to beat the rule. ``python -m agents.presets --room``
measures, per preset, on its serving scenario: the export's rules, the shipped table and
the rollout over the best of those rules (``python -m eval capacity ... --reference``).
This module reads that report and writes what it found into the table's
``provenance.room``, which ``python -m policies.table show`` prints.

In: the ``capacity.json`` of one scenario and the table's spec in it. Out: the record.
"""

from __future__ import annotations

import math
import time

from eval.harness import Verdict, paired_verdict
from eval.report import git_commit
from policies.reference import RolloutPolicy


def _finite(x) -> float | None:
    """A number the table's JSON can hold: None for NaN or infinity."""
    x = float(x)
    return x if math.isfinite(x) else None


def _verdict_record(v: Verdict, values, reference) -> dict:
    return {"kind": v.kind, "mean": _finite(v.rel), "ci95": _finite(v.half), "streams": v.streams,
            "figure": v.figure,
            "per_stream": [_finite(a / b - 1.0) if b > 0 else None for a, b in zip(values, reference)]}


def room_record(capacity: dict, table_spec: str, command: list[str]) -> dict:
    """The ``provenance.room`` of a table from an ``eval capacity`` report (its JSON) that
    measured the table as ``table_spec``, one or more rules, and the rollout reference over
    the best of them: which rule, the capacities, and the reference's and the table's
    capacity against that rule, paired stream by stream. Raises ValueError naming what
    the report lacks."""
    refs = [n for n in capacity if n.partition(":")[0] == RolloutPolicy.spec]
    if not refs:
        raise ValueError("the report has no rollout reference: it is the rollout over the best "
                         "time-budget rule measured, and the report measured none")
    if table_spec not in capacity:
        raise ValueError(f"the report has no {table_spec}")
    ref = refs[0]
    rule = ref.split(":", 2)[2]
    if rule not in capacity:
        raise ValueError(f"the report has no {rule}, the rule {ref} is over")
    per = {k: capacity[n]["per_stream"] for k, n in
           (("rule", rule), ("reference", ref), ("table", table_spec))}
    if len({len(v) for v in per.values()}) != 1:
        raise ValueError("the rule, the reference and the table were measured on different streams")
    return {
        "rule": rule, "reference": ref, "streams": len(per["rule"]),
        "capacity_rps": {k: _finite(capacity[n]["capacity_rps"]) for k, n in
                         (("rule", rule), ("reference", ref), ("table", table_spec))},
        "reference_vs_rule": _verdict_record(paired_verdict(per["reference"], per["rule"]),
                                             per["reference"], per["rule"]),
        "table_vs_rule": _verdict_record(paired_verdict(per["table"], per["rule"]),
                                         per["table"], per["rule"]),
        "command": " ".join(["python", *command]),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(),
    }
