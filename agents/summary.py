"""After training: the learned policy's capacity against the fine-ladder hindsight static,
the rule it started from, the time-budget rule and vLLM's default on held-out arrivals (the
serving scenario and its variants: ``eval.scenarios.final_scenarios``), the run's pictures,
and its summary: the answer first (what to serve, and whether the learning added anything
to its teacher), the commands that serve it, then the details with their words defined."""

from __future__ import annotations

from pathlib import Path

from envs.scenario import Scenario
from eval.answer import Answer, capacity_answer
from eval.capacity import capacity_studies
from eval.capacity_report import capacity_figures, ladder_figure, ladder_line
from eval.harness import NOT_JUDGED, paired_verdict
from eval.report import capacity_words, figure_lines
from eval.scenarios import final_scenarios
from eval.usage import budget_label, used_text
from policies.baselines import TimeBudgetPolicy, VllmDefaultPolicy
from policies.specs import make_policy


def final_policies(learned, teacher: str | None, sc: Scenario) -> list:
    """The final comparison's policies on a scenario: the learned one, the rule it was
    cloned from (``teacher``, a spec; where it is not the time-budget rule), the time-budget
    rule and vLLM's default."""
    rule = TimeBudgetPolicy(sc.slo_itl_s)
    start = [make_policy(teacher, sc)] if teacher else []
    return [learned, *(p for p in start if p.name != rule.name), rule,
            VllmDefaultPolicy(sc.hardware_profile())]


def final_comparison(learned, serving: Scenario, seeds: int, requests: int, executor=None,
                     progress=None, teacher: str | None = None) -> dict:
    """Capacity studies (fine-ladder hindsight static included) of :func:`final_policies`
    on each final scenario."""
    scenarios = final_scenarios(serving)
    jobs = [(sc, final_policies(learned, teacher, sc)) for sc in scenarios.values()]
    studies = capacity_studies(jobs, seeds, requests, executor, progress)
    return dict(zip(scenarios, studies))


def final_figures(studies: dict, learned, teacher: str | None, out: Path, seeds: int, requests: int,
                  executor=None, progress=None) -> list[tuple[Path, str]]:
    """The run's pictures, in its directory: capacity against the static budget on every
    final scenario; on the serving one, every policy at the best fixed budget's capacity
    (latency tails, the budget timeline around the worst gap) and goodput against load."""
    serving = next(iter(studies.values()))
    policies = final_policies(learned, teacher, serving.scenario)
    return [ladder_figure(studies, out, seeds),
            *capacity_figures(serving, policies, out, seeds, requests, executor, progress, ladder=False)]


def capacity_lines(studies: dict, learned_name: str) -> list[str]:
    names = list(next(iter(studies.values())).policies)
    heads = ["learned" if n == learned_name else n for n in names]
    lines = ["| scenario | best fixed budget | " + " | ".join(heads) + " |",
             "|---|---|" + "---|" * len(names)]
    for name, st in studies.items():
        cells = []
        for n in names:
            r, v = st.policies[n], st.verdict(n)
            cells.append(f"{r.text()} ({v.cell})")
        lines.append(f"| {name} | {st.best_budget:,}: {st.best.text()} | " + " | ".join(cells) + " |")
    return lines


def job_lines(studies: dict, learned_name: str, rule_name: str = "time-budget") -> list[str]:
    """DESIGN.md's two jobs, said plainly."""
    within = [n for n, st in studies.items() if st.verdict(learned_name).matches]
    beats = [n for n, st in studies.items() if st.verdict(learned_name).kind == "beats"]
    short = [f"{n} ({st.verdict(learned_name).rel:+.1%})" for n, st in studies.items()
             if not st.verdict(learned_name).matches]
    lines = [f"- Job 1 (be within 2% of the best fixed budget with one untuned policy): met in "
             f"{len(within)} of {len(studies)} scenarios"
             + (f"; more than 2% below it in {', '.join(short)}." if short else ".")]
    one = all(st.verdict(learned_name).kind == NOT_JUDGED for st in studies.values())
    lines.append("- Job 2 (beat it beyond the interval, where the dynamics give room): " + (
        "not judged: one stream per scenario has no interval (raise --final-seeds)." if one else
        "in " + (", ".join(beats) if beats else "none of them") + "."))
    vs_rule = [f"{n} {paired_verdict(st.policies[learned_name].per_stream, st.policies[rule_name].per_stream)}"
               for n, st in studies.items() if rule_name in st.policies]
    if vs_rule:
        lines.append(f"- Against the time-budget rule (each pass within 0.9 of the ITL target), paired "
                     f"per stream: {'; '.join(vs_rule)}.")
    return lines


def teacher_verdicts(studies: dict, learned_name: str, teacher: str | None) -> dict:
    """Per final scenario, the learned policy against the rule it started from, paired per
    stream (none where that rule was not measured)."""
    out = {}
    for name, st in studies.items():
        rule = next((n for n in st.policies if teacher and n == make_policy(teacher, st.scenario).name), None)
        if rule and rule != learned_name:
            out[name] = (rule, paired_verdict(st.policies[learned_name].per_stream, st.policies[rule].per_stream))
    return out


