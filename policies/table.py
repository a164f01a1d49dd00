"""Budget lookup tables: load, validate, look up. Standard library only.

This file is meant to be vendored into a serving engine as is: it imports nothing
beyond the standard library (``python -S -c 'import policies.table'`` works) and a
lookup is a handful of bisections.

A table maps a few bucketed features that an engine reads every pass to a token
budget. Format (JSON, ``schema_version`` 1)::

    {
      "schema_version": 1,
      "kind": "chunkpilot-budget-table",
      "features": [{"name": "running_decodes", "edges": [4, 16, 64]}, ...],
      "budgets": [...],   # one per cell, row-major over the features in order
      "visited": [...],   # 1 where the policy was seen in that cell, 0 where filled in
      "default_budget": 2048,
      "provenance": {...}, "fidelity": {...}
    }

A feature with edges ``e`` has ``len(e) + 1`` buckets; value ``v`` falls in bucket
``bisect_right(e, v)`` (so an edge value belongs to the bucket above it).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from bisect import bisect_right

SCHEMA_VERSION = 1
KIND = "chunkpilot-budget-table"

# What an engine must provide each pass, by feature name (vLLM's counterpart in brackets).
KNOWN_FEATURES = {
    "running_decodes": "requests decoding this pass (running, prompt fully computed)",
    "waiting_requests": "requests not yet admitted [num_requests_waiting]",
    "waiting_prefill_tokens": "prompt tokens still to prefill, waiting and partially prefilled",
    "kv_usage": "fraction of KV-cache blocks in use [kv_cache_usage_perc]",
}


class TableError(ValueError):
    """A table file that cannot be used; the message says which field and why."""


class BudgetTable:
    """A validated lookup table. ``lookup(**features)`` returns a budget in tokens."""

    __slots__ = ("features", "edges", "budgets", "visited", "default_budget", "provenance",
                 "fidelity", "_strides", "path")

    def __init__(self, data: dict, path: str = "<table>"):
        self.path = path
        if not isinstance(data, dict):
            raise TableError(f"{path}: not a JSON object")
        if data.get("kind") != KIND:
            raise TableError(f"{path}: kind: got {data.get('kind')!r}, must be {KIND!r}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TableError(f"{path}: schema_version: got {version!r}, this runtime reads "
                             f"{SCHEMA_VERSION}")
        feats = data.get("features")
        if not isinstance(feats, list) or not feats:
            raise TableError(f"{path}: features: must be a non-empty list")
        self.features: tuple[str, ...] = ()
        self.edges: tuple[tuple[float, ...], ...] = ()
        names, edges = [], []
        for i, f in enumerate(feats):
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise TableError(f"{path}: features[{i}]: must be an object with a name")
            if f["name"] not in KNOWN_FEATURES:
                raise TableError(f"{path}: features[{i}].name: got {f['name']!r}, an engine "
                                 f"can provide: {', '.join(KNOWN_FEATURES)}")
            e = f.get("edges")
            if (not isinstance(e, list) or not all(isinstance(x, (int, float)) and math.isfinite(x)
                                                   for x in e)):
                raise TableError(f"{path}: features[{i}].edges: must be a list of finite numbers")
            if any(b <= a for a, b in zip(e, e[1:])):
                raise TableError(f"{path}: features[{i}].edges: must increase strictly")
            names.append(f["name"])
            edges.append(tuple(float(x) for x in e))
        if len(set(names)) != len(names):
            raise TableError(f"{path}: features: names must be distinct")
        self.features, self.edges = tuple(names), tuple(edges)
        cells = 1
        strides = []
        for e in reversed(self.edges):
            strides.append(cells)
            cells *= len(e) + 1
        self._strides = tuple(reversed(strides))
        budgets = data.get("budgets")
        if not isinstance(budgets, list) or len(budgets) != cells:
            raise TableError(f"{path}: budgets: must list {cells} cells (the product of the "
                             f"bucket counts), got {len(budgets) if isinstance(budgets, list) else budgets!r}")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in budgets):
            raise TableError(f"{path}: budgets: every cell must be a positive integer")
        self.budgets = tuple(budgets)
        visited = data.get("visited", [1] * cells)
        if not isinstance(visited, list) or len(visited) != cells:
            raise TableError(f"{path}: visited: must list {cells} cells")
        self.visited = tuple(bool(v) for v in visited)
        default = data.get("default_budget", max(self.budgets))
        if not isinstance(default, int) or default <= 0:
            raise TableError(f"{path}: default_budget: must be a positive integer")
        self.default_budget = default
        self.provenance = data.get("provenance", {})
        self.fidelity = data.get("fidelity", {})

    @classmethod
    def load(cls, path: str) -> "BudgetTable":
        try:
            with open(path) as fh:
                data = json.load(fh)
        except OSError as err:
            raise TableError(f"{path}: cannot read ({err.strerror})") from None
        except json.JSONDecodeError as err:
            raise TableError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        return cls(data, path)

    @property
    def max_budget(self) -> int:
        return max(self.budgets)

    @property
    def cells(self) -> int:
        return len(self.budgets)

    def cell(self, values) -> int:
        """Flat index of the cell holding ``values`` (one per feature, in order)."""
        idx = 0
        for v, e, s in zip(values, self.edges, self._strides):
            idx += bisect_right(e, v) * s
        return idx

    def lookup_values(self, values) -> int:
        return self.budgets[self.cell(values)]

    def lookup(self, **features) -> int:
        """Budget for named feature values, e.g. ``lookup(running_decodes=40, ...)``."""
        try:
            return self.budgets[self.cell([features[name] for name in self.features])]
        except KeyError as err:
            raise TableError(f"{self.path}: lookup needs feature {err.args[0]!r}; the table uses "
                             f"{', '.join(self.features)}") from None

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "kind": KIND,
            "features": [{"name": n, "edges": list(e)} for n, e in zip(self.features, self.edges)],
            "budgets": list(self.budgets), "visited": [int(v) for v in self.visited],
            "default_budget": self.default_budget, "provenance": self.provenance,
            "fidelity": self.fidelity,
        }

    def save(self, path: str) -> None:
        """Write atomically: a reader never sees half a table."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def to_csv(self) -> str:
        """One row per cell: each feature's bucket range, the budget, whether visited."""
        head = []
        for n in self.features:
            head += [f"{n}_from", f"{n}_to"]
        rows = [",".join(head + ["budget", "visited"])]
        for flat, budget in enumerate(self.budgets):
            cols = []
            rest = flat
            for e, s in zip(self.edges, self._strides):
                b, rest = divmod(rest, s)
                lo = e[b - 1] if b > 0 else float("-inf")
                hi = e[b] if b < len(e) else float("inf")
                cols += [_num(lo), _num(hi)]
            rows.append(",".join(cols + [str(budget), str(int(self.visited[flat]))]))
        return "\n".join(rows) + "\n"


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if float(x).is_integer() else repr(x)


def write_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a table is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
