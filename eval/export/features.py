"""Stage 2, features: which quantities a table buckets.

In: decisions (stage 1's) and, for a time-fraction table, its action (cost model, ITL
target, cap) to derive ``decode_pass_s``, ``itl_slack_passes`` and ``prefill_due_s``
exactly as the runtime does. Out: each feature's value per decision, and the features
picked greedily by the held-out log error between a table and the model (each tried
over its own edges: ``cells.feature_edges``); or those ``--features`` names.
"""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np

from envs.errors import require, show
from envs.pricing import Coefficients, decode_pass_s, prefill_due_s
from envs.scenario import Scenario
from envs.slack import slack_passes
from eval.export.cells import agreement, build_table, feature_edges, log_error
from eval.export.rules import RULES, parse_rule
from policies.specs import BY_SPEC
from policies.table import DEPLOYMENT_AXES, DERIVED, SLACK_COUNTS, STATE


CANDIDATES = tuple(n for n in STATE if n not in SLACK_COUNTS) + tuple(DERIVED)
"""Features a table may bucket (the slack counts enter only through ``itl_slack_passes``)."""
CARRIED = tuple(DEPLOYMENT_AXES)
"""Features a table that carries may also bucket: its deployment's, constant while it serves
(recorded only from a run across deployments, ``eval.export.record.carries``)."""
VARYING_ONLY = frozenset({"head_cached_tokens"})
"""Candidates only where the build set's values vary."""
MAX_BUCKETS = 32
"""Buckets per feature: 32 over four features is a million cells (a few MB of JSON)."""


def feature_values(name: str, state: dict, action: dict | None) -> np.ndarray:
    """One feature's value per decision; derived ones with the time-fraction ``action``'s
    coefficients, ITL target and cap (the runtime's own functions), unless the decisions
    hold them already (priced with each one's own deployment: a run across deployments)."""
    if name in state:
        return state[name]
    if name == "decode_pass_s":
        cost = Coefficients.of(action["cost"])
        return np.array([decode_pass_s(cost, int(n), int(c)) for n, c in
                         zip(state["running_decodes"], state["decode_context_tokens"])])
    if name == "itl_slack_passes":
        return np.array([slack_passes(s, t, int(n)) for s, t, n in zip(
            state["itl_slow_tokens"], state["itl_decode_tokens"], state["running_decodes"])])
    if name == "prefill_due_s":
        cost, itl, cap = Coefficients.of(action["cost"]), action["itl_s"], action["cap"]
        return np.array([prefill_due_s(cost, int(n), int(c), int(q), int(w), o, itl, cap)
                         for n, c, q, w, o in zip(
                             state["running_decodes"], state["decode_context_tokens"],
                             state["head_prefilled_tokens"], state["waiting_prefill_tokens"],
                             state["oldest_wait_s"])])
    return state[name]


def features_of(names: list[str], state: dict, action: dict | None) -> dict[str, np.ndarray]:
    """The named features' values per decision."""
    return {n: feature_values(n, state, action) for n in names}


MIN_GAIN = 0.005
"""A feature joins the table when it lowers the held-out log error by at least this (half a
percent of a budget on average); a pair of features, by twice this."""