STARTED_FROM = "the rule it started from"
"""What the summary calls the rule it compares the learned policy with: the one it was
cloned from, or, where training conditions had teachers of their own, :func:`mixed_start`."""


def mixed_start(checks: dict | None) -> str:
    """The overall teacher's name where training conditions were cloned from their own
    (``checks.condition_teachers``), some of them not from it."""
    return f"{teacher_words(checks)} overall (each training condition was cloned from its own)"


def learning_sentence(verdicts: dict, start: str = STARTED_FROM) -> str:
    """Whether the learning added anything to its teacher, in plain words, from
    :func:`teacher_verdicts` (the serving scenario first); ``start``: what that teacher is
    (:data:`STARTED_FROM` or :func:`mixed_start`)."""
    if not verdicts:
        return ""
    scenario, (rule, v) = next(iter(verdicts.items()))
    others = [f"{n}: {w.kind} ({w.figure})" for n, (_, w) in list(verdicts.items())[1:]]
    rest = f" Elsewhere: {'; '.join(others)}." if others else ""
    if v.kind == NOT_JUDGED:
        return (f"Against {start}, {rule}, the learned policy is not judged: "
                f"{v.figure} (raise --final-seeds).{rest}")
    if v.kind == "beats" and not v.streams:
        return (f"The learned policy meets the SLO where {start}, {rule}, does not "
                f"on the {scenario} scenario ({v.figure}).{rest}")
    if v.kind == "beats":
        return (f"The learning added {v.rel:.1%} capacity to {start}, {rule}, on the "
                f"{scenario} scenario ({v.figure}).{rest}")
    if v.kind == "falls short":
        return (f"The learned policy serves less than {start}, {rule} ({v.figure}): "
                f"the learning lost ground; the rule is the better table.{rest}")
    return (f"The learned policy ties {start}, {rule} ({v.figure}): the learning "
            f"added nothing you can count on, and the rule's own table serves as well.{rest}")


def selection_sentence(history: list, kept: int | None, cloned: bool, run: str = "RUN_DIR") -> str:
    """Which model the run kept and why, in plain words: the start unless a later
    evaluation cost less than it beyond the paired interval on the same held-out episodes
    (``agents.callbacks.SimEvalCallback``); "" for a run from before paired selection. A run
    that kept its start is pointed to the search by capacity (``agents.search``), which
    can climb where the training's cost does not see."""
    if not history or "costs" not in history[0]:
        return ""
    start = "the behaviour clone at step 0" if cloned else "the starting policy"
    later = [h for h in history[1:] if "vs_start" in h]
    episodes = len(history[0]["costs"])
    if kept is None or kept == history[0]["timesteps"]:
        if not later:
            return f"Model selection kept {start}: no later evaluation was made."
        close = min(later, key=lambda h: h["vs_start"]["diff"])["vs_start"]
        step = min(later, key=lambda h: h["vs_start"]["diff"])["timesteps"]
        return (f"Model selection kept {start}: none of the {len(later)} later models cost less "
                f"than it beyond the paired interval on the {episodes} held-out episodes (the "
                f"closest, at step {step:,}: {close['diff']:+.2f} ± {close['ci95']:.2f}); the "
                f"learning did not beat its start. `python -m agents.search --run {run} --out "
                f"{run}-search --objective capacity` searches its action head by capacity under "
                "the SLO (docs/learning.md, \"Searching by capacity\").")
    h = next(h for h in history if h["timesteps"] == kept)
    v = h["vs_start"]
    text = (f"Model selection kept the model at step {kept:,}: it costs {-v['diff']:.2f} ± "
            f"{v['ci95']:.2f} less than {start} on the same {episodes} held-out episodes (paired)")
    b = h.get("vs_baseline")
    if b:
        text += (f", and {b['diff']:+.2f} ± {b['ci95']:.2f} against the best fixed choice "
                 f"({'cheaper' if b['verdict'] == 'falls short' else 'dearer' if b['verdict'] == 'beats' else 'a tie'})")
    return text + "."


def run_answer(studies: dict, learned_name: str, teacher: str | None,
               notes: list[str] | None = None, selection: str = "",
               start: str = STARTED_FROM) -> Answer:
    """The summary's answer: what to serve on the serving scenario (held-out streams), what
    the learning added to the rule it was cloned from (``teacher``; None where it was
    cloned from none; ``start`` says what it is, :func:`learning_sentence`), and which
    model the run kept (``selection``, :func:`selection_sentence`). A run with ``notes``
    (a smoke run's) measured too little to act on: its answer says so and gives no
    commands."""
    if notes:
        return Answer("Not an answer to act on: " + " ".join(notes))
    serving = next(iter(studies.values()))
    answer = capacity_answer(serving, held_out=True, names={learned_name: "the learned policy (as a table)"})
    learning = learning_sentence(teacher_verdicts(studies, learned_name, teacher), start)
    return Answer(" ".join(t for t in (answer.text, learning, selection) if t), answer.commands)


