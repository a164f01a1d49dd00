"""Stage 4, DAgger: a table per round of dataset aggregation (Ross et al. 2011).

In: the model, the build and held-out episodes and their decisions (stage 1), the
features to use (or none: stage 2 picks them), the table's action and provenance. Out:
rounds, each a table with its features and the decisions it was built from: round 0
from the model's own decisions, each next one also from the states the previous table
leads to, labelled by the model.
"""

from __future__ import annotations

from typing import NamedTuple

from eval.export.args import ExportArgs
from eval.export.cells import build_table
from eval.export.features import feature_edges, features_of, pick_features
from eval.export.carry import carries
from eval.export.record import collect, join_decisions
from policies.table import BudgetTable


def round_labels(rounds: int) -> list[str]:
    """The names of a DAgger export's tables: round 0 (the model's own decisions) and one
    per round."""
    return [f"round {r}" for r in range(rounds + 1)]


class Round(NamedTuple):
    table: BudgetTable
    features: list[str]
    build: tuple
    """(state quantities, the model's action values) of the decisions the table was built from."""
    held: tuple
    """The same, of the held-out decisions its features were picked on."""


def dagger_rounds(model, episodes: tuple, decisions: tuple, names: list[str] | None,
                  args: ExportArgs, prov: dict, action: dict | None,
                  fixed: dict[str, list[float]] | None = None) -> list[Round]:
    """The table built from the model's decisions, then one per round of dataset
    aggregation (DAgger, Ross et al. 2011), ``args.dagger_rounds`` of them: the last
    table drives the same build and held-out episodes, the model labels every state it
    leads to, the features are picked again (unless named) and the table rebuilt on all
    the decisions so far. A table copies its model only where the model went; in closed
    loop a few cells off lead the engine, past capacity above all, into states the model
    never visits and the table never saw (docs/learning.md has a table built from its
    model's decisions alone that kept the capacity and lost goodput past it)."""

    build, held = decisions
    frame = prov["slo"] if carries(model) else None
    out: list[Round] = []
    for r in range(args.dagger_rounds + 1):
        if r:
            driver = out[-1].table
            build = join_decisions(build, collect(model, episodes[0], driver, frame))
            held = join_decisions(held, collect(model, episodes[1], driver, frame))
        features = names or pick_features(build, held, args.buckets, args.max_features, prov, action)[0]
        feats = features_of(features, build[0], action)
        edges = [(fixed or {}).get(n) or feature_edges(feats[n], build[1], args.buckets)
                 for n in features]
        table = build_table(feats, build[1], args.buckets, prov, action,
                            budgets=build[0]["budget"], edges=edges)
        out.append(Round(table, features, build, held))
    return out
