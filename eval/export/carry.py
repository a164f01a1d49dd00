"""Tables that carry, as the export makes them: which runs export one, the identity of a
deployment among a run's conditions, where such a table is chosen and checked, the range
of deployments its provenance records, and the table as it serves each scenario
(re-priced for it).

A run across deployments acting in time (``train.py --all-deployments``) exports a table
that carries to other deployments; every other run, a table for its serving deployment.
Told a deployment (``--hardware``, ``--model``), a run across deployments exports that
deployment's own table instead (:func:`on_deployment`).
"""

from __future__ import annotations

from envs.deployment import feature_range
from envs.scenario import Scenario
from eval.scenarios import final_scenarios
from policies.table import DEPLOYMENT_AXES, BudgetTable
from policies.table_policy import TablePolicy, for_scenario


def carries(model) -> bool:
    """Whether a run's table carries to other deployments: a run across deployments acting
    in time (its fractions are re-priced for each deployment served)."""
    args = (getattr(model, "config", None) or {}).get("args") or {}
    return bool(args.get("all_deployments")) and getattr(model, "actions", None) == "time"


def deployment_key(condition: dict, serving: Scenario) -> tuple[str, str]:
    """(hardware preset, model) of a run's condition, its variants (``PRESET@field=value``)
    one deployment; the serving scenario's for a field the condition leaves out."""
    return (str(condition.get("hardware", serving.hardware)).partition("@")[0],
            str(condition.get("model", serving.model)))


def judged_scenarios(model, serving: Scenario) -> dict[str, Scenario]:
    """Where the export chooses its table and checks it: the serving scenario and its
    variants (``eval.scenarios.final_scenarios``); for a table that carries, the serving
    scenario and, for each other deployment the run trained on, its first training
    condition (its own SLO pair, the table's cap on the pass), loaded at the capacity
    measured for it in training."""
    if not carries(model):
        return final_scenarios(serving)
    out = {"serving": serving}
    seen = {deployment_key({}, serving)}
    for c in model.config.get("conditions", []):
        key = deployment_key(c, serving)
        if key in seen or not c.get("capacity_rps"):
            continue
        seen.add(key)
        fields = {k: v for k, v in c.items() if k != "capacity_rps"}
        out[" + ".join(key)] = serving.with_fields(**{**fields, "rate": c["capacity_rps"],
                                                      "max_pass_itl": serving.max_pass_itl})
    return out


def trained_range(model, serving: Scenario, built: list[Scenario]) -> dict:
    """The provenance ``deployments`` block of a run's table that carries: the range of each
    deployment feature a table may bucket over the deployments its decisions came from
    (``built``: the build episodes' scenarios, each at its SLO), the serving deployment's
    KV cache, and the deployments the run trained on. A deployment outside the range is
    refused where the table is loaded (unless allowed): no cell was made from a deployment
    like it, whether or not the table buckets the feature it lies outside on."""
    rng = feature_range(sc.deployment() for sc in built)
    block = model.config.get("deployments") or {}
    return {"range": {n: rng[n] for n in DEPLOYMENT_AXES if n in rng},
            "kv_tokens": serving.kv_tokens(),
            "trained": [f"{h} + {m}" for h, m in block.get("trained", [])]}


def table_policy(table: BudgetTable, scenario: Scenario, carry: bool, name: str = "table") -> TablePolicy:
    """The table as it serves ``scenario``: re-priced for its deployment where it carries
    (``carry``; a deployment outside its range is served all the same: the export judges
    the deployments it trained on), as it is otherwise."""
    if carry and table.deployment_range is not None:
        return TablePolicy(for_scenario(table, scenario, allow_mismatch=True, quiet=True), name=name)
    return TablePolicy(table, name=name)


def on_deployment(model, serving: Scenario, capacity_rps: float):
    """The model of a run across deployments as the model of a run on ``serving``'s
    deployment alone, whose one condition is the serving workload there at the model's
    capacity (``capacity_rps``): its export is then that deployment's table, built from the
    model's decisions there (the run need not have trained on it: the model reads the
    deployment's features)."""
    out = model.at(serving)
    out.config = {**model.config, "args": {**model.config["args"], "all_deployments": False},
                  "conditions": [{"capacity_rps": float(capacity_rps)}],
                  "exported_for": f"{serving.hardware} + {serving.model}"}
    return out