def budget_lines(actions: dict) -> list[str]:
    """The token budgets the policy asked for, and the budget against the running decodes
    (absent from runs summarised before they were recorded)."""
    shares, rows = actions.get("budget_shares"), actions.get("by_decodes")
    if not shares or not rows:
        return []
    used = used_text(shares, budget_label) or "none"
    in_time = "over_target" in rows[0]
    lines = [f"The token budgets those became (each pass's fraction turned into tokens with its "
             f"decodes and its episode's ITL target, so they spread over the training conditions' "
             f"SLO pairs), in bins of 2^(1/4) tokens: {actions['budgets_5pct']} bins each hold at "
             f"least 5% of passes ({used}).", "",
             "| running decodes | share of passes | median budget (tokens) |"
             + (" share over 1x the target |" if in_time else ""),
             "|---|---:|---:|" + ("---:|" if in_time else "")]
    for r in rows:
        lines.append(f"| {r['decodes']} | {r['share']:.3f} | {r['median_budget']:,.0f} |"
                     + (f" {r['over_target']:.3f} |" if in_time else ""))
    return lines + [""]


def teacher_words(checks: dict | None) -> str:
    """What a run calls the fixed choice it starts from."""
    return "the given teacher" if (checks or {}).get("teacher_given") else "the best fixed choice"


def teacher_line(checks: dict | None) -> str | None:
    """The summary's line on a teacher given with ``--teacher`` (None where the checks chose)."""
    if not (checks or {}).get("teacher_given"):
        return None
    pick = checks.get("checks_pick")
    return (f"- teacher: {checks['best_constant']}, given (--teacher)"
            + (f"; the checks' pick: {pick}" if pick and pick != checks["best_constant"] else ""))


def fraction_text(shares: dict) -> str:
    """The time budgets the policy took in at least 0.1% of passes, most used first, each
    with its share; the rest counted, not listed."""
    used = sorted(((k, v) for k, v in shares.items() if v >= 0.001), key=lambda kv: -kv[1])
    rare = sum(0 < v < 0.001 for v in shares.values())
    if not used:
        return "no decided pass"
    return (", ".join(f"{k}x the ITL target in {v:.1%}" for k, v in used)
            + (f", and {rare} other{'s' * (rare > 1)} in under 0.1% each" if rare else ""))


def room_line(room: dict, checks: dict) -> str:
    """The room check, said so that a silent check does not read as no room."""
    if room["best_cost"] == 0 and room["reference_cost"] == 0:
        return (f"- room check: silent. Neither the reference controller (MPC over "
                f"{room['best_constant']}) nor {teacher_words(checks)} missed a target on its "
                f"{room['episodes']} episodes, so they cannot tell the room beyond that rule")
    return (f"- room check: the reference controller (MPC over {room['best_constant']}) costs "
            f"{room['reference_cost']:.2f} against {room['best_cost']:.2f} for {teacher_words(checks)} "
            f"({room['gain']:+.2f} ± {room['gain_ci95']:.2f}; a cost is SLO violations in % of "
            f"requests, over {room['episodes']} episodes)")


def summary_text(run_name: str, desc: str, facts: dict, checks: dict | None, history: list,
                 studies: dict, learned_name: str, actions: dict, answer: Answer | None = None,
                 figures: list | None = None, seeds: int | None = None,
                 requests: int | None = None) -> str:
    """``summary.md``: the answer and its commands, what was measured and the words it uses,
    the capacities, what the policy does, the run's facts and checks, and ``figures``."""
    serving = next(iter(studies.values()))
    seeds = seeds or len(serving.best.per_stream)
    lines = [f"# chunkpilot training run: {run_name}", ""]
    lines += answer.markdown() if answer else []
    lines += ["## What was measured", "", f"- Scenario: {desc}.",
              *capacity_words(seeds, requests, bool(serving.scenario.trace), True, serving.rungs), "",
              "## Capacity under the SLO, held-out arrivals", ""]
    lines += capacity_lines(studies, learned_name) + [""] + job_lines(studies, learned_name)
    lines += ["", ladder_line(serving, "On the serving scenario, the static ladder measured")]
    lines += ["", "## What the policy does", "",
              f"Time budgets on held-out training episodes ({actions.get('passes', 0):,} decided "
              f"passes): {fraction_text(actions.get('shares', {}))}.", ""] + budget_lines(actions)
    lines += ["## The run", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items() if k != "best constant cost on them"]
    if checks:
        if teacher_line(checks):
            lines.append(teacher_line(checks))
        rk, room = checks.get("ranking"), checks.get("room")
        if rk:
            lines.append(f"- ranking check: before training, the return ranked {len(rk['rows'])} fixed "
                         f"choices as their capacity does with Spearman {rk['spearman']:.2f} (over "
                         f"{rk['conditions']} training conditions)")
        if room:
            lines.append(room_line(room, checks))
    if history:
        h = history[-1]
        lines.append(f"- held-out training episodes: cost {h['cost']:.2f} ± {h['cost_ci95']:.2f} at "
                     f"{h['timesteps']:,} steps; {teacher_words(checks)} costs "
                     f"{facts.get('best constant cost on them', 'n/a')} on the same episodes")
    lines += [""] + figure_lines(figures)
    return "\n".join(lines).rstrip() + "\n"
