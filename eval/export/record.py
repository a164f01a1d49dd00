"""Stage 1, record: the decisions a table is built from.

In: a model policy (``policies.learned.ModelPolicy`` of a train.py run) and episodes (a
scenario and its arrivals each); optionally a driver (a table) whose budgets are applied
while the model labels the states it leads to. Out: per decision, every quantity
an engine reads (``envs.state.TABLE_INPUTS``, by name, and the model's token budget as
``"budget"``) and the model's action value (a fraction of the ITL target, or a token
budget). The episodes: the run's training conditions at the table's SLO, and streams of
the serving scenario and its variants around their own load.

A run across deployments (``train.py --all-deployments``) exports a table that carries
(``eval.export.carry``): its decisions come from the conditions of every deployment it trained
on, at their own SLO pairs and loads, each also recording the deployment's features
(``policies.table.DEPLOYMENT_AXES``) and the features derived with that deployment's own
cost model, in the table's SLO frame, as the table re-priced for it looks them up; a table
drives, and is judged on, each deployment re-priced for it.
"""

from __future__ import annotations

import numpy as np

from envs.episodes import draw_episodes
from envs.scenario import Scenario
from envs.seeds import TABLE_BUILD_SEEDS, TABLE_FIDELITY_SEEDS
from eval.export.args import ExportArgs
from eval.export.carry import carries, deployment_key, table_policy
from eval.export.cells import time_action
from eval.export.features import feature_values
from eval.harness import run_policy
from eval.scenarios import final_scenarios
from policies.learned import run_sampler
from policies.table import DEPLOYMENT_AXES, DERIVED, SECONDS_FEATURES, STATE, BudgetTable
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


def collect(policy, episodes, driver: BudgetTable | None = None,
            frame: dict | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(every engine-readable quantity by name, with the model's token budget as
    ``"budget"``; the model's action value) of every decision, the model driving or, with
    ``driver`` (a table), the table. With ``frame`` (the SLO pair a table that carries is
    made at, ``{"ttft_s", "itl_s"}``: a run across deployments), each decision also holds
    its deployment's features and the derived features priced with its own episode's cost
    model, every feature in seconds in the frame's targets (:func:`deployment_columns`), and
    the driver is re-priced for each episode's deployment."""
    names = list(STATE)
    parts, values, budgets = [], [], []
    for sc, w in episodes:
        rec = Recorder(policy_for(policy, sc), names,
                       None if driver is None else table_policy(driver, sc, frame is not None))
        run_policy(sc, rec, [w])
        arr = np.asarray(rec.rows, dtype=np.float64).reshape(-1, len(names))
        part = {n: arr[:, j] for j, n in enumerate(names)}
        if frame is not None:
            part.update(deployment_columns(part, sc, frame))
        parts.append(part)
        values += rec.values
        budgets += rec.budgets
    keys = list(parts[0]) if parts else names
    state = {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0) for n in keys}
    state["budget"] = np.asarray(budgets, dtype=np.float64)
    return state, np.asarray(values, dtype=np.float64)


def deployment_columns(state: dict[str, np.ndarray], scenario: Scenario,
                       frame: dict) -> dict[str, np.ndarray]:
    """One episode's decisions as a table that carries, made at the SLO pair ``frame``,
    looks them up once re-priced for ``scenario``'s deployment: its deployment's features
    (constant over the episode), the derived features (``policies.table.DERIVED``) priced
    with its own cost model, ITL target and cap, and every feature in seconds
    (``SECONDS_FEATURES``) in the frame's targets (re-pricing scales a table's edges by the
    served target over the frame's; this scales the values by the inverse)."""
    n = len(state["running_decodes"])
    served = scenario.deployment()
    out = {name: np.full(n, float(getattr(served, name))) for name in DEPLOYMENT_AXES}
    action = time_action(scenario)
    for name in DERIVED:
        out[name] = feature_values(name, state, action) if n else np.zeros(0)
    own = {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s}
    for name, target in SECONDS_FEATURES.items():
        if name in out or name in state:
            out[name] = (out[name] if name in out else state[name]) * (frame[target] / own[target])
    return out


def policy_for(policy, scenario: Scenario):
    """The model policy asked to serve ``scenario``'s SLO (the seam tests replace)."""
    return policy.at(scenario)


def export_episodes(model, serving: Scenario, args: ExportArgs):
    """(build episodes, held-out episodes) of the run's training conditions at the table's
    SLO; for a table that carries, at each condition's own SLO (the table is re-priced for
    it, :func:`deployment_columns`), where the run's loads are those it trained at."""
    config = model.config
    conditions = config.get("conditions", [])
    carry = carries(model)
    if config["args"].get("all_deployments") and not carry:
        # A run across deployments acting in tokens: the table is for the serving
        # deployment, built from that deployment's conditions alone.
        conditions = [c for c in conditions if same_deployment(c, serving)]
    sampler = run_sampler(config["args"], conditions, TABLE_BUILD_SEEDS)
    slo = dict(max_pass_itl=serving.max_pass_itl) if carry else dict(
        slo_ttft_s=serving.slo_ttft_s, slo_itl_s=serving.slo_itl_s, max_pass_itl=serving.max_pass_itl)

    def at_slo(eps):
        return [(sc.with_fields(**slo), w) for sc, w in eps]

    return (at_slo(draw_episodes(serving, sampler, args.build_episodes, TABLE_BUILD_SEEDS))
            + serving_episodes(serving, TABLE_BUILD_SEEDS),
            at_slo(draw_episodes(serving, sampler, args.held_episodes, TABLE_FIDELITY_SEEDS)))


def same_deployment(condition: dict, serving: Scenario) -> bool:
    """Whether a training condition is ``serving``'s hardware preset (any variant of it) and
    model."""
    return deployment_key(condition, serving) == deployment_key({}, serving)


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
