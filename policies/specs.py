"""Policy specs, as the command lines name them: ``static:2048``, ``table:PATH``, ...

=================================  ==========================================================
``static:N``                       the same budget every pass
``vllm-default[:offline]``         vLLM's default for the hardware (server entry point unless
                                   ``:offline``)
``queue-depth[:BASE]``             the queue-depth heuristic (base chunk 512)
``no-decode-boost[:LOW:HIGH]``     HIGH with nothing decoding, else LOW (2048:16384)
``sarathi-slo``                    Sarathi-Serve's static budget for the ITL target
``free-ride[:FLOOR:CAP]``          running decodes + this pass's free ride (256:16384)
``time-budget[:FRACTION]``         each pass, the largest budget priced within FRACTION of the
                                   ITL target (0.9; FRACTION in (0, 2])
``time-budget-kv[:FRACTION]``      the same, its fraction shrinking as the KV cache fills
``time-budget-few[:FRACTION]``     the same, its fraction growing when few decodes run
``time-budget-slack[:TOP]``        the same at fraction 1, up to TOP times the ITL target
                                   (4; TOP in (1, 16]) while under 0.8% of decode tokens
                                   run over it (spends the p99 slack)
``time-budget-slack-kv[:TOP]``     the same over time-budget-kv:1, spending only below 60%
                                   KV usage
``time-budget-deadline[:TOP]``     time-budget-slack spending the slack only while the prefill
                                   queue would be done later than 0.8 of the TTFT target at
                                   fraction 1
``time-budget-deadline-kv[:TOP]``  the same, stepping its fraction down the action ladder
                                   from 75% KV usage and spending the slack only below it
``reference:BUDGET[:H[:R]]``       the MPC reference over static BUDGET (not deployable: sees
                                   the future), horizon H s (2x TTFT), re-plan every R s
``model:RUN_DIR``                  a model trained by train.py
``table:PATH``                     an exported lookup table
``table:auto``                     the shipped table of the scenario's hardware and model
                                   (``tables/HARDWARE__MODEL.json``)
``table-flat[:FRACTION]:PATH``     that table (or ``auto``) with FRACTION of the ITL target in
                                   every cell (1; in (0, 16]; a first part that is a decimal
                                   number is always FRACTION): against ``table:PATH``, what
                                   its cells' dependence on state is worth. On the table's
                                   own hardware, model and SLO it budgets every pass as
                                   ``time-budget:FRACTION`` does (FRACTION up to 2)
=================================  ==========================================================
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from envs.engine import check_static_budget
from envs.errors import MAX_TOKENS, ConfigError, show
from envs.scenario import Scenario
from policies.base import BudgetPolicy

KNOWN = ("static:N", "vllm-default[:offline]", "queue-depth[:BASE]", "no-decode-boost[:LOW:HIGH]",
         "sarathi-slo", "free-ride[:FLOOR:CAP]", "time-budget[:FRACTION]",
         "time-budget-kv[:FRACTION]", "time-budget-few[:FRACTION]", "time-budget-slack[:TOP]",
         "time-budget-slack-kv[:TOP]", "time-budget-deadline[:TOP]", "time-budget-deadline-kv[:TOP]",
         "reference:BUDGET[:HORIZON_S[:REPLAN_S]]", "model:RUN_DIR",
         "table:PATH", "table:auto", "table-flat[:FRACTION]:PATH", "table-flat[:FRACTION]:auto")


def _numbers(spec: str, args: list[str], count: tuple[int, ...], kind=int) -> list:
    """The spec's arguments as ``kind`` (int or float), each finite and > 0."""
    if len(args) not in count:
        raise ConfigError(f"policy: got {spec!r}, wrong number of arguments; known specs: "
                          f"{', '.join(KNOWN)}")
    try:
        vals = [kind(a) for a in args]
    except ValueError:
        raise ConfigError(f"policy: got {show(spec)}, arguments must be "
                          f"{'integers' if kind is int else 'numbers'}") from None
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise ConfigError(f"policy: got {spec!r}, arguments must be "
                          f"{'> 0' if kind is int else 'finite and > 0'}")
    return vals


def _ints(spec: str, args: list[str], count: tuple[int, ...]) -> list[int]:
    vals = _numbers(spec, args, count, int)
    if any(v > MAX_TOKENS for v in vals):
        raise ConfigError(f"policy: got {show(spec)}, arguments must be > 0 and <= {MAX_TOKENS}")
    return vals


def _floats(spec: str, args: list[str], count: tuple[int, ...]) -> list[float]:
    return _numbers(spec, args, count, float)


