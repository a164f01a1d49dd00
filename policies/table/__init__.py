"""Budget lookup tables: load, validate, check provenance, look up. Standard library only.

A serving engine imports this module: it needs nothing beyond the standard library and
chunkpilot's own standard-library modules (``python -S -c 'import policies.table'``
works: the pass price of ``envs.pricing``, the state vocabulary of ``envs.state``, the
slack count of ``envs.slack``, the deployment's features of ``envs.deployment``), and a
lookup is a handful of bisections.

A table maps a few bucketed quantities that an engine reads every pass to an action
that becomes a token budget. Format (JSON, ``schema_version`` 2)::

    {
      "schema_version": 2,
      "kind": "chunkpilot-budget-table",
      "action": {"kind": "tokens"},   # what a cell holds (see ACTIONS)
      "features": [{"name": "running_decodes", "edges": [4, 16, 64]}, ...],
      "budgets": [...],   # one per cell, row-major over the features in order
      "visited": [...],   # 1 where the policy was seen in that cell, 0 where filled in
      "default_budget": 2048,   # used when a lookup fails at run time
      "provenance": {
        "hardware": {"name": "h100-sxm", "hbm_bytes_per_s": ..., "peak_flops_per_s": ...,
                     "memory_bytes": ..., "per_pass_overhead_s": 0.0},   # the last: optional
        "model": {"name": "llama-3-8b", "layers": 32, "hidden_size": 4096, "heads": 32,
                  "kv_heads": 8, "head_dim": 128, "bytes_per_weight": 2, "tensor_parallel": 1,
                  "params": 8.03e9},   # params: optional (tables made before it lack it)
        "slo": {"ttft_s": 2.0, "itl_s": 0.1},
        "deployments": {"range": {"prefill_tokens_per_itl": [152, 4214]},  # optional: the
                        "kv_tokens": 467280},   # table carries (see below)
        ...   # free-form: run_dir, algo, commit, exported, rule, room
      },
      "fidelity": {...}
    }

A feature with edges ``e`` has ``len(e) + 1`` buckets; value ``v`` falls in bucket
``bisect_right(e, v)`` (so an edge value belongs to the bucket above it).

A time-fraction table whose provenance has ``deployments`` carries to other deployments:
``BudgetTable.repriced`` turns it into the table for another cost model, SLO pair and KV
cache, within ``range`` (the deployment features of ``envs.deployment`` it was made for;
empty: any). Such a table may bucket a deployment feature (``DEPLOYMENT_AXES``), a constant
of the deployment it serves, computed with ``kv_tokens`` (the KV cache's tokens).

An engine calls ``table.budget(state)`` before each pass, where ``state`` maps names of
``envs.state.TABLE_INPUTS`` to numbers, counted as ``envs.state`` defines them; it needs
to compute only the names in ``table.needs``.

The command line (``policies/table/__main__.py``, which may import more):

    python -m policies.table check TABLE --hardware h100-sxm --model llama-3-8b \\
        [--slo-ttft-s 2 --slo-itl-s 0.1]      # exit 0: match; exit 2: one line saying why
    python -m policies.table show TABLE       # one line: provenance, budgets, features
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from bisect import bisect_right
from collections.abc import Mapping

from envs.deployment import FEATURES as DEPLOYMENT_FEATURES
from envs.deployment import deployment
from envs.pricing import COST_FIELDS, Coefficients, decode_pass_s, prefill_due_s, state_budget
from envs.slack import slack_passes
from envs.state import BY_NAME, DERIVED, SLACK_COUNTS, TABLE_INPUTS

SCHEMA_VERSION = 2
KIND = "chunkpilot-budget-table"

STATE = {name: BY_NAME[name].meaning for name in TABLE_INPUTS}
"""What an engine provides before each pass, by name (``envs.state`` says how each is counted)."""

# Provenance: what the table was built for. Numbers are compared with what an engine
# serves (see BudgetTable.mismatch).
HARDWARE_FIGURES = ("hbm_bytes_per_s", "peak_flops_per_s", "memory_bytes")
MODEL_SHAPE = ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "tensor_parallel")
SLO_FIELDS = ("ttft_s", "itl_s")
# Two parts of one name differ in memory and bandwidth by more than this (A100 40 vs
# 80 GB, a MIG slice vs the whole GPU); the same part reports within a few percent of
# its datasheet (an H200's 141 GB reads as 150.1e9 bytes through NVML: 6%).
FIGURE_TOLERANCE = 0.15
MAX_STEP_S = 60.0
"""The most a table's recorded fixed cost per pass may be: no engine step takes a minute."""
# Bytes per weight: bf16 vs fp8 vs 4-bit differ by 2x; 4-bit schemes differ by their
# scales (0.5 to 0.5625).
BYTES_PER_WEIGHT_TOLERANCE = 0.15
SLO_TOLERANCE = 0.01
# Parameter count: one shape (layers, widths, heads) carries models whose vocabularies and
# MLP widths differ, so their weights differ (Llama-3-8B 8.03B, Mistral-7B 7.24B: 10%) and
# so does every pass's price; two checkpoints of one model agree exactly.
PARAMS_TOLERANCE = 0.05
MAX_BUDGET = 2**31 - 1
"""Largest budget a cell may hold: a pass's token count, which engines keep in int32."""
MAX_TABLE_BYTES = 16 << 20
MAX_DEPTH = 32


class TableError(ValueError):
    """A table file that cannot be used; the message says which field and why."""


# --- actions: what a cell holds and how it becomes a token budget --------------------

def _cells(data: dict, key: str, table: "BudgetTable", path: str) -> list:
    """The table's cell values under ``key``: one per cell."""
    cells = data.get(key)
    if not isinstance(cells, list) or len(cells) != table.cells:
        got = len(cells) if isinstance(cells, list) else cells
        raise TableError(f"{path}: {key}: must list {table.cells} cells (the product of "
                         f"the bucket counts), got {got!r}")
    return cells