def pick_features(build: tuple, held: tuple, buckets: int, max_features: int, provenance: dict,
                  action: dict | None) -> tuple[list[str], float]:
    """Greedy forward selection: add the feature that most lowers the held-out log error,
    while it lowers it by at least MIN_GAIN; when no one feature does, the pair that
    lowers it most by twice that, if one does; returns the features and the held-out
    agreement. The log error, not agreement, picks: a policy that spends the p99 slack on
    5% of passes with 16 times the target changes capacity by a tenth, and agreement
    barely sees it. The pair matters because a long pass can hang on two quantities
    together (the slack and how full the cache is), each useless alone (docs/learning.md
    has the runs where a single-feature pick lost capacity)."""
    (bstate, bvals), (hstate, hvals) = build, held
    candidates = [n for n in CANDIDATES if n in bstate or (
        n in DERIVED and action and all(k in bstate for k in DERIVED[n]))]
    candidates += [n for n in CARRIED if n in bstate]
    # The cache's share is a candidate where prefix caching served something: without it
    # the column is all zeros, a feature that splits nothing.
    candidates = [n for n in candidates if n not in VARYING_ONLY or np.ptp(bstate[n]) > 0]

    # Each candidate's values and edges do not depend on the others: found once.
    bfeat, hfeat = features_of(candidates, bstate, action), features_of(candidates, hstate, action)
    edges = {n: feature_edges(bfeat[n], bvals, buckets) for n in candidates}

    def score(names):
        t = build_table({m: bfeat[m] for m in names}, bvals, buckets, provenance, action,
                        budgets=bstate.get("budget"), edges=[edges[m] for m in names])
        return log_error(t, {m: hfeat[m] for m in names}, hvals), t

    chosen, best, table = [], math.inf, None
    while len(chosen) < max_features:
        rest = [n for n in candidates if n not in chosen]
        if not rest:
            break
        n, (err, t) = min(((n, score(chosen + [n])) for n in rest), key=lambda kv: kv[1][0])
        if not chosen or err <= best - MIN_GAIN:
            chosen.append(n)
            best, table = err, t
            continue
        if len(chosen) + 2 > max_features:
            break
        pair, (err, t) = min(((p, score(chosen + list(p))) for p in combinations(rest, 2)),
                             key=lambda kv: kv[1][0])
        if err > best - 2 * MIN_GAIN:
            break
        chosen += list(pair)
        best, table = err, t
    if table is None:
        return chosen, math.nan
    return chosen, agreement(table, {m: hfeat[m] for m in chosen}, hvals)


def rule_features(part: str, serving: Scenario | None) -> list[dict]:
    """The features of the exact table of the rule ``part`` names (``time-budget-deadline-kv``),
    with its edges for ``serving``'s SLO (the default scenario's where none is given: the
    names alone are then what counts); refused in one line unless a table holds it."""
    return parse_rule(part, serving or Scenario(), "features")[1]


def bucketing_rules() -> list[str]:
    """The rules whose exact tables read a quantity (``time-budget``'s is one cell)."""
    return [r for r in RULES if any(f["edges"] for f in rule_features(r.partition("[")[0], None))]


def feature_specs(spec: str, serving: Scenario | None = None) -> tuple[list[str], dict[str, list[float]]]:
    """``--features``: the names, and the edges of those given with theirs
    (``prefill_due_s:6:8:10``); a rule a table holds exactly (``time-budget-deadline-kv``)
    stands for its table's features at its own edges, for ``serving``'s SLO. Refused in one
    line unless every name is a quantity a table may bucket or such a rule, no feature is
    named twice, and every feature's edges are numbers, increasing, at most MAX_BUCKETS - 1."""
    names, fixed = [], {}
    for part in (p.strip() for p in spec.split(",")):
        name, *edges = [x.strip() for x in part.split(":")]
        if name in BY_SPEC:
            read = [f for f in rule_features(":".join([name, *edges]), serving) if f["edges"]]
            require(bool(read), "features", spec, f"{part}'s table is one cell: it reads no "
                    "quantity to bucket by")
            for f in read:
                require(f["name"] not in names, "features", spec, f"names {f['name']} twice "
                        f"({part} reads it)")
                names.append(f["name"])
                fixed[f["name"]] = [float(e) for e in f["edges"]]
            continue
        require(name in CANDIDATES + CARRIED, "features", spec,
                f"must name quantities among {', '.join(CANDIDATES + CARRIED)}, or a rule "
                f"among {', '.join(bucketing_rules())} for its table's features (got {show(name)})")
        require(name not in names, "features", spec, f"names {name} twice")
        names.append(name)
        if not edges:
            continue
        try:
            values = [float(e) for e in edges]
        except ValueError:
            values = []
        require(bool(values) and all(math.isfinite(v) for v in values)
                and all(a < b for a, b in zip(values, values[1:])) and len(values) < MAX_BUCKETS,
                "features", spec, f"{name}'s edges must be increasing numbers, at most "
                f"{MAX_BUCKETS - 1} (e.g. prefill_due_s:6:8:10)")
        fixed[name] = values
    require(bool(names), "features", spec, "must name at least one feature")
    return names, fixed
