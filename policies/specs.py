"""Policy specs, as the command lines name them: ``static:2048``, ``table:PATH``, ...

================================  ==========================================================
``static:N``                      the same budget every pass
``vllm-default[:offline]``        vLLM's default for the hardware (server entry point unless
                                  ``:offline``)
``queue-depth[:BASE]``            the queue-depth heuristic (base chunk 512)
``no-decode-boost[:LOW:HIGH]``    HIGH with nothing decoding, else LOW (2048:16384)
``sarathi-slo``                   Sarathi-Serve's static budget for the ITL target
``free-ride[:FLOOR:CAP]``         running decodes + this pass's free ride (256:16384)
``time-budget[:FRACTION]``        each pass, the largest budget priced within FRACTION of the
                                  ITL target (0.9; FRACTION in (0, 2])
``time-budget-kv[:FRACTION]``     the same, its chunk shrinking as the KV cache fills
``reference:BUDGET[:H[:R]]``      the MPC reference over static BUDGET (not deployable: sees
                                  the future), horizon H s (2x TTFT), re-plan every R s
``model:RUN_DIR``                 a model trained by train.py
``table:PATH``                    an exported lookup table
================================  ==========================================================
"""

from __future__ import annotations

import math
import sys

from envs.engine import check_static_budget
from envs.errors import MAX_TOKENS, ConfigError, show
from envs.scenario import Scenario
from policies.base import BudgetPolicy

KNOWN = ("static:N", "vllm-default[:offline]", "queue-depth[:BASE]", "no-decode-boost[:LOW:HIGH]",
         "sarathi-slo", "free-ride[:FLOOR:CAP]", "time-budget[:FRACTION]",
         "time-budget-kv[:FRACTION]", "reference:BUDGET[:HORIZON_S[:REPLAN_S]]", "model:RUN_DIR",
         "table:PATH")


def _ints(spec: str, args: list[str], count: tuple[int, ...]) -> list[int]:
    if len(args) not in count:
        raise ConfigError(f"policy: got {spec!r}, wrong number of arguments; known specs: "
                          f"{', '.join(KNOWN)}")
    try:
        vals = [int(a) for a in args]
    except ValueError:
        raise ConfigError(f"policy: got {show(spec)}, arguments must be integers") from None
    if any(not 0 < v <= MAX_TOKENS for v in vals):
        raise ConfigError(f"policy: got {show(spec)}, arguments must be > 0 and <= {MAX_TOKENS}")
    return vals


def _floats(spec: str, args: list[str], count: tuple[int, ...]) -> list[float]:
    if len(args) not in count:
        raise ConfigError(f"policy: got {spec!r}, wrong number of arguments; known specs: "
                          f"{', '.join(KNOWN)}")
    try:
        vals = [float(a) for a in args]
    except ValueError:
        raise ConfigError(f"policy: got {spec!r}, arguments must be numbers") from None
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise ConfigError(f"policy: got {spec!r}, arguments must be finite and > 0")
    return vals


def _fraction(spec: str, args: list[str]) -> float:
    if len(args) > 1:
        raise ConfigError(f"policy: got {spec!r}, takes one FRACTION of the ITL target")
    try:
        f = float(args[0]) if args else 0.9
    except ValueError:
        f = math.nan
    if not 0 < f <= 2:
        raise ConfigError(f"policy: got {spec!r}, FRACTION of the ITL target must lie in (0, 2]")
    return f


def load_table_policy(path: str, scenario: Scenario | None = None, name: str | None = None,
                      allow_mismatch: bool = False):
    """A table as a policy. A table built for other hardware, another model shape or another
    SLO than ``scenario``'s is refused (``allow_mismatch``: warned about on stderr)."""
    from policies.table import BudgetTable, TableError, hardware_provenance, model_provenance
    from policies.table_policy import TablePolicy

    try:
        table = BudgetTable.load(path)
    except TableError as err:
        raise ConfigError(f"table: {err}") from None
    if scenario is not None:
        reason = table.mismatch(hardware_provenance(scenario.hardware_profile()),
                                model_provenance(scenario.model_profile()),
                                {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s})
        if reason and not allow_mismatch:
            raise ConfigError(f"table: {reason}; pass --allow-table-mismatch to evaluate it anyway")
        if reason:
            print(f"warning: {reason}", file=sys.stderr)
    return TablePolicy(table, name=name or f"table:{path}")


def make_policy(spec: str, scenario: Scenario, allow_table_mismatch: bool = False) -> BudgetPolicy:
    """Build the policy a spec names, for a scenario (some rules read its profiles)."""
    from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                    SarathiSLOPolicy, StaticPolicy, TimeBudgetKVPolicy,
                                    TimeBudgetPolicy, VllmDefaultPolicy)

    spec = spec.strip()
    kind, _, rest = spec.partition(":")
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
    if kind == "reference" and args:
        from policies.reference import reference_for

        base = _ints(spec, args[:1], (1,))[0]
        check_static_budget(base, scenario.engine_config())
        times = _floats(spec, args[1:], (0, 1, 2))
        return reference_for(scenario, base, *times)
    if kind == "model" and rest:
        from agents.runs import load_run  # training's packages, only when a model is named

        return load_run(rest, scenario.slo(), name=spec)
    if kind == "table" and rest:
        return load_table_policy(rest, scenario, name=spec, allow_mismatch=allow_table_mismatch)
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