class TokensAction:
    """Each cell holds a token budget; the budget of a pass is its cell's value."""

    kind = "tokens"
    max_fraction = None
    """A token table holds no cap on the longest pass (it cannot price one)."""
    pricing_needs: frozenset = frozenset()
    """What it prices with beyond :attr:`needs` (nothing: it prices nothing)."""

    def __init__(self, table: "BudgetTable", spec: dict, data: dict, path: str):
        budgets = _cells(data, "budgets", table, path)
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BUDGET for b in budgets):
            raise TableError(f"{path}: budgets: every cell must be a positive integer <= {MAX_BUDGET}")
        derived = [f for f in table.features if f in DERIVED or f in DEPLOYMENT_AXES]
        if derived:
            raise TableError(f"{path}: features: {', '.join(derived)} is derived by a "
                             "time_fraction action only")
        self.cells = tuple(budgets)
        self.needs = frozenset(table.features)
        self.max_budget = max(self.cells)
        self.min_budget = min(self.cells)
        self._axes = tuple(zip(table.features, table.edges, table.strides))

    def cell(self, state: Mapping[str, float]) -> int:
        """The index of the cell ``state`` falls in."""
        idx = 0
        for name, edges, stride in self._axes:
            idx += bisect_right(edges, state[name]) * stride
        return idx

    def budget(self, state: Mapping[str, float], scale: float = 1.0) -> int:
        """The cell's budget (``scale``, the engine's speed against a cost model, does not
        apply: a token table stores none)."""
        return self.cells[self.cell(state)]


MAX_FRACTION = 16.0
"""The largest time budget a cell may hold, in ITL targets."""
DEPLOYMENT_AXES = DEPLOYMENT_FEATURES[:4]
"""Deployment features a time-fraction table may bucket (``envs.deployment``): constant
while it serves, computed when it is loaded or re-priced for a deployment."""
SECONDS_FEATURES = {"oldest_wait_s": "ttft_s", "prefill_due_s": "ttft_s", "last_step_s": "itl_s",
                    "decode_pass_s": "itl_s"}
"""Features in seconds, and the SLO target their edges scale with when a table is re-priced
for another SLO (every other feature is a count, a share or in passes)."""
RANGE_TOLERANCE = 1e-6
"""Relative slack of the range check (a deployment at an end of the range is in it)."""


class TimeFractionAction:
    """Each cell holds a fraction of the ITL target: the pass's time budget. The budget is
    the running decodes plus the largest chunk after the head request's prefix whose
    pass, priced by ``envs.pricing`` with the cost model the table stores
    (``action.cost``: ``envs.pricing.COST_FIELDS``), fits in that time; the cap with
    nothing decoding (no one's ITL is at stake)."""

    kind = "time_fraction"
    pricing_needs = frozenset({"head_remaining_tokens", "next_prefills"})
    """What the conversion prices with beyond :attr:`needs`, where the engine has prefix
    caching: the prefills a pass reaches past the head, each with its cached prefix
    (``envs.pricing.state_budget``). A lookup does not require them (without them the pass
    is priced as the head's chunk alone); an engine with prefix caching supplies them."""

    def __init__(self, table: "BudgetTable", spec: dict, data: dict, path: str):
        fractions = _cells(data, "fractions", table, path)
        if not all(_is_positive(f) and f <= MAX_FRACTION for f in fractions):
            raise TableError(f"{path}: fractions: every cell must be a number in (0, {MAX_FRACTION:g}]")
        cost = spec.get("cost")
        if not isinstance(cost, dict):
            raise TableError(f"{path}: action.cost: must be an object holding {', '.join(COST_FIELDS)}")
        for f in COST_FIELDS:
            if not (_finite(cost.get(f)) and cost[f] >= 0):
                raise TableError(f"{path}: action.cost.{f}: got {_short(cost.get(f))}, must be a "
                                 "finite number >= 0 (seconds)")
        if cost["exposed"] > 1:
            raise TableError(f"{path}: action.cost.exposed: got {cost['exposed']!r}, must lie in [0, 1]")
        itl, cap = spec.get("itl_s"), spec.get("cap")
        if not _is_positive(itl):
            raise TableError(f"{path}: action.itl_s: got {itl!r}, must be a number of seconds > 0")
        if not (isinstance(cap, int) and not isinstance(cap, bool) and cap > 0):
            raise TableError(f"{path}: action.cap: got {cap!r}, must be an integer > 0")
        top = spec.get("max_fraction")
        if top is not None and not (_is_positive(top) and top <= MAX_FRACTION):
            raise TableError(f"{path}: action.max_fraction: got {_short(top)}, must be a number "
                             f"in (0, {MAX_FRACTION:g}] (the longest pass, in ITL targets) or absent")
        self.cells, self.itl_s, self.cap = tuple(float(f) for f in fractions), itl, cap
        self.max_fraction = None if top is None else float(top)
        """The operator's cap on the longest pass while anyone decodes, in ITL targets
        (``Scenario.max_pass_itl``): no cell's fraction is used above it; None: no cap."""
        self.cost = Coefficients.of(cost)
        self.spec = {"kind": self.kind, "itl_s": itl, "cap": cap, "cost": dict(cost)}
        if top is not None:
            self.spec["max_fraction"] = top
        needs = {"running_decodes", "decode_context_tokens", "head_prefilled_tokens"}
        for name in table.features:
            needs.update(DERIVED.get(name, (name,)))
        self.deployment = None
        """The served deployment's features (``envs.deployment``), where the table buckets
        any: computed from the cost model, the SLO pair and the KV cache's tokens it is
        priced for (provenance ``deployments.kv_tokens``, or :meth:`BudgetTable.repriced`)."""
        if any(n in DEPLOYMENT_AXES for n in table.features):
            kv = (table.provenance.get("deployments") or {}).get("kv_tokens")
            if kv is None:
                raise TableError(f"{path}: provenance.deployments.kv_tokens: got None, must be the "
                                 "KV cache's tokens (> 0) where a feature is a deployment's")
            self.deployment = deployment(self.cost, table.provenance["slo"]["ttft_s"], itl,
                                         kv).as_dict()
        self.needs = frozenset(n for n in needs if n not in DEPLOYMENT_AXES)
        self.max_budget = None  # a budget per pass, up to the cap: the engine clamps it
        self.min_budget = 1
        self._axes = tuple(zip(table.features, table.edges, table.strides))

    def value(self, name: str, state: Mapping[str, float]) -> float:
        if name == "decode_pass_s":
            return decode_pass_s(self.cost, state["running_decodes"], state["decode_context_tokens"])
        if name == "itl_slack_passes":
            return slack_passes(state["itl_slow_tokens"], state["itl_decode_tokens"],
                                int(state["running_decodes"]))
        if name in DEPLOYMENT_AXES:
            return self.deployment[name]
        if name == "prefill_due_s":
            return prefill_due_s(self.cost, int(state["running_decodes"]), int(state["decode_context_tokens"]),
                                 int(state["head_prefilled_tokens"]), int(state["waiting_prefill_tokens"]),
                                 state["oldest_wait_s"], self.itl_s, self.cap)
        return state[name]

    def cell(self, state: Mapping[str, float]) -> int:
        """The index of the cell ``state`` falls in."""
        idx = 0
        for name, edges, stride in self._axes:
            idx += bisect_right(edges, self.value(name, state)) * stride
        return idx

    def fraction(self, state: Mapping[str, float]) -> float:
        f = self.cells[self.cell(state)]
        return f if self.max_fraction is None else min(f, self.max_fraction)

    def budget(self, state: Mapping[str, float], scale: float = 1.0,
               cost: Coefficients | None = None) -> int:
        """``scale``: this engine's measured time per second the cost model prices
        (``policies.table.correction.StepScale``), so that the pass takes its fraction of
        the ITL target on this engine; ``cost`` overrides the stored coefficients when
        converting the fraction to tokens (an engine calibrated apart, say with its own
        per-step overhead). The cells are looked up with the stored coefficients."""
        if not state["running_decodes"]:
            return self.cap
        return state_budget(cost or self.cost, state, self.fraction(state) * self.itl_s / scale,
                            self.cap)


