"""Stage 1, record: the decisions a table is built from.

In: a model policy (``policies.learned.ModelPolicy`` of a train.py run) and episodes (a
scenario and its arrivals each); optionally a driver (a table policy) whose budgets are
applied while the model labels the states it leads to. Out: per decision, every quantity
an engine reads (``envs.state.TABLE_INPUTS``, by name, and the model's token budget as
``"budget"``) and the model's action value (a fraction of the ITL target, or a token
budget). The episodes: the run's training conditions at the table's SLO, and streams of
the serving scenario and its variants around their own load.
"""

from __future__ import annotations

import numpy as np

from envs.episodes import draw_episodes
from envs.scenario import Scenario
from envs.seeds import TABLE_BUILD_SEEDS, TABLE_FIDELITY_SEEDS
from eval.export.args import ExportArgs
from eval.harness import run_policy
from eval.scenarios import final_scenarios
from policies.learned import run_sampler
from policies.table import STATE
from policies.table_policy import read_inputs


class Recorder:
    """Wraps a model policy; records every decision's state quantities and action value.
    With a ``driver`` (a table policy), the driver's budget is applied and the model only
    labels the states the driver leads to."""

    def __init__(self, policy, names, driver=None):
        self.policy, self.name, self.kind = policy, policy.name, policy.kind
        self.driver = driver
        self.names = list(names)
        self.rows: list[list[float]] = []
        self.values: list[float] = []
        self.budgets: list[int] = []

    def reset(self) -> None:
        self.policy.reset()

    def __call__(self, state) -> int:
        v = self.policy.action_value(state)
        itl = self.policy.slo.itl_s
        values = read_inputs(state, self.names, itl)
        self.rows.append([values[n] for n in self.names])
        self.values.append(v)
        b = max(self.policy.budget_for_value(state, v), state.running_decodes, 1)
        self.budgets.append(b)
        return b if self.driver is None else self.driver(state)


def collect(policy, episodes, driver=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(every engine-readable quantity by name, with the model's token budget as
    ``"budget"``; the model's action value) of every decision, the model driving or, with
    ``driver``, the driver."""
    names = list(STATE)
    rows, values, budgets = [], [], []
    for sc, w in episodes:
        rec = Recorder(policy_for(policy, sc), names, driver)
        run_policy(sc, rec, [w])
        rows += rec.rows
        values += rec.values
        budgets += rec.budgets
    arr = np.asarray(rows, dtype=np.float64).reshape(-1, len(names))
    state = {n: arr[:, j] for j, n in enumerate(names)}
    state["budget"] = np.asarray(budgets, dtype=np.float64)
    return state, np.asarray(values, dtype=np.float64)


def policy_for(policy, scenario: Scenario):
    """The model policy asked to serve ``scenario``'s SLO (the seam tests replace)."""
    return policy.at(scenario)


def export_episodes(model, serving: Scenario, args: ExportArgs):
    """(build episodes, held-out episodes) of the run's training conditions at the table's SLO."""
    config = model.config
    conditions = config.get("conditions", [])
    if config["args"].get("all_deployments"):
        # A run across deployments: the table is for the serving deployment (its cost model
        # turns the fractions into tokens), built from that deployment's conditions alone.
        conditions = [c for c in conditions if same_deployment(c, serving)]
    sampler = run_sampler(config["args"], conditions, TABLE_BUILD_SEEDS)
    slo = dict(slo_ttft_s=serving.slo_ttft_s, slo_itl_s=serving.slo_itl_s,
               max_pass_itl=serving.max_pass_itl)

    def at_slo(eps):
        return [(sc.with_fields(**slo), w) for sc, w in eps]

    return (at_slo(draw_episodes(serving, sampler, args.build_episodes, TABLE_BUILD_SEEDS))
            + serving_episodes(serving, TABLE_BUILD_SEEDS),
            at_slo(draw_episodes(serving, sampler, args.held_episodes, TABLE_FIDELITY_SEEDS)))


def same_deployment(condition: dict, serving: Scenario) -> bool:
    """Whether a training condition is ``serving``'s hardware preset (any variant of it) and
    model."""
    return (condition.get("hardware", serving.hardware).partition("@")[0]
            == str(serving.hardware).partition("@")[0]
            and condition.get("model", serving.model) == serving.model)


def serving_episodes(serving: Scenario, seed_base: int, loads=(0.8, 1.0, 1.2, 1.4)):
    """Streams of the serving scenario and its variants (eval.scenarios.final_scenarios) at
    loads around its own: the states the table is meant to serve, on arrivals of their own
    seeds (the fidelity check replays others)."""
    out = []
    for k, sc in enumerate(final_scenarios(serving).values()):
        for i, f in enumerate(loads):
            at = sc.at_load(f)
            out.append((at, at.stream(0, 1, seed_base + 100 * k + i)))
    return out


def join_decisions(a: tuple, b: tuple) -> tuple:
    """Two ``collect`` results as one."""
    return {k: np.concatenate([a[0][k], b[0][k]]) for k in a[0]}, np.concatenate([a[1], b[1]])
