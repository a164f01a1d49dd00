"""``capacity.md``: one scenario's capacities, the answer first (:mod:`eval.answer`), then
the words it uses, every policy against the best fixed budget and the held-out pick, the
ladder, and the pictures (:mod:`eval.figures`)."""

from __future__ import annotations

import math
from pathlib import Path

from envs.files import write_atomic
from envs.seeds import CAPACITY_SEEDS
from envs.workload import MAX_RATE
from eval import plots
from eval.answer import capacity_answer, slo_words
from eval.capacity import BRACKET_STEPS
from eval.figures import (CURVE_STREAMS, GOODPUT_LOADS, at_load_figures, figure_policies,
                          goodput_curves, ladder_panel, runs_at_load)
from eval.harness import paired_verdict
from eval.report import (capacity_words, figure_lines, git_commit, scenario_line,
                         verdict_sentence)
from eval.table_use import use_line


def unbounded_note(studies) -> str | None:
    """A line naming the results whose search met the SLO at every load it tried (their
    capacity is a lower bound), or None."""
    found = [(n, len(r.unbounded)) for st in studies
             for n, r in [*st.policies.items(), *((f"static:{b}", r) for b, r in st.rungs.items())]
             if r.unbounded]
    if not found:
        return None
    names = ", ".join(f"{n} ({k} stream{'s' * (k > 1)})" for n, k in found[:8])
    more = " and more" if len(found) > 8 else ""
    return (f"NOTE: the SLO held at every load tried (up to 2^{BRACKET_STEPS - 1} times the "
            f"scenario's, at most {MAX_RATE:.0e} requests/s) for {names}{more}: those "
            "capacities are lower bounds, and the verdicts that use them are not measurements; "
            "longer streams (--requests) let a load bind.")


def held_out_cell(study, name: str) -> str:
    """A policy against the held-out static pick, as the verdict reads it."""
    if not study.has_held_out:
        return "n/a (one stream)"
    held, _ = study.held_out_static()
    if held.capacity <= 0:
        return "the held-out pick serves nothing"
    return str(paired_verdict(study.policies[name].per_stream, held.per_stream))


def held_out_line(study) -> str:
    """What the static budget picked without the stream it is judged on serves, and how
    much of the hindsight pick's lead is the pick's luck (paired per stream)."""
    if not study.has_held_out:
        return "One stream: no held-out pick (it needs another stream to pick on)."
    held, picks = study.held_out_static()
    if study.best.capacity <= 0:
        return "Held-out pick: no static budget meets the SLO on any stream."
    loss = 0.0 - paired_verdict(held.per_stream, study.best.per_stream).rel
    return (f"Held-out pick (each stream judged under the rung best on the other streams, a "
            f"user's pick from past arrivals): rungs {'/'.join(map(str, picks))} (one per stream), "
            f"serving {held.text(3)} req/s, {loss:.1%} less than the hindsight pick stream by "
            "stream: what choosing on the streams it is judged on is worth to it.")


def ladder_line(study, lead: str = "Static ladder measured") -> str:
    """The static ladder measured, in budget order, with the steepest fall above the best
    between two neighbouring rungs named: how sharply a fixed budget set too high loses."""
    rungs = sorted(study.rungs)
    caps = [study.rungs[b].capacity for b in rungs]
    text = f"{lead} (req/s): " + ", ".join(f"{b:,}: {c:.2f}" for b, c in zip(rungs, caps)) + "."
    drops = [(caps[i] / caps[i - 1], rungs[i - 1], rungs[i]) for i in range(1, len(rungs))
             if caps[i - 1] > 0 and rungs[i] > study.best_budget]
    if drops:
        ratio, lo, hi = min(drops)
        if ratio < 0.8:
            text += (f" Above the best, the steepest fall is from {lo:,} to {hi:,} tokens "
                     f"({1 - ratio:.0%} less): a cliff to keep clear of when setting a fixed budget.")
    return text


def ladder_figure(studies: dict, out: Path, seeds: int) -> tuple[Path, str]:
    """Capacity against the static budget, a panel per study (``{title: study}``), each
    relative to its best fixed budget: (figure, caption)."""
    slo = slo_words(next(iter(studies.values())).scenario)
    path = plots.ladder_figure([ladder_panel(st, title) for title, st in studies.items()],
                               out / "capacity_by_budget.png", "capacity under the SLO",
                               f"Capacity under {slo}")
    return path, (f"Capacity under {slo} against the static budget: the fine ladder, each rung "
                  f"as a share of the best fixed budget's capacity on the same stream (mean over "
                  f"{seeds} stream{'s' * (seeds != 1)} with its 95% interval), each policy a line "
                  "with its interval shaded: the line is its verdict against the best fixed budget.")