def _one_number(spec: str, args: list[str], default: float, low: float, high: float,
                what: str) -> float:
    """The spec's one optional argument, a number in (low, high] (``default`` without one)."""
    if len(args) > 1:
        raise ConfigError(f"policy: got {show(spec)}, takes one {what}")
    try:
        v = float(args[0]) if args else default
    except ValueError:
        v = math.nan
    if not low < v <= high:
        raise ConfigError(f"policy: got {show(spec)}, {what} must lie in ({low:g}, {high:g}]")
    return v


def _fraction(spec: str, args: list[str]) -> float:
    return _one_number(spec, args, 0.9, 0.0, 2.0, "FRACTION of the ITL target")


def _top(spec: str, args: list[str]) -> float:
    return _one_number(spec, args, 4.0, 1.0, 16.0, "TOP multiple of the ITL target")


def load_table_policy(path: str, scenario: Scenario | None = None, name: str | None = None,
                      allow_mismatch: bool = False, flat: float | None = None):
    """A table as a policy. A table built for other hardware, another model shape or another
    SLO than ``scenario``'s is refused (``allow_mismatch``: warned about on stderr). With
    ``flat``, the table with that fraction of the ITL target in every cell."""
    from policies.table import BudgetTable, TableError, hardware_provenance, model_provenance
    from policies.table_policy import TablePolicy

    try:
        table = BudgetTable.load(path)
        if flat is not None:
            table = table.flattened(flat)
    except TableError as err:
        raise ConfigError(f"table: {err}") from None
    name = name or (f"table:{path}" if flat is None else f"table-flat:{flat:g}:{path}")
    if scenario is not None:
        hardware = hardware_provenance(scenario.hardware_profile())
        model = model_provenance(scenario.model_profile())
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
            # own stored cost model, as a serving engine's would, plus the scenario's cost
            # per pass beyond the one it was priced with (an engine's CHUNKPILOT_STEP_OVERHEAD_S).
            priced = table.provenance["hardware"].get("per_pass_overhead_s") or 0.0
            extra = max(scenario.hardware_profile().per_pass_overhead_s - priced, 0.0)
            return TablePolicy(table.with_step_overhead(extra), name=name, stored_cost=True)
    return TablePolicy(table, name=name)


_DECIMAL = re.compile(r"[0-9]*\.?[0-9]+")


def _split_flat(rest: str) -> tuple[str | None, str]:
    """(FRACTION as written or None, PATH) of ``table-flat[:FRACTION]:PATH``, unchecked: a
    first part that is a decimal number (or empty) is the fraction, so a path whose first
    part is one takes the fraction in front (``table-flat:1:2:t.json``)."""
    head, colon, tail = rest.partition(":")
    if colon and (not head or _DECIMAL.fullmatch(head)):
        return head, tail
    return None, rest


def _flat_fraction(spec: str, rest: str) -> tuple[float, str]:
    """(FRACTION, PATH) of ``table-flat[:FRACTION]:PATH``, checked (1 without one)."""
    head, path = _split_flat(rest)
    if head == "":
        raise ConfigError(f"policy: got {show(spec)}, an empty FRACTION; fill it in or drop it "
                          "(table-flat[:FRACTION]:PATH)")
    if not path:
        raise ConfigError(f"policy: got {show(spec)}, no PATH; table-flat[:FRACTION]:PATH "
                          "(or auto)")
    if head is None:
        return 1.0, path
    from policies.table import MAX_FRACTION

    return _one_number(spec, [head], 1.0, 0.0, MAX_FRACTION, "FRACTION of the ITL target"), path


def flat_twin(name: str) -> str | None:
    """The ``table:`` spec a ``table-flat:`` spec flattens: the same PATH (``auto`` with
    ``auto``); None for any other spec. Nothing is checked here."""
    kind, _, rest = name.partition(":")
    return f"table:{_split_flat(rest)[1]}" if kind == "table-flat" and rest else None


TABLES = Path(__file__).resolve().parent.parent / "tables"


def shipped_table(scenario: Scenario, spec: str = "table:auto") -> Path:
    """The table shipped for a scenario's hardware and model (``spec``: what asked for it,
    as the error names it)."""
    path = TABLES / f"{Path(scenario.hardware).stem}__{Path(scenario.model).stem}.json"
    if not path.exists():
        shipped = sorted(p.stem for p in TABLES.glob("*.json"))
        raise ConfigError(f"policy: {spec} has no table for {scenario.hardware} + {scenario.model} "
                          f"(tables/: {', '.join(shipped) or 'none'})")
    return path


DEFAULTED = ("vllm-default", "queue-depth", "no-decode-boost", "free-ride", "time-budget",
             "time-budget-kv", "time-budget-few", "time-budget-slack", "time-budget-slack-kv",
             "time-budget-deadline", "time-budget-deadline-kv")
