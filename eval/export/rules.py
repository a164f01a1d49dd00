"""A rule as a table: the exact table of a time-budget rule (its class says whether one
holds it: ``exact``, ``exact_table``), checked against the rule at every pass of a stream.

In: a rule's spec and a scenario (its hardware, model and SLO; a stream to check on).
Out: the table, whose fidelity records the passes checked and how many differ (none,
unless the runtime and the simulator part ways); and, for a run's export, the rules'
tables that compete with its rounds (``--rules``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from envs.deployment import feature_range
from envs.errors import ConfigError, require, show
from envs.scenario import Scenario
from envs.seeds import TABLE_FIDELITY_SEEDS
from eval.export.cells import default_budget, scenario_provenance, time_action
from policies.specs import BY_SPEC, POLICIES, make_policy
from policies.table import DEPLOYMENT_AXES, KIND, SCHEMA_VERSION, BudgetTable
from policies.table_policy import TablePolicy


RULES = tuple(cls.usage() for cls in POLICIES if cls.exact)
"""The rules a table holds exactly (``exact``): each is a time fraction chosen by thresholds
on quantities an engine has."""
CONTINUOUS = tuple(cls.spec for cls in POLICIES if cls.exact is False)
"""The rules that move their fraction continuously: no table holds them exactly."""


def rule_candidates(specs: str, serving: Scenario, action: dict | None) -> list[tuple[str, BudgetTable]]:
    """(spec, exact table) of each rule in ``specs`` for the serving scenario; none for a
    run acting in tokens."""
    names = rule_specs(specs)
    if action is None or not names:
        return []
    out = []
    for spec in names:
        out.append((spec, rule_table(spec, serving, serving.stream(
            0, 1, TABLE_FIDELITY_SEEDS, RULE_CHECK_REQUESTS), field="rules")))
    return out


def rule_specs(specs: str) -> list[str]:
    """The rule specs of ``--rules``: none for "none" (alone)."""
    if specs.strip() == "none":
        return []
    names = [s.strip() for s in specs.split(",")]
    require(all(names), "rules", specs, 'must be comma-separated rule specs, or "none"')
    return names


RULE_CHECK_REQUESTS = 600
"""Requests of the stream on which a rule's table is checked against the rule."""


class RuleCheck:
    """Drives the simulator with a rule; counts the passes where a table's budget differs,
    and the passes that looked a cell up (with decodes running), per cell."""

    def __init__(self, rule, table: BudgetTable):
        self.rule, self.table = rule, TablePolicy(table)
        self.name, self.budgets, self.differ = rule.name, [], 0
        self.cells = [0] * table.cells

    def reset(self) -> None:
        self.rule.reset()
        self.table.reset()

    def __call__(self, state) -> int:
        want = self.rule(state)
        self.differ += self.table(state) != want
        self.budgets.append(want)
        if state.running_decodes:
            self.cells[self.table.cell(state)] += 1
        return want


def not_a_table(spec: str, field: str) -> str:
    """The one-line refusal of a rule no table holds exactly."""
    return (f"{field}: got {show(spec)}, a table holds exactly only {', '.join(RULES)}"
            + (' (or "none" alone)' if field == "rules" else "")
            + f"; {', '.join(CONTINUOUS)} move their fraction continuously with KV usage or "
            "the decodes")


def parse_rule(spec: str, scenario: Scenario, field: str = "rule") -> tuple:
    """(the rule a spec names, its table's features, its fractions); refused in one line
    unless a table holds it exactly (its class says so: ``exact``)."""
    cls = BY_SPEC.get(spec.strip().partition(":")[0])
    if cls is None or not cls.exact:
        raise ConfigError(not_a_table(spec, field))
    try:
        rule = make_policy(spec, scenario)
    except ConfigError as err:
        raise ConfigError(f"{field}: " + str(err).removeprefix("policy: ")) from None
    cells = rule.exact_table()
    if cells is None:
        raise ConfigError(not_a_table(spec, field))
    features, fractions = cells
    if scenario.max_pass_itl is not None:  # the rule under the cap, cell for cell
        fractions = [min(f, scenario.max_pass_itl) for f in fractions]
    return rule, features, fractions