def capacity_figures(study, policies, out: Path, seeds: int, num_requests: int, executor=None,
                     progress=None, curves: bool = True, ladder: bool = True,
                     prefix: str = "at_capacity_") -> list[tuple[Path, str]]:
    """The study's pictures, [(figure, caption)]: with ``ladder``, capacity against the
    static budget; every policy and the best fixed budget on the first stream at that
    budget's capacity (latency tails, the budget timeline); and with ``curves``, goodput
    against load on the first :data:`CURVE_STREAMS` streams."""
    sc = study.scenario
    slo = slo_words(sc)
    figs = [ladder_figure({scenario_line(sc): study}, out, seeds)] if ladder else []
    b = study.best_budget
    runners = figure_policies(policies, b)
    factor = study.best.factors[0] if study.best.factors and study.best.factors[0] > 0 else 1.0
    rate = study.best.per_stream[0] if study.best.per_stream and study.best.per_stream[0] > 0 else None
    at = runs_at_load(sc, runners, 0, seeds, num_requests, factor, CAPACITY_SEEDS)
    what = (f"the first stream at the best fixed budget's capacity ({rate:.2f} req/s)" if rate
            else "the first stream at the scenario's own load")
    figs += at_load_figures(at, sc, out, what, prefix)
    if curves:
        streams = min(CURVE_STREAMS, seeds)
        factors = [f if f > 0 else 1.0 for f in (study.best.factors or (1.0,) * seeds)[:streams]]
        found = goodput_curves(sc, runners, GOODPUT_LOADS, factors, num_requests, CAPACITY_SEEDS,
                               executor, progress, seeds)
        path = plots.goodput_vs_load(found, out / "goodput_vs_load.png", f"goodput against load, {slo}",
                                     "load, times the best fixed budget's capacity on each stream")
        figs.append((path, f"Goodput (the share of requests whose TTFT and TPOT meet {slo}) against "
                           f"the load, each stream's as a multiple of its capacity under the best fixed "
                           f"budget ({b:,} tokens), mean over {streams} stream{'s' * (streams != 1)} "
                           "with its 95% interval shaded."))
    return figs


def figure_count(policies, curves: bool, seeds: int) -> int:
    """Simulations :func:`capacity_figures` (or a comparison's) fans out, for a progress
    bar's total: the goodput curve of every policy it draws and the best fixed budget."""
    return len(figure_policies(policies, 0)) * len(GOODPUT_LOADS) * min(CURVE_STREAMS, seeds) if curves else 0


def capacity_report(study, out: Path, seeds: int, num_requests: int, uses: dict | None = None,
                    figures: list[tuple[Path, str]] | None = None) -> str:
    """One scenario's ``capacity.md``: the answer and the commands that serve it; then every
    policy with its interval and its verdict against the hindsight-best static budget on
    the fine ladder and against the held-out pick, the ladder itself; with ``uses`` (table
    name -> ``eval.table_use.pooled_use``), what each table does at its capacity; then
    ``figures`` ([(path, caption)], :func:`capacity_figures`)."""
    b = study.best_budget
    best = study.best
    sc = study.scenario
    lines = [f"# Capacity under {slo_words(sc)}", "", *capacity_answer(study).markdown(),
             "## What was measured", "", f"- Scenario: {scenario_line(sc)}; commit {git_commit()}.",
             *capacity_words(seeds, num_requests, bool(sc.trace), False, study.rungs),
             "- The held-out pick: each stream judged under the rung best on the other streams, "
             "the number you could have picked from past arrivals.",
             "- Worst gap, passes over the ITL target: at each stream's capacity, the longest "
             "pass a decoding user waited through (the largest over the streams) and the share "
             "of passes with decodes slower than the ITL target (the mean); p99 ITL hides "
             "stalls. `--max-pass-itl` caps the first for every adaptive policy." , "",
             (f"Best fixed budget: {b:,} tokens, {best.text(3)} req/s." if best.capacity > 0 else
              "No static budget on the fine ladder meets the SLO at any load tried, on any stream."),
             "", held_out_line(study), "",
             f"| policy | capacity (req/s) | against static:{b} | against the held-out pick "
             "| worst gap, passes over the ITL target, at capacity |",
             "|---|---:|---|---|---|"]
    for n, r in study.policies.items():
        against = (verdict_sentence(study.verdict(n), f'static:{b}', 'capacity') if best.capacity > 0
                   else "no static budget meets the SLO" + (", this policy does" if r.capacity > 0 else ""))
        lines.append(f"| {n} | {r.text(3)} | {against} | {held_out_cell(study, n)} "
                     f"| {r.stall_text()} |")
    lines += ["", ladder_line(study)]
    hits = {n: r.hit_rate_at_capacity() for n, r in study.policies.items()}
    if any(not math.isnan(h) for h in hits.values()):
        lines += ["", "Prefix caching: the share of prompt tokens the cache served at each "
                  "policy's capacity (the mean over the streams): "
                  + "; ".join(f"{n} {h:.1%}" for n, h in hits.items() if not math.isnan(h)) + "."]
    note = unbounded_note([study])
    if note:
        lines += ["", note]
    worth = study.flat_verdicts()
    if worth:
        lines += ["", "What each table's cells are worth (the table against itself flattened, every "
                  "cell at one fraction of the ITL target, paired stream by stream):", ""]
        lines += [f"- {t} against {f}: {v.cell}" for t, f, v in worth]
    room = study.room_verdicts()
    if room:
        lines += ["", "The room beyond the best rule (the rollout reference, which sees the future, "
                  "against the rule it is over, paired stream by stream):", ""]
        lines += [f"- {ref} against {rule}: {v.cell}" for ref, rule, v in room]
    if uses:
        lines += ["", "## What the tables do at their capacity", ""]
        lines += [f"- {n}: {use_line(u, u['action'], 'streams')}" for n, u in uses.items()]
    lines += [""] + figure_lines(figures)
    text = "\n".join(lines).rstrip() + "\n"
    write_atomic(out / "capacity.md", text)
    return text