"""Specs whose arguments are all optional."""


def make_policy(spec: str, scenario: Scenario, allow_table_mismatch: bool = False) -> BudgetPolicy:
    """Build the policy a spec names, for a scenario (some rules read its profiles)."""
    from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                    SarathiSLOPolicy, StaticPolicy, TimeBudgetFewPolicy,
                                    TimeBudgetDeadlinePolicy, TimeBudgetKVPolicy, TimeBudgetPolicy,
                                    TimeBudgetSlackPolicy, VllmDefaultPolicy)

    spec = spec.strip()
    kind, colon, rest = spec.partition(":")
    # model:, table: and table-flat: take one path, which may hold ':' itself; the others,
    # numbers.
    if colon and kind and kind not in ("model", "table", "table-flat") and not all(rest.split(":")):
        hint = (f"fill it in or drop it ({kind} without arguments takes its defaults)"
                if kind in DEFAULTED else "fill it in or drop it")
        raise ConfigError(f"policy: got {show(spec)}, an empty argument after ':'; {hint}")
    args = rest.split(":") if rest else []
    if kind == "static":
        (n,) = _ints(spec, args, (1,))
        check_static_budget(n, scenario.engine_config())
        return StaticPolicy(n)
    if kind == "vllm-default":
        entry = args[0] if args else "server"
        if entry not in ("server", "offline"):
            raise ConfigError(f"policy: got {spec!r}, vllm-default takes :server or :offline")
        return VllmDefaultPolicy(scenario.hardware_profile(), entry)
    if kind == "queue-depth":
        return QueueDepthPolicy(*_ints(spec, args, (0, 1)))
    if kind == "no-decode-boost":
        return NoDecodeBoostPolicy(*_ints(spec, args, (0, 2)))
    if kind == "sarathi-slo" and not args:
        return SarathiSLOPolicy.fit(scenario)
    if kind == "free-ride":
        floor, cap = _ints(spec, args, (0, 2)) or (256, 16384)
        if floor > cap:
            raise ConfigError(f"policy: got {spec!r}, FLOOR must be <= CAP")
        return FreeRidePolicy(floor, cap)
    if kind == "time-budget":
        return TimeBudgetPolicy(scenario.slo_itl_s, _fraction(spec, args))
    if kind == "time-budget-kv":
        return TimeBudgetKVPolicy(scenario.slo_itl_s, _fraction(spec, args))
    if kind == "time-budget-few":
        return TimeBudgetFewPolicy(scenario.slo_itl_s, _fraction(spec, args))
    if kind in ("time-budget-slack", "time-budget-slack-kv"):
        return TimeBudgetSlackPolicy(scenario.slo_itl_s, _top(spec, args),
                                     kv_aware=kind.endswith("-kv"))
    if kind in ("time-budget-deadline", "time-budget-deadline-kv"):
        return TimeBudgetDeadlinePolicy(scenario.slo_itl_s, scenario.slo_ttft_s, _top(spec, args),
                                        kv_aware=kind.endswith("-kv"))
    if kind == "reference" and args:
        from policies.reference import reference_for

        base = _ints(spec, args[:1], (1,))[0]
        check_static_budget(base, scenario.engine_config())
        times = _floats(spec, args[1:], (0, 1, 2))
        return reference_for(scenario, base, *times)
    if kind == "model" and rest:
        from agents.runs import load_run  # training's packages, only when a model is named

        return load_run(rest, scenario.slo(), name=spec)
    if kind in ("table", "table-flat") and rest:
        fraction, path = _flat_fraction(spec, rest) if kind == "table-flat" else (None, rest)
        path = str(shipped_table(scenario, spec)) if path == "auto" else path
        return load_table_policy(path, scenario, name=spec, allow_mismatch=allow_table_mismatch,
                                 flat=fraction)
    raise ConfigError(f"policy: unknown spec {show(spec)}; known: {', '.join(KNOWN)}")


def make_policies(specs: str, scenario: Scenario,
                  allow_table_mismatch: bool = False) -> list[BudgetPolicy]:
    """Comma-separated specs; names must be distinct."""
    policies = []
    for spec in (s.strip() for s in specs.split(",")):
        if not spec:
            continue
        try:
            policies.append(make_policy(spec, scenario, allow_table_mismatch))
        except ConfigError as err:  # name the spec whatever part of it was refused
            text = str(err)
            raise ConfigError(text if text.startswith("policy") else f"policy {show(spec)}: {text}") from None
    if not policies:
        raise ConfigError(f"policies: got {show(specs)}, name at least one; known: {', '.join(KNOWN)}")
    names = [p.name for p in policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"policies: {', '.join(dup)} named twice")
    return policies