# One entry per action kind. A kind reads its cells (and any coefficients) from the
# table, says which state quantities it needs, its largest budget (None: unbounded,
# the engine clamps), and turns a state into a budget.
ACTIONS = {TokensAction.kind: TokensAction, TimeFractionAction.kind: TimeFractionAction}


class BudgetTable:
    """A validated table. ``budget(state)`` returns the token budget for a pass."""

    __slots__ = ("features", "edges", "strides", "cells", "action", "visited", "default_budget",
                 "provenance", "fidelity", "path", "digest", "_budget")

    def __init__(self, data: dict, path: str = "<table>", digest: str | None = None):
        self.path = path
        self.digest = digest
        if not isinstance(data, dict):
            raise TableError(f"{path}: not a JSON object")
        if data.get("kind") != KIND:
            raise TableError(f"{path}: kind: got {data.get('kind')!r}, must be {KIND!r}")
        version = data.get("schema_version")
        if version == 1:
            raise TableError(f"{path}: schema_version 1 has no provenance to check against the "
                             f"served model and hardware; re-export it (python -m eval export "
                             f"RUN_DIR --out {path})")
        if version != SCHEMA_VERSION:
            raise TableError(f"{path}: schema_version: got {version!r}, this runtime reads "
                             f"{SCHEMA_VERSION}")
        self._read_features(data.get("features"))
        # Provenance before the action: a time-fraction action with a deployment feature
        # reads the SLO and the KV cache from it.
        self.provenance = _read_provenance(data.get("provenance"), path)
        spec = data.get("action")
        if not isinstance(spec, dict) or spec.get("kind") not in ACTIONS:
            got = spec.get("kind") if isinstance(spec, dict) else spec
            raise TableError(f"{path}: action.kind: got {got!r}, this runtime reads "
                             f"{', '.join(ACTIONS)}")
        self.action = ACTIONS[spec["kind"]](self, spec, data, path)
        self._budget = self.action.budget
        visited = data.get("visited", [1] * self.cells)
        if not isinstance(visited, list) or len(visited) != self.cells:
            raise TableError(f"{path}: visited: must list {self.cells} cells")
        self.visited = tuple(bool(v) for v in visited)
        default = data.get("default_budget")
        if not isinstance(default, int) or isinstance(default, bool) or not 0 < default <= MAX_BUDGET:
            raise TableError(f"{path}: default_budget: got {_short(default)}, must be a positive "
                             f"integer <= {MAX_BUDGET} (the budget used when a lookup fails)")
        self.default_budget = default
        self.fidelity = data.get("fidelity", {})

    def _read_features(self, feats) -> None:
        path = self.path
        if not isinstance(feats, list) or not feats:
            raise TableError(f"{path}: features: must be a non-empty list")
        names, edges = [], []
        for i, f in enumerate(feats):
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise TableError(f"{path}: features[{i}]: must be an object with a name")
            if (f["name"] not in STATE and f["name"] not in DERIVED
                    and f["name"] not in DEPLOYMENT_AXES or f["name"] in SLACK_COUNTS):
                known = [n for n in list(STATE) + list(DERIVED) + list(DEPLOYMENT_AXES)
                         if n not in SLACK_COUNTS]
                raise TableError(f"{path}: features[{i}].name: got {f['name']!r}, an "
                                 f"engine can provide: {', '.join(known)}")
            e = f.get("edges")
            if not isinstance(e, list) or not all(_finite(x) for x in e):
                raise TableError(f"{path}: features[{i}].edges: must be a list of finite numbers")
            if any(b <= a for a, b in zip(e, e[1:])):
                raise TableError(f"{path}: features[{i}].edges: must increase strictly")
            names.append(f["name"])
            edges.append(tuple(float(x) for x in e))
        if len(set(names)) != len(names):
            raise TableError(f"{path}: features: names must be distinct")
        self.features, self.edges = tuple(names), tuple(edges)
        cells, strides = 1, []
        for e in reversed(self.edges):
            strides.append(cells)
            cells *= len(e) + 1
        self.strides = tuple(reversed(strides))
        self.cells = cells

    @classmethod
    def load(cls, path: str) -> "BudgetTable":
        """Read and validate a table file. Refused with one line: anything but a regular
        file of at most ``MAX_TABLE_BYTES`` (a pipe or ``/dev/zero`` would never end), text
        that is not UTF-8, JSON that is invalid or nests deeper than ``MAX_DEPTH``, and
        JSON's non-standard NaN and Infinity."""
        raw = _read_file(path)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise TableError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as err:
            raise TableError(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise TableError(f"{path}: nests lists or objects more than {MAX_DEPTH} deep") from None
        except ValueError as err:  # NaN/Infinity, or an integer of over 4,300 digits
            raise TableError(f"{path}: not valid JSON ({_value_error(err)})") from None
        if _depth(data) > MAX_DEPTH:
            raise TableError(f"{path}: nests lists or objects more than {MAX_DEPTH} deep")
        return cls(data, path, hashlib.sha256(raw).hexdigest()[:12])

    # --- the engine's interface ------------------------------------------------------

    @property
    def needs(self) -> frozenset:
        """The state quantities ``budget`` requires; an engine computes only these, and
        :attr:`pricing_needs` where it has prefix caching."""
        return self.action.needs

    @property
    def pricing_needs(self) -> frozenset:
        """The quantities ``budget`` also prices with where the engine has prefix caching
        (``TimeFractionAction.pricing_needs``; none for a token table)."""
        return self.action.pricing_needs

    @property
    def itl_s(self) -> float:
        """The ITL target the table serves (its action's, else its provenance's SLO): the
        gap over which an engine counts a decode token as slow."""
        return float(getattr(self.action, "itl_s", None) or self.provenance["slo"]["itl_s"])

    def budget(self, state: Mapping[str, float], scale: float = 1.0) -> int:
        """The token budget for a pass in ``state`` (a mapping holding ``needs``); ``scale``:
        the serving engine's measured time per priced second (a time-fraction table
        divides its time budget by it; 1: the stored cost model is this engine's)."""
        return self._budget(state, scale)

    def with_step_overhead(self, seconds: float) -> "BudgetTable":
        """This table, turning its time fractions into tokens for an engine that adds
        ``seconds`` to every step beyond the stored cost model (measured with ``python -m
        envs.calibrate --steps``); a token table is returned unchanged."""
        if self.action.kind != TimeFractionAction.kind or not seconds:
            return self
        cost = self.action.cost._replace(fixed_s=self.action.cost.fixed_s + seconds)
        action = self.action
        self._budget = lambda state, scale=1.0: action.budget(state, scale, cost)
        return self

    def flattened(self, fraction: float = 1.0) -> "BudgetTable":
        """A copy of this time-fraction table with ``fraction`` of the ITL target in every
        cell: one time budget whatever the state, turned into tokens as this table turns
        its cells (each pass's decodes priced by its stored cost model; the cap with
        nothing decoding). Against the table, what its cells' dependence on state is worth."""
        if self.action.kind != TimeFractionAction.kind:
            raise TableError(f"{self.path}: action.kind: got {self.action.kind!r}, flattening "
                             f"needs a table of time fractions ({TimeFractionAction.kind!r})")
        if not (_finite(fraction) and 0 < fraction <= MAX_FRACTION):
            raise TableError(f"fraction: got {_short(fraction)}, must be a number in "
                             f"(0, {MAX_FRACTION:g}]")
        data = self.to_dict()
        data.update(fractions=[float(fraction)] * self.cells, visited=[1] * self.cells, fidelity={})
        rule = f"every cell at {fraction:g} of the ITL target (flattened from {self.path})"
        data["provenance"] = {**data["provenance"], "rule": rule}
        return BudgetTable(data, f"{self.path} (flat at {fraction:g})")

    # --- deployments -----------------------------------------------------------------

    @property
    def deployment_range(self) -> dict | None:
        """The range of deployment features (``envs.deployment.FEATURES``) this table was
        made for (trained or fitted over), ``{feature: [lowest, highest]}`` (provenance ``deployments.range``);
        an empty dict where its cells do not depend on the deployment (a rule's table);
        None for a table made for the one deployment its provenance names."""
        block = self.provenance.get("deployments")
        return None if block is None else dict(block.get("range") or {})

    def outside(self, served: Mapping) -> str | None:
        """Why the deployment ``served`` (features by name) lies outside the range this table
        was made for, in one line; None inside it (or for a table without a range)."""
        out = []
        for name, (lo, hi) in (self.deployment_range or {}).items():
            v = served.get(name)
            slack = RANGE_TOLERANCE * max(abs(lo), abs(hi))
            if v is not None and not lo - slack <= v <= hi + slack:
                out.append(f"{name} {v:.4g} not in [{lo:.4g}, {hi:.4g}]")
        if not out:
            return None
        return (f"{self.path}: the deployment lies outside the range of deployments it was made "
                "for: " + "; ".join(out))

    def for_deployment(self, cost: Coefficients, ttft_s: float, itl_s: float, kv_tokens: int,
                       hardware: Mapping | None = None,
                       model: Mapping | None = None) -> tuple["BudgetTable", str | None]:
        """(this table re-priced for a deployment (:meth:`repriced`), why that deployment lies
        outside the range the table was made for, or None): what every loader of a table
        that carries does, the caller refusing or warning on the reason."""
        served = deployment(cost, ttft_s, itl_s, kv_tokens).as_dict()
        return (self.repriced(cost, ttft_s, itl_s, kv_tokens, hardware, model),
                self.outside(served))

    def repriced(self, cost: Coefficients, ttft_s: float, itl_s: float, kv_tokens: int,
                 hardware: Mapping | None = None, model: Mapping | None = None) -> "BudgetTable":
        """This time-fraction table for another deployment: its fractions turned into tokens
        with ``cost`` (the served deployment's cost model: a preset's, a profile's or the
        engine's calibration), its ITL target ``itl_s``, the edges of its features in seconds
        scaled with the targets they are measured in (``SECONDS_FEATURES``), and any
        deployment feature it buckets computed for this deployment. A rule's table so
        re-priced is the rule's table exported for that deployment. It does not check the
        range (:meth:`outside`); ``hardware`` and ``model`` (provenance blocks) name what it
        now serves, the original provenance is kept under ``repriced_from``."""
        if self.action.kind != TimeFractionAction.kind:
            raise TableError(f"{self.path}: action.kind: got {self.action.kind!r}, re-pricing "
                             f"needs a table of time fractions ({TimeFractionAction.kind!r})")
        for name, v in (("ttft_s", ttft_s), ("itl_s", itl_s), ("kv_tokens", kv_tokens)):
            if not _is_positive(v):
                raise TableError(f"{name}: got {_short(v)}, must be a number > 0")
        data = self.to_dict()
        old = self.provenance["slo"]
        ratio = {"ttft_s": ttft_s / old["ttft_s"], "itl_s": itl_s / old["itl_s"]}
        data["features"] = [{"name": n, "edges": [x * ratio[SECONDS_FEATURES[n]] for x in e]
                             if n in SECONDS_FEATURES else list(e)}
                            for n, e in zip(self.features, self.edges)]
        data["action"] = {**data["action"], "itl_s": float(itl_s),
                          "cost": cost.as_dict()}
        prov = dict(self.provenance)
        prov["repriced_from"] = {k: prov[k] for k in ("hardware", "model", "slo")}
        prov["slo"] = {"ttft_s": float(ttft_s), "itl_s": float(itl_s)}
        prov["hardware"] = dict(hardware or {**prov["hardware"], "name": "repriced"})
        prov["model"] = dict(model or prov["model"])
        if prov.get("deployments") is not None:
            prov["deployments"] = {**prov["deployments"], "kv_tokens": int(kv_tokens)}
        data["provenance"] = prov
        data["fidelity"] = {}  # measured on the deployment it was made for, not this one
        return BudgetTable(data, f"{self.path} (re-priced)", self.digest)

    @property
    def max_budget(self) -> int | None:
        """The largest budget the table can ask for (None: no bound; the engine clamps)."""
        return self.action.max_budget

    # --- cells -----------------------------------------------------------------------

    def cell(self, values) -> int:
        """Flat index of the cell holding ``values`` (one per feature, in order)."""
        idx = 0
        for v, e, s in zip(values, self.edges, self.strides):
            idx += bisect_right(e, v) * s
        return idx

    @property
    def budgets(self) -> tuple:
        """The cells' values (token budgets for the tokens kind)."""
        return self.action.cells

    def lookup_values(self, values) -> int:
        """The cell value for feature values in order (the tokens kind's budget)."""
        return self.action.cells[self.cell(values)]

    def lookup(self, **state) -> int:
        """``budget`` with named quantities, e.g. ``lookup(running_decodes=40, ...)``."""
        missing = sorted(self.needs - state.keys())
        if missing:
            raise TableError(f"{self.path}: lookup needs {', '.join(map(repr, missing))}; the "
                             f"table reads {', '.join(sorted(self.needs))}")
        return self.budget(state)

    # --- provenance ------------------------------------------------------------------

    def mismatch(self, hardware: Mapping | None = None, model: Mapping | None = None,
                 slo: Mapping | None = None) -> str | None:
        """Why this table does not fit what is served, in one line; None if it fits.

        Each argument describes the serving side with the provenance block's field names;
        a side left out, or a figure given as None, is not compared. Rules:

        - hardware: the same name, and every figure known on both sides within
          ``FIGURE_TOLERANCE`` (a serving engine knows the name and the memory);
        - model: the same shape (layers, hidden size, heads, KV heads, head dim, tensor
          parallel), bytes per weight within ``BYTES_PER_WEIGHT_TOLERANCE``, and the
          parameter count within ``PARAMS_TOLERANCE`` where both sides know it; the name
          is not compared (one model has many names);
        - SLO: both targets within ``SLO_TOLERANCE``.
        """
        reasons = provenance_mismatches(self.provenance, hardware, model, slo)
        return f"{self.path}: " + "; ".join(reasons) if reasons else None

    def candidate_kinds(self) -> list[str]:
        """What each table its export chose among was (provenance ``dagger``): "round" (built
        from the model's decisions), "refined" (those cells searched in closed loop) or
        "rule" (a rule's exact table), in the order of ``dagger.candidates``."""
        dagger = self.provenance.get("dagger") or {}
        kinds = dagger.get("candidate_kinds")
        if kinds:
            return list(kinds)
        # A provenance that lists labels only: "round N", "refined", else a rule's spec.
        return ["refined" if c == "refined" else "round" if str(c).startswith("round ") else "rule"
                for c in dagger.get("candidates") or []]

    def rule_spec(self) -> str | None:
        """The spec of the rule this table is exactly (``time-budget-deadline-kv:16``), or
        None for a table built from a model's decisions."""
        p = self.provenance
        if p.get("rule_spec"):
            return str(p["rule_spec"])
        dagger, kinds = p.get("dagger") or {}, self.candidate_kinds()
        chosen = dagger.get("chosen", 0)
        if chosen < len(kinds) and kinds[chosen] == "rule":
            return str(dagger["candidates"][chosen])
        return None

    def origin(self) -> str:
        """What the table is and what built it, in words (``policies.table show``)."""
        p, dagger = self.provenance, self.provenance.get("dagger") or {}
        kinds, spec = self.candidate_kinds(), self.rule_spec()
        if spec:
            top = self.action.max_fraction
            capped = "" if top is None else f" under a cap of {top:g} times the ITL target"
            what = f"the {spec} rule's exact table{capped}: a rule, not a learned policy"
        elif p.get("rule_specs"):
            what = (f"the rules {', '.join(map(str, p['rule_specs']))}, the deployment picking "
                    "which (one per bucket of its feature): rules, not a learned policy")
        elif kinds and kinds[dagger.get("chosen", 0)] == "refined":
            what = "a table of the model's decisions, refined cell by cell in closed loop"
        elif p.get("run_dir"):
            label = (dagger.get("candidates") or ["round 0"])[dagger.get("chosen", 0)]
            what = "built from the model's decisions" + (
                " alone" if label == "round 0" else
                f" and those on the states its earlier tables led to ({label} of DAgger)")
        else:
            what = "origin not recorded"
        if p.get("run_dir"):
            what += (f"; {'measured against' if spec else 'its model:'} the {p.get('algo', '')} "
                     f"model of {p['run_dir']}")
        if kinds:
            n = {k: kinds.count(k) for k in ("round", "refined", "rule")}
            what += (f"; kept among {len(kinds)} candidates ({n['round']} from the model's "
                     f"decisions{', the refined one' if n['refined'] else ''}, {n['rule']} rules' "
                     "tables) as the one keeping most of the model's capacity and goodput")
        found = self.room_found()
        if spec and found is not None:
            rule = self._room()["rule"]
            what += (f"; the rollout reference over {rule} finds no room beyond it on this "
                     "deployment: a learned table is unlikely to beat the rule here (room, below)"
                     if not found else
                     f"; the rollout reference finds room beyond {rule} on this deployment "
                     "that no table built from the model took (room, below)")
        return what

    def _room(self) -> dict | None:
        """The provenance ``room`` record read back (what ``python -m agents.presets --room``
        wrote), or None where not measured; ValueError where it is unreadable."""
        room = self.provenance.get("room")
        if room is None:
            return None
        try:
            ref, tab = room["reference_vs_rule"], room["table_vs_rule"]
            mean = [None if m is None else float(m) for m in (ref["mean"], tab["mean"])]
            rps = room["capacity_rps"]["rule"]
            return {"rule": str(room["rule"]), "streams": int(room["streams"]),
                    "rule_rps": None if rps is None else float(rps),
                    "ref": (str(ref["kind"]), str(ref["figure"]), mean[0]),
                    "table": (str(tab["kind"]), str(tab["figure"]), mean[1])}
        except (KeyError, TypeError, ValueError):
            raise ValueError("unreadable") from None

    def room_found(self) -> bool | None:
        """Whether the rollout reference beat the best rule beyond its interval on this
        table's deployment (provenance ``room``); None where that was not measured or the
        record is unreadable."""
        try:
            room = self._room()
        except ValueError:
            return None
        return None if room is None else room["ref"][0] == "beats"

    def room_text(self) -> str | None:
        """The room beyond the best rule on this table's deployment in words (provenance
        ``room``): the rule, the rollout reference against it, this table against it, and
        the share of the room the table takes where both lead beyond their intervals; None
        where not measured."""
        try:
            room = self._room()
        except ValueError:
            return ("room beyond the best rule: the record is unreadable (measure it again: "
                    "python -m agents.presets --room)")
        if room is None:
            return None
        (ref_kind, ref_fig, ref_mean), (tab_kind, tab_fig, tab_mean) = room["ref"], room["table"]
        rps = "no capacity" if room["rule_rps"] is None else f"{room['rule_rps']:.3g} req/s"
        text = (f"room beyond the best rule, {room['rule']} ({rps} on {room['streams']} streams of "
                f"the serving scenario): the rollout reference, which sees the future, {ref_fig} "
                f"({ref_kind}); this table {tab_fig} ({tab_kind})")
        if ref_kind != "beats":
            return text + ": no room found beyond the interval"
        if tab_kind != "beats" or not ref_mean or tab_mean is None:
            return text + ": the table takes none of it beyond its interval"
        return text + f": the table takes {min(max(tab_mean / ref_mean, 0.0), 1.0):.0%} of the room"

    def describe(self) -> str:
        """One line: what the table was built for, from what, and what it asks for."""
        p = self.provenance
        hw, m, slo = p["hardware"], p["model"], p["slo"]
        cells = self.action.cells
        budgets = (f"budgets {self.action.min_budget}-{self.max_budget}" if self.max_budget is not None
                   else f"time fractions {min(cells):g}-{max(cells):g} of the ITL target, budgets up "
                   f"to {self.action.cap} (the ceiling to serve it with)")
        top = self.action.max_fraction
        if top is not None:
            budgets += f", no pass over {top:g} times the ITL target while anyone decodes"
        rule = self.rule_spec()
        made = ", ".join([f"{k} {p[k]}" for k in ("exported", "run_dir", "algo", "commit") if p.get(k)
                          and not (rule and k == "algo")] + ([f"the {rule} rule exactly" + (" under that cap" if top is not None else "")]
                             if rule else []))
        overhead = hw.get("per_pass_overhead_s") or 0.0
        hw_name = hw["name"] + (f" (priced with {overhead * 1e3:g} ms per pass)" if overhead else "")
        rng = self.deployment_range
        if rng is not None:
            made += ("; " if made else "") + (
                "carries to any deployment, re-priced for it" if not rng else
                "carries to deployments within the range of deployments it was made for ("
                + ", ".join(f"{k} {_num(lo)}-{_num(hi)}" for k, (lo, hi) in rng.items()) + "), re-priced for each")
        return (f"{self.path} [{self.digest or '-'}]: {hw_name} + {m['name']} (TP "
                f"{m['tensor_parallel']}), SLO TTFT {_num(slo['ttft_s'])} s / ITL "
                f"{_num(slo['itl_s'])} s; {self.cells} cells ({sum(self.visited)} visited), "
                f"{budgets}, default {self.default_budget}; reads {', '.join(self.features)}"
                + (f"; {made}" if made else ""))

    # --- writing ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        cells_key = "fractions" if self.action.kind == TimeFractionAction.kind else "budgets"
        return {
            "schema_version": SCHEMA_VERSION, "kind": KIND,
            "action": getattr(self.action, "spec", {"kind": self.action.kind}),
            "features": [{"name": n, "edges": list(e)} for n, e in zip(self.features, self.edges)],
            cells_key: list(self.budgets), "visited": [int(v) for v in self.visited],
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
        value = "fraction" if self.action.kind == TimeFractionAction.kind else "budget"
        rows = [",".join(head + [value, "visited"])]
        for flat, budget in enumerate(self.budgets):
            cols = []
            rest = flat
            for e, s in zip(self.edges, self.strides):
                b, rest = divmod(rest, s)
                lo = e[b - 1] if b > 0 else float("-inf")
                hi = e[b] if b < len(e) else float("inf")
                cols += [_num(lo), _num(hi)]
            rows.append(",".join(cols + [str(budget), str(int(self.visited[flat]))]))
        return "\n".join(rows) + "\n"


# --- provenance ----------------------------------------------------------------------

def _finite(x) -> bool:
    """A finite JSON number (an int too large for a float is not one; a bool is not one)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _is_positive(x) -> bool:
    return _finite(x) and x > 0


def _short(x) -> str:
    """``repr(x)`` in at most 60 characters (a 400-digit number stays one short line)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 128:
        return f"an integer of about {int(x.bit_length() * 0.30103) + 1} digits"
    text = repr(x)
    return text if len(text) <= 60 else text[:48] + f"... ({len(text)} chars)"


def _read_provenance(prov, path: str) -> dict:
    if not isinstance(prov, dict):
        raise TableError(f"{path}: provenance: must be an object with hardware, model and slo")
    blocks = (("hardware", HARDWARE_FIGURES, ()), ("model", ("bytes_per_weight",), MODEL_SHAPE),
              ("slo", SLO_FIELDS, ()))
    for block, numbers, ints in blocks:
        b = prov.get(block)
        if not isinstance(b, dict):
            raise TableError(f"{path}: provenance.{block}: must be an object")
        if block != "slo" and not (isinstance(b.get("name"), str) and b["name"]):
            raise TableError(f"{path}: provenance.{block}.name: must be a non-empty string")
        for f in numbers:
            if not _is_positive(b.get(f)):
                raise TableError(f"{path}: provenance.{block}.{f}: got {_short(b.get(f))}, must be a "
                                 "number > 0")
        for f in ints:
            v = b.get(f)
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_BUDGET):
                raise TableError(f"{path}: provenance.{block}.{f}: got {_short(v)}, must be an "
                                 f"integer > 0 and <= {MAX_BUDGET}")
    overhead = prov["hardware"].get("per_pass_overhead_s")  # tables exported before it lack it
    if overhead is not None and not (_finite(overhead) and 0 <= overhead <= MAX_STEP_S):
        raise TableError(f"{path}: provenance.hardware.per_pass_overhead_s: got {_short(overhead)}, "
                         f"must be a number of seconds in [0, {MAX_STEP_S:g}] (or absent)")
    deployments = prov.get("deployments")
    if deployments is not None:
        if not isinstance(deployments, dict):
            raise TableError(f"{path}: provenance.deployments: must be an object (range, kv_tokens)")
        rng = deployments.get("range")
        if rng is not None and not isinstance(rng, dict):
            raise TableError(f"{path}: provenance.deployments.range: must map features to [low, high]")
        for name, lohi in (rng or {}).items():
            if name not in DEPLOYMENT_FEATURES:
                raise TableError(f"{path}: provenance.deployments.range: got {_short(name)}, the "
                                 f"features are {', '.join(DEPLOYMENT_FEATURES)}")
            if not (isinstance(lohi, list) and len(lohi) == 2 and all(_finite(x) for x in lohi)
                    and lohi[0] <= lohi[1]):
                raise TableError(f"{path}: provenance.deployments.range.{name}: got "
                                 f"{_short(lohi)}, must be [low, high]: finite numbers, low <= high")
        kv = deployments.get("kv_tokens")
        if kv is not None and not (_is_positive(kv) and kv <= 2 ** 53):
            raise TableError(f"{path}: provenance.deployments.kv_tokens: got {_short(kv)}, must be "
                             "the KV cache's tokens: a number > 0 (or absent)")
    params = prov["model"].get("params")  # tables exported before it was recorded lack it
    if params is not None and not _is_positive(params):
        raise TableError(f"{path}: provenance.model.params: got {_short(params)}, must be a "
                         "number > 0 (or absent)")
    return prov


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


def _hardware_mismatch(table: Mapping, served: Mapping) -> str | None:
    diffs = []
    if served.get("name") is not None and _norm(served["name"]) != _norm(table["name"]):
        diffs.append("name")
    for f in HARDWARE_FIGURES:
        if served.get(f) is not None and not _close(table[f], served[f], FIGURE_TOLERANCE):
            diffs.append(f)
    if not diffs:
        return None
    return (f"hardware: table {_side(table, diffs)}, serving {_side(served, diffs)}")


def _model_mismatch(table: Mapping, served: Mapping) -> str | None:
    diffs = [f for f in MODEL_SHAPE if served.get(f) is not None and served[f] != table[f]]
    bpw = served.get("bytes_per_weight")
    if bpw is not None and not _close(table["bytes_per_weight"], bpw, BYTES_PER_WEIGHT_TOLERANCE):
        diffs.append("bytes_per_weight")
    params = served.get("params")
    if (params is not None and table.get("params") is not None
            and not _close(table["params"], params, PARAMS_TOLERANCE)):
        diffs.append("params")
    if not diffs:
        return None
    return f"model: table {_side(table, diffs)}, serving {_side(served, diffs)}"


def _slo_mismatch(table: Mapping, served: Mapping) -> str | None:
    diffs = [f for f in SLO_FIELDS
             if served.get(f) is not None and not _close(table[f], served[f], SLO_TOLERANCE)]
    if not diffs:
        return None
    return f"slo: table {_side(table, diffs)}, serving {_side(served, diffs)}"


def _side(block: Mapping, fields: list[str]) -> str:
    """``name (field value, ...)`` for the fields that differ."""
    figures = ", ".join(f"{f} {_fig(block.get(f))}" for f in fields if f != "name")
    name = block.get("name")
    if name is None:
        return figures
    return f"{name}" + (f" ({figures})" if figures else "")


def _fig(x) -> str:
    if isinstance(x, float) and x >= 1e6:
        return f"{x:.3g}".replace("e+", "e")
    return _num(x) if isinstance(x, (int, float)) else str(x)


def _norm(name: str) -> str:
    return name.strip().lower()


def provenance_mismatches(prov: Mapping, hardware: Mapping | None = None,
                          model: Mapping | None = None, slo: Mapping | None = None) -> list[str]:
    """Why the provenance blocks ``prov`` (``hardware``, ``model``, ``slo``) do not describe
    what is served, by :meth:`BudgetTable.mismatch`'s rules: one reason per side that
    differs, none where all fit."""
    reasons = [_hardware_mismatch(prov["hardware"], hardware) if hardware is not None else None,
               _model_mismatch(prov["model"], model) if model is not None else None,
               _slo_mismatch(prov["slo"], slo) if slo is not None else None]
    return [r for r in reasons if r]


def hardware_provenance(profile) -> dict:
    """The provenance block of a hardware profile (any object with its fields), with the
    fixed cost per pass the table was priced with (recorded, not compared: a time-fraction
    table's ``fixed_s`` includes it, and an engine adds only its own cost beyond it,
    ``CHUNKPILOT_STEP_OVERHEAD_S``; this says how much is already in)."""
    return {"name": profile.name, **{f: float(getattr(profile, f)) for f in HARDWARE_FIGURES},
            "per_pass_overhead_s": float(profile.per_pass_overhead_s)}


def model_provenance(profile) -> dict:
    """The provenance block of a model profile (any object with its fields)."""
    out = {"name": profile.name, **{f: int(getattr(profile, f)) for f in MODEL_SHAPE}}
    out["bytes_per_weight"] = float(profile.bytes_per_weight)
    out["params"] = float(profile.params)
    return out


# NVIDIA's device names (nvidia-smi, NVML, torch.cuda.get_device_name) -> the names of
# envs/profiles.py's presets. Order matters: the first pattern that matches wins.
_DEVICE_NAMES = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b.*\bPCIE\b", "h100-pcie"),
    (r"\bH100\b.*\bNVL\b", "h100-nvl"),
    (r"\bH100\b", "h100-sxm"),  # "NVIDIA H100 80GB HBM3", "H100 SXM5 80GB"
    (r"\bA100\b.*\bPCIE\b.*\b80\s?GB\b|\bA100\b.*\b80\s?GB\b.*\bPCIE\b", "a100-80g-pcie"),
    (r"\bA100\b.*\b80\s?GB\b", "a100-80g"),  # "NVIDIA A100-SXM4-80GB"
    (r"\bA100\b", "a100-40g"),
    (r"\bL40S\b", "l40s"),
)