def rule_table(spec: str, scenario: Scenario, workload, field: str = "rule") -> BudgetTable:
    """A table that is the rule ``spec`` for ``scenario``'s hardware, model and SLO,
    checked against the rule pass by pass on ``workload`` (its fidelity records the
    passes, how many differ, which is none unless the runtime and the simulator part
    ways, and the passes that looked each cell up; ``visited`` marks the cells reached)."""
    rule, features, fractions = parse_rule(spec, scenario, field)
    data = {"schema_version": SCHEMA_VERSION, "kind": KIND, "action": time_action(scenario),
            "features": features, "fractions": fractions, "default_budget": 2048,
            "provenance": {**scenario_provenance(scenario), "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "rule": f"the {rule.name} rule (policies/baselines.py), cell for cell"
                                   + (f", no pass over {scenario.max_pass_itl:g} times the ITL "
                                      "target while anyone decodes"
                                      if scenario.max_pass_itl is not None else ""),
                           "rule_spec": rule.name,
                           # A rule's cells do not depend on the deployment: the table carries
                           # to any, re-priced for it (BudgetTable.repriced).
                           "deployments": {"range": {}, "kv_tokens": scenario.kv_tokens()}}}
    check = RuleCheck(rule, BudgetTable(data))
    scenario.simulator(workload).run(check)
    data["default_budget"] = default_budget(np.asarray(check.budgets))
    data["visited"] = [int(c > 0) for c in check.cells]
    require(not check.differ, field, spec, f"its table differs from the rule at {check.differ} of "
            f"{len(check.budgets)} passes; nothing written")
    data["fidelity"] = {"rule_check": {"passes": len(check.budgets), "differ": int(check.differ),
                                       "requests": len(workload), "passes_per_cell": check.cells}}
    return BudgetTable(data)


def by_deployment(rules: list[str], feature: str, edges: list[float], scenario: Scenario,
                  workload, fitted: list[Scenario]) -> BudgetTable:
    """One table holding several members of a rule family, the deployment picking which:
    member ``i`` where the deployment's ``feature`` (``envs.deployment``) lies in bucket
    ``i`` of ``edges``. Each member's table is checked against its rule on ``workload``
    (:func:`rule_table`); they must read the same features with the same edges. The table
    carries, re-priced for each deployment it serves, within the range of ``feature`` over
    ``fitted`` (the deployments the members were picked on; a value that is not finite, such
    as the KV cache's targets' worth where no prefill fits the ITL target, is left out)."""
    require(feature in DEPLOYMENT_AXES, "by", feature,
            f"must be a deployment feature: {', '.join(DEPLOYMENT_AXES)}")
    require(len(rules) == len(edges) + 1, "rule", ",".join(rules),
            f"must name {len(edges) + 1} rules, one per bucket of {feature} ({len(edges)} edges)")
    tables = [rule_table(r, scenario, workload) for r in rules]
    first = tables[0]
    for r, t in zip(rules, tables):
        require(t.features == first.features and t.edges == first.edges, "rule", r,
                f"reads other features or edges than {rules[0]}; one family's members only")
    data = first.to_dict()
    data["features"].append({"name": feature, "edges": [float(e) for e in edges]})
    data["fractions"] = [t.action.cells[i] for i in range(first.cells) for t in tables]
    data["visited"] = [int(t.visited[i]) for i in range(first.cells) for t in tables]
    served = getattr(scenario.deployment(), feature)
    lo, hi = feature_range(sc.deployment() for sc in fitted).get(feature, (math.nan, math.nan))
    require(lo <= served <= hi, "by", feature,
            f"the scenario's {feature} ({served:.4g}) must lie within its range over the "
            f"deployments the members were picked on ({lo:.4g} to {hi:.4g}): the table would "
            "refuse the deployment it is made for")
    where = " then ".join(f"{r} from {e:g}" if i else r for i, (r, e) in
                          enumerate(zip(rules, [None] + list(edges))))
    data["provenance"] = {
        **first.provenance, "rule_spec": None, "rule_specs": list(rules),
        "rule": f"the rules {where} of the deployment's {feature} (policies/baselines.py), "
                f"cell for cell; here {feature} is {served:.4g}",
        "deployments": {"range": {feature: [lo, hi]},
                        "kv_tokens": scenario.kv_tokens(),
                        "fitted": [f"{sc.hardware} + {sc.model}" for sc in fitted]}}
    checks = [t.fidelity["rule_check"] for t in tables]
    data["fidelity"] = {"rule_check": {  # each member against its rule on the same stream
        "passes": sum(c["passes"] for c in checks), "differ": sum(c["differ"] for c in checks),
        "requests": len(workload), "members": dict(zip(rules, checks))}}
    return BudgetTable(data)
