"""The table pipeline: a trained policy exported as a lookup table an engine reads in
microseconds, in named stages, each a module saying what goes in and what comes out.

    python -m eval export RUN_DIR --out tables/NAME.json [--csv tables/NAME.csv]
    python -m eval export --rule time-budget-deadline[:TOP] --hardware H --model M --out PATH.json

1. ``record``: the trained model drives the simulator on episodes of its training
   conditions and of the serving scenario, at the table's SLO (the run's serving SLO
   unless ``--slo-*`` say otherwise); every decision's engine-readable quantities and the
   model's action (a fraction of the ITL target, or a token budget) are recorded.
2. ``features``: the quantities the policy's choices depend on, picked greedily (up to
   ``--max-features``) by how much each lowers the held-out log error between the table's
   and the model's values (``--features`` names them instead); each one's edges where the
   policy's choice changes, then quantiles.
3. ``cells``: each cell holds the action chosen most often there; unvisited cells take the
   nearest visited cell's. A time-fraction table stores its cost model's coefficients
   (``envs.pricing``) and ITL target, so that an engine turns a fraction into tokens
   exactly as the simulator does; its provenance (hardware, model shape, SLO) is what the
   runtime checks against what it serves.
4. ``dagger``: the table drives the same episodes, the model labels the states it leads
   to, and features and cells are made again from all the decisions, ``--dagger-rounds``
   times.
5. ``refine`` (``--refine-streams N``): one more candidate, refined cell by cell in
   closed loop on capacity under the SLO, where the model's choice is split within a cell
   and only the closed loop tells which value serves.
6. ``select``: among the rounds', the refined and the rules' exact tables (``rules``:
   ``--rules``), the one that keeps most of the model's capacity and goodput at load, on
   streams of its own: a learned table that does not beat the rule it learned from is not
   worth shipping, and a rule's table says it is the rule.
7. ``fidelity``: on arrivals the table was not built from, agreement with the model,
   capacity of model and table on the run's final scenarios, the table against its flat
   twin, goodput at load; ``report`` prints them (a table more than 1% below the model
   says so loudly).

A run across deployments (``train.py --all-deployments``) exports a table that carries:
its decisions come from every deployment it trained on, at their own SLO pairs (each
with its deployment's features, which the table may bucket: ``prefill_tokens_per_itl``
and the others of ``policies.table.DEPLOYMENT_AXES``), the tables drive and are judged on
each deployment re-priced for it, the choice and the fidelity check run on one training
condition per deployment, and the kept table's provenance records the range of the
deployment features it buckets (``eval.export.record``).

:func:`export_run` runs the stages in that order; ``eval.export.cli`` is the command line.
"""

from __future__ import annotations

from envs.scenario import Scenario
from eval.export.args import ExportArgs
from eval.export.cells import action_spec, run_provenance, scenario_provenance
from eval.export.dagger import dagger_rounds, round_labels
from eval.export.features import feature_specs
from eval.export.fidelity import fidelity_record
from eval.export.carry import carries, trained_range
from eval.export.record import collect, export_episodes
from eval.export.refine import refine_table, save_refined
from eval.export.rules import rule_candidates
from eval.export.select import kept_table, select_round
from policies.table import BudgetTable


def export_run(model, serving: Scenario, args: ExportArgs) -> BudgetTable:
    """A run's model as a table for ``serving`` (its SLO the table's), stage by stage."""
    action = action_spec(model, serving)
    rules = rule_candidates(args.rules, serving, action)
    asked, fixed = feature_specs(args.features, serving) if args.features else (None, {})
    build_eps, held_eps = export_episodes(model, serving, args)
    prov = {**scenario_provenance(serving), **run_provenance(model, args)}
    frame = prov["slo"] if carries(model) else None
    build, held = collect(model, build_eps, frame=frame), collect(model, held_eps, frame=frame)
    if frame is not None:
        prov["deployments"] = trained_range(model, serving, [sc for sc, _ in build_eps])
    rounds = dagger_rounds(model, (build_eps, held_eps), (build, held), asked, args, prov, action,
                           fixed)
    refined = [refine_table(model, rounds, serving, args, prov, action)] if args.refine_streams else []
    labels = round_labels(args.dagger_rounds) + ["refined"] * len(refined) + [s for s, _ in rules]
    kinds = ["round"] * len(rounds) + ["refined"] * len(refined) + ["rule"] * len(rules)
    rounds += refined
    selection = select_round(model, [r.table for r in rounds] + [t for _, t in rules], serving, args)
    data, names, built = kept_table(rounds, rules, (labels, kinds), selection, args, prov)
    if refined and kinds[selection["chosen"]] != "refined":
        aside = save_refined(refined[0].table, data["provenance"]["dagger"], args.run_dir)
        print(f"the refined table, not kept ({labels[selection['chosen']]} kept more of the "
              f"model's capacity and goodput on the choice's streams): {aside}", flush=True)
    chosen = BudgetTable(data)
    data["fidelity"] = fidelity_record(model, chosen, serving, args, held, names, action, built)
    return BudgetTable(data, args.out)