def device_hardware_name(device: str) -> str:
    """The hardware name of a device as an engine reports it: ``"NVIDIA H100 80GB HBM3"``
    -> ``"h100-sxm"``, ``"cpu"`` -> ``"cpu"``; an unknown part -> its name in lower case
    with dashes (``"nvidia-rtx-4090"``), which matches no preset."""
    upper = device.upper().replace("-", " ").replace("_", " ")
    for pattern, name in _DEVICE_NAMES:
        if re.search(pattern, upper):
            return name
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


# --- files ---------------------------------------------------------------------------

def _num(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if float(x).is_integer() else repr(x)


def _read_file(path: str) -> bytes:
    try:
        st = os.stat(path)
    except (OSError, ValueError) as err:
        raise TableError(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe or a device)"
        raise TableError(f"{path}: cannot read: {kind}")
    if st.st_size > MAX_TABLE_BYTES:
        raise TableError(f"{path}: holds {st.st_size:,} bytes, more than a table's {MAX_TABLE_BYTES:,}")
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_TABLE_BYTES + 1)
    except OSError as err:
        raise TableError(f"{path}: cannot read ({err.strerror})") from None


def _value_error(err: ValueError) -> str:
    """What a ValueError of ``json.loads`` says, in one short phrase (Python's text on a
    huge integer is 150 characters of advice). ``envs.files`` has its own: this module
    imports only the standard library, so that an engine can carry it alone."""
    text = str(err)
    if "integer string conversion" in text:
        return f"an integer of over {sys.get_int_max_str_digits():,} digits"
    return text[:120]


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(data) -> int:
    """How deep lists and objects nest in ``data``."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((c, depth + 1) for c in (item.values() if isinstance(item, dict) else item))
    return deepest


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
