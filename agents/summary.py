"""After training: the learned policy's capacity against the fine-ladder hindsight static,
the time-budget rule and vLLM's default on held-out arrivals (the serving scenario and its
variants: ``eval.scenarios.final_scenarios``), and the run's summary, which says plainly
which of DESIGN.md's two jobs the result shows."""

from __future__ import annotations

from envs.scenario import Scenario
from eval.capacity import capacity_studies
from eval.harness import NOT_JUDGED
from eval.scenarios import final_scenarios
from eval.usage import budget_label, used_text
from policies.baselines import TimeBudgetPolicy, VllmDefaultPolicy

def final_comparison(learned, serving: Scenario, seeds: int, requests: int, executor=None,
                     progress=None) -> dict:
    """Capacity studies (fine-ladder hindsight static included) of the learned policy, the
    time-budget rule and vLLM's default on each final scenario."""
    scenarios = final_scenarios(serving)
    jobs = [(sc, [learned, TimeBudgetPolicy(sc.slo_itl_s), VllmDefaultPolicy(sc.hardware_profile())])
            for sc in scenarios.values()]
    studies = capacity_studies(jobs, seeds, requests, executor, progress)
    return dict(zip(scenarios, studies))


def capacity_lines(studies: dict, learned_name: str) -> list[str]:
    lines = ["| scenario | hindsight static | learned | time-budget | vLLM's default |",
             "|---|---|---|---|---|"]
    for name, st in studies.items():
        cells = []
        for n in st.policies:
            r, v = st.policies[n], st.verdict(n)
            cells.append(f"{r.text()} ({v.cell})")
        lines.append(f"| {name} | {st.best_budget}: {st.best.text()} | "
                     + " | ".join(cells) + " |")
    return lines


def job_lines(studies: dict, learned_name: str, rule_name: str = "time-budget") -> list[str]:
    """DESIGN.md's two jobs, said plainly."""
    within = [n for n, st in studies.items() if st.verdict(learned_name).matches]
    beats = [n for n, st in studies.items() if st.verdict(learned_name).kind == "beats"]
    short = [f"{n} ({st.verdict(learned_name).rel:+.1%})" for n, st in studies.items()
             if not st.verdict(learned_name).matches]
    vs_rule = [st.policies[learned_name].capacity / st.policies[rule_name].capacity - 1
               for st in studies.values() if st.policies[rule_name].capacity > 0]
    lines = [f"- Job 1 (match the best fixed budget with one policy, no tuning): within 2% of the "
             f"fine-ladder hindsight static in {len(within)} of {len(studies)} scenarios"
             + (f"; more than 2% below it in {', '.join(short)}." if short else ".")]
    one = all(st.verdict(learned_name).kind == NOT_JUDGED for st in studies.values())
    lines.append("- Job 2 (beat it where the dynamics give room): " + (
        "not judged: one stream per scenario has no interval (raise --final-seeds)." if one else
        "beats it beyond the interval in " + (", ".join(beats) if beats else "none of them") + "."))
    if vs_rule:
        mean = sum(vs_rule) / len(vs_rule)
        lines.append(f"- Against the time-budget rule (each pass within 0.9 of the ITL target): "
                     f"{mean:+.1%} capacity on average.")
    return lines


def budget_lines(actions: dict) -> list[str]:
    """The token budgets the policy asked for, and the budget against the running decodes
    (absent from runs summarised before they were recorded)."""
    shares, rows = actions.get("budget_shares"), actions.get("by_decodes")
    if not shares or not rows:
        return []
    used = used_text(shares, budget_label) or "none"
    in_time = "over_target" in rows[0]
    lines = [f"Token budgets asked (a time fraction becomes a different budget with each pass's "
             f"decodes and each episode's ITL target: over the training conditions' SLO pairs they "
             f"spread further than at one SLO), in bins of 2^(1/4) tokens: "
             f"{actions['budgets_5pct']} bins each hold at least 5% of passes ({used}).", "",
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


def summary_text(run_name: str, desc: str, facts: dict, checks: dict | None, history: list,
                 studies: dict, learned_name: str, actions: dict) -> str:
    lines = [f"# chunkpilot training run: {run_name}", "", f"- scenario: {desc}"]
    lines += [f"- {k}: {v}" for k, v in facts.items() if k != "best constant cost on them"]
    if checks:
        if teacher_line(checks):
            lines.append(teacher_line(checks))
        rk, room = checks.get("ranking"), checks.get("room")
        if rk:
            lines.append(f"- before training, the return ranks {len(rk['rows'])} constant choices as "
                         f"their capacity does with Spearman {rk['spearman']:.2f} (over "
                         f"{rk['conditions']} training conditions)")
        if room:
            lines.append(f"- room: the reference controller (MPC over {room['best_constant']}) "
                         f"costs {room['reference_cost']:.2f} against {room['best_cost']:.2f} for "
                         f"{teacher_words(checks)} ({room['gain']:+.2f} ± {room['gain_ci95']:.2f} SLO "
                         f"violations, % of requests, over {room['episodes']} episodes)")
    if history:
        h = history[-1]
        lines.append(f"- held-out training episodes: cost {h['cost']:.2f} ± {h['cost_ci95']:.2f} at "
                     f"{h['timesteps']:,} steps; {teacher_words(checks)} costs "
                     f"{facts.get('best constant cost on them', 'n/a')} on the same episodes")
    lines += ["", "## Capacity under the SLO, held-out arrivals", ""]
    lines += capacity_lines(studies, learned_name) + [""] + job_lines(studies, learned_name)
    used = actions.get("used_5pct", 0)
    lines += ["", "## What the policy does", "",
              f"Share of passes per time budget (fraction of the ITL target) on held-out "
              f"episodes; {used} {'action is' if used == 1 else 'actions are each'} used in at least 5% of "
              f"{actions.get('passes', 0):,} passes:", "",
              "| fraction | " + " | ".join(actions.get("shares", {})) + " |",
              "|---|" + "---:|" * len(actions.get("shares", {})),
              "| share | " + " | ".join(f"{v:.3f}" for v in actions.get("shares", {}).values()) + " |",
              ""] + budget_lines(actions) + ["Capacity: per stream, the highest load at which p99 TTFT and p99 ITL meet the "
              "SLO; ± is a 95% interval over streams; each verdict compares the policy with the "
              "hindsight static stream by stream.", ""]
    return "\n".join(lines)
