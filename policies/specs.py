"""Policy specs, as the command lines name them: ``static:2048``, ``table:PATH``, ...

Every policy class declares its spec (``policies.base.BudgetPolicy``: its first part, its
parameters, a line saying what it does); :data:`POLICIES` lists them, and
:func:`make_policy` hands a spec to the class it names. ``python -m eval --help`` prints
:func:`listing`. The diagnostics, not policies to serve, come last: a table's flat twin and
the reference controller, which sees the future.
"""

from __future__ import annotations

import textwrap

from envs.errors import ConfigError, did_you_mean, show
from envs.scenario import Scenario
from policies.base import BudgetPolicy
from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                SarathiSLOPolicy, StaticPolicy, TimeBudgetDeadlineKVPolicy,
                                TimeBudgetDeadlinePolicy, TimeBudgetFewPolicy, TimeBudgetKVPolicy,
                                TimeBudgetP99Policy, TimeBudgetPolicy, TimeBudgetSlackKVPolicy,
                                TimeBudgetSlackPolicy, VllmDefaultPolicy)
from policies.learned import ModelPolicy
from policies.reference import ReferencePolicy, RolloutPolicy, SampledRolloutPolicy
from policies.table_policy import FlatTablePolicy, TablePolicy

POLICIES: tuple[type[BudgetPolicy], ...] = (
    StaticPolicy, VllmDefaultPolicy, QueueDepthPolicy, NoDecodeBoostPolicy, SarathiSLOPolicy,
    FreeRidePolicy, TimeBudgetPolicy, TimeBudgetKVPolicy, TimeBudgetFewPolicy, TimeBudgetSlackPolicy,
    TimeBudgetSlackKVPolicy, TimeBudgetP99Policy, TimeBudgetDeadlinePolicy,
    TimeBudgetDeadlineKVPolicy, ModelPolicy, TablePolicy, FlatTablePolicy, ReferencePolicy,
    RolloutPolicy, SampledRolloutPolicy)
"""Every spec's class, in the order the listing shows them (diagnostics last)."""
BY_SPEC = {cls.spec: cls for cls in POLICIES}
KNOWN = tuple(cls.usage() for cls in POLICIES)
PATH_SPECS = frozenset(cls.spec for cls in (ModelPolicy, TablePolicy, FlatTablePolicy))
"""Specs that take one path, which may hold ':' itself."""


def listing(width: int = 34) -> str:
    """Every spec and what it does, a line each; the diagnostics under their own heading."""
    lines = []
    for diagnostic in (False, True):
        if diagnostic:
            lines.append("diagnostics, not policies to serve:")
        for cls in POLICIES:
            if cls.diagnostic == diagnostic:
                head = f"  {cls.usage():<{width}} "
                lines.append(textwrap.fill(cls.summary, 100, initial_indent=head,
                                           subsequent_indent=" " * (width + 3)))
    return "\n".join(lines)


def unknown(spec: str, kind: str) -> ConfigError:
    """The one-line refusal of an unknown spec, with the nearest known one."""
    return ConfigError(f"policy: unknown spec {show(spec)}; {did_you_mean(kind, BY_SPEC)}"
                       f"known: {', '.join(KNOWN)}")


def make_policy(spec: str, scenario: Scenario, allow_table_mismatch: bool = False) -> BudgetPolicy:
    """The policy a spec names, for a scenario (some rules read its profiles and SLO)."""
    spec = spec.strip()
    kind, colon, rest = spec.partition(":")
    cls = BY_SPEC.get(kind)
    if cls is None:
        raise unknown(spec, kind)
    args = rest.split(":") if colon else []
    if colon and kind not in PATH_SPECS and not all(args):
        hint = (f"fill it in or drop it ({kind} without arguments takes its defaults)"
                if all(p.default is not None for p in cls.params) and cls.params
                else "fill it in or drop it")
        raise ConfigError(f"policy: got {show(spec)}, an empty argument after ':'; {hint}")
    policy = cls.from_spec(spec, args, scenario, {"allow_table_mismatch": allow_table_mismatch,
                                                  "make_policy": make_policy})
    return policy.limit_pass(scenario)


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
