"""A lookup table as a simulator policy (``table:PATH``), and its flat twin
(``table-flat:PATH``): it reads the quantities it needs from the scheduler's state, by their
``envs.state`` names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from envs.errors import ConfigError, show
from envs.state import SLACK_COUNTS
from policies.base import BudgetPolicy, Param
from policies.table import (MAX_FRACTION, BudgetTable, TableError, hardware_provenance,
                            model_provenance)


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

    spec, kind = "table", "table"
    summary = ("an exported lookup table; table:auto: the shipped table of the scenario's "
               "hardware and model (tables/HARDWARE__MODEL.json)")

    def __init__(self, table: BudgetTable, name: str | None = None, stored_cost: bool = False):
        self.table = table
        self.name = name or f"table:{table.path}"
        self._needs = tuple(table.needs)
        self._pricing = tuple(table.pricing_needs)
        self._time = table.action.kind == "time_fraction" and not stored_cost
        self._itl_s = table.itl_s

    @classmethod
    def usage(cls) -> str:
        return "table:PATH"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        path = ":".join(args)
        if not path:
            raise ConfigError(f"policy: got {spec!r}, table takes table:PATH (or table:auto)")
        return _from_path(spec, path, scenario, options)

    def serving(self) -> tuple[str, str] | None:
        return None if self.diagnostic else ("table", str(self.table.path))

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
        if self._pricing and state.next_prefills:  # priced with the cached prefixes, as an
            values = dict(values, **{n: state[n] for n in self._pricing})  # engine does
        if self._time:
            return self.table.action.budget(values, cost=state.cost)
        return self.table.budget(values)


TABLES = Path(__file__).resolve().parent.parent / "tables"
"""The shipped tables, one per (hardware, model) preset: ``tables/HARDWARE__MODEL.json``."""


def shipped_table(scenario, spec: str = "table:auto") -> Path:
    """The table shipped for a scenario's hardware and model (``spec``: what asked for it,
    as the error names it)."""
    path = TABLES / f"{Path(scenario.hardware).stem}__{Path(scenario.model).stem}.json"
    if not path.exists():
        shipped = sorted(p.stem for p in TABLES.glob("*.json"))
        raise ConfigError(f"policy: {spec} has no table for {scenario.hardware} + {scenario.model} "
                          f"(tables/: {', '.join(shipped) or 'none'})")
    return path


def load_table_policy(path: str, scenario=None, name: str | None = None,
                      allow_mismatch: bool = False, flat: float | None = None) -> "TablePolicy":
    """A table as a policy. A table built for other hardware, another model shape or another
    SLO than ``scenario``'s is refused (``allow_mismatch``: warned about on stderr). With
    ``flat``, its flat twin: the table with that fraction of the ITL target in every cell."""
    try:
        table = BudgetTable.load(path)
        if flat is not None:
            table = table.flattened(flat)
    except TableError as err:
        raise ConfigError(f"table: {err}") from None
    cls = TablePolicy if flat is None else FlatTablePolicy
    name = name or (f"table:{path}" if flat is None else f"table-flat:{flat:g}:{path}")
    if scenario is None:
        return cls(table, name=name)
    hardware = hardware_provenance(scenario.hardware_profile())
    model = model_provenance(scenario.model_profile())
    if table.deployment_range is not None:
        return cls(for_scenario(table, scenario, allow_mismatch, hardware, model), name=name)
    slo = {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s}
    reason = table.mismatch(hardware, model, slo)
    other_part = reason and table.mismatch(hardware, model)
    if reason and not allow_mismatch:
        built = table.provenance["slo"]
        hint = (f"; serve its SLO with --slo-ttft-s {built['ttft_s']:g} --slo-itl-s "
                f"{built['itl_s']:g}, or" if table.mismatch(slo=slo) else ";")
        raise ConfigError(f"table: {reason}{hint} pass --allow-table-mismatch to evaluate it anyway")
    if reason:
        how = ("; evaluated with the cost model it stores, as a serving engine would convert "
               "its fractions" if other_part and table.action.kind == "time_fraction" else "")
        print(f"warning: {reason}{how}", file=sys.stderr)
    if other_part:
        # Built for other hardware or another model: its fractions become tokens with its
        # own stored cost model, as a serving engine's would, plus the scenario's cost per
        # pass beyond the one it was priced with (an engine's CHUNKPILOT_STEP_OVERHEAD_S).
        priced = table.provenance["hardware"].get("per_pass_overhead_s") or 0.0
        extra = max(scenario.hardware_profile().per_pass_overhead_s - priced, 0.0)
        return cls(table.with_step_overhead(extra), name=name, stored_cost=True)
    return cls(table, name=name)


def for_scenario(table: BudgetTable, scenario, allow_mismatch: bool = False,
                 hardware: dict | None = None, model: dict | None = None,
                 quiet: bool = False) -> BudgetTable:
    """A table that carries (provenance ``deployments``) re-priced for ``scenario``'s
    deployment: its cost model, SLO pair and KV cache. One outside the range of deployments
    it was made for is refused (``allow_mismatch``: warned about on stderr, unless
    ``quiet``: an export judging its table on the deployments its run trained on)."""
    try:
        priced, reason = table.for_deployment(
            scenario.simulator_cost(), scenario.slo_ttft_s, scenario.slo_itl_s, scenario.kv_tokens(),
            hardware or hardware_provenance(scenario.hardware_profile()),
            model or model_provenance(scenario.model_profile()))
    except TableError as err:
        raise ConfigError(f"table: {err}") from None
    if reason and not allow_mismatch:
        raise ConfigError(f"table: {reason}; pass --allow-table-mismatch to evaluate it anyway")
    if reason and not quiet:
        print(f"warning: {reason}", file=sys.stderr)
    return priced


class FlatTablePolicy(TablePolicy):
    """A diagnostic: a table with one fraction of the ITL target in every cell
    (``BudgetTable.flattened``). Measured beside the table it flattens (``flattens``: that
    table's spec), it says what the table's dependence on state is worth apart from its
    time budget. On the table's own hardware, model and SLO it budgets every pass as
    ``time-budget:FRACTION`` does."""

    spec, diagnostic = "table-flat", True
    summary = ("that table (or auto) with FRACTION of the ITL target in every cell (1; in "
               "(0, 16]; a first part that is a decimal number is always FRACTION): against "
               "table:PATH, what its cells' dependence on state is worth")

    def __init__(self, table: BudgetTable, name: str | None = None, stored_cost: bool = False,
                 flattens: str | None = None):
        super().__init__(table, name, stored_cost)
        self.flattens = flattens
        """The spec of the table this one flattens (``table:PATH``): what it is measured against."""

    @classmethod
    def usage(cls) -> str:
        return "table-flat[:FRACTION]:PATH"

    @classmethod
    def from_spec(cls, spec, args, scenario, options):
        rest = ":".join(args)
        head, colon, tail = rest.partition(":")
        # A first part that is a decimal number (or empty) is the fraction: a path whose
        # first part is one takes the fraction in front (table-flat:1:2:t.json).
        head, path = (head, tail) if colon and (not head or _DECIMAL.fullmatch(head)) else (None, rest)
        if head == "":
            raise ConfigError(f"policy: got {show(spec)}, an empty FRACTION; fill it in or drop it "
                              "(table-flat[:FRACTION]:PATH)")
        if not path:
            raise ConfigError(f"policy: got {show(spec)}, no PATH; table-flat[:FRACTION]:PATH "
                              "(or auto)")
        fraction = 1.0 if head is None else FLAT_FRACTION.parse(spec, head)
        policy = _from_path(spec, path, scenario, options, flat=fraction)
        policy.flattens = f"table:{path}"
        return policy


def _from_path(spec: str, path: str, scenario, options: dict, flat: float | None = None):
    """The table policy of a spec's PATH (``auto``: the scenario's shipped table)."""
    file = str(shipped_table(scenario, spec)) if path == "auto" else path
    return load_table_policy(file, scenario, name=spec, flat=flat,
                             allow_mismatch=options.get("allow_table_mismatch", False))


_DECIMAL = re.compile(r"[0-9]*\.?[0-9]+")
FLAT_FRACTION = Param("fraction", float, 1.0, 0.0, MAX_FRACTION, "FRACTION of the ITL target")
