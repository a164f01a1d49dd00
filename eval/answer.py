"""The plain answer a report opens with: what to serve, what it gains over the best fixed
budget under the SLO, and the commands that serve it.

A policy is recommended only where it beats the best fixed budget beyond the interval
(paired per stream, :func:`eval.harness.paired_verdict`); else the answer is the fixed
budget. Among the policies that beat it, the simplest that the leader does not beat in turn
is chosen: a fixed number before a rule, a rule before a table, a table before a model (a
learned policy that only ties the rule it was cloned from is that rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from envs.actions import BUDGET_CAP
from envs.scenario import Scenario
from eval.harness import paired_verdict
from policies.vllm_startup import TABLE_ENV

SIMPLICITY = {"budget": 0, "default": 0, "rule": 1, "table": 2, "model": 3}
"""How much a way of serving asks of an operator (``BudgetPolicy.serving``'s kinds)."""

SERVED_MODELS = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3-70b-tp4": "meta-llama/Meta-Llama-3-70B-Instruct",
    "llama-3-70b-tp8": "meta-llama/Meta-Llama-3-70B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct",
}
"""The model a ``vllm serve`` line names for each model preset, by the profile's name
(Hugging Face names; a profile file or a preset vLLM does not serve, such as the laptop's
Q4 build, gets MODEL)."""


@dataclass(frozen=True)
class Answer:
    """One or two sentences to act on, and the commands that do it."""

    text: str
    commands: tuple[str, ...] = ()

    def markdown(self) -> list[str]:
        lines = [f"**{self.text}**", ""]
        if self.commands:
            lines += ["Next:", "", "```bash", *self.commands, "```", ""]
        return lines


def slo_words(sc: Scenario) -> str:
    return f"TTFT {sc.slo_ttft_s:g} s / ITL {sc.slo_itl_s * 1e3:g} ms"


def _scenario_flags(sc: Scenario, engine: bool = False) -> str:
    """The flags naming a scenario's deployment and SLO; with ``engine``, also the engine
    settings a table is built for (the per-pass overhead, max_num_seqs) where not default."""
    flags = (f"--hardware {sc.hardware} --model {sc.model} --slo-ttft-s {sc.slo_ttft_s:g} "
             f"--slo-itl-s {sc.slo_itl_s:g}")
    if engine and sc.per_pass_overhead_s is not None:
        flags += f" --per-pass-overhead-s {sc.per_pass_overhead_s:g}"
    if engine and sc.max_num_seqs != Scenario.max_num_seqs:
        flags += f" --max-num-seqs {sc.max_num_seqs}"
    return flags


def _vllm(sc: Scenario, extra: str) -> str:
    name = SERVED_MODELS.get(sc.model_profile().name, "MODEL")
    tp = sc.model_profile().tensor_parallel
    return (f"vllm serve {name}" + (f" --tensor-parallel-size {tp}" if tp > 1 else "")
            + (f" --max-num-seqs {sc.max_num_seqs}" if sc.max_num_seqs != Scenario.max_num_seqs else "")
            + extra)


def _serve_table(sc: Scenario, path: str) -> list[str]:
    return [f"python -m policies.table check {path} {_scenario_flags(sc)}",
            f"{TABLE_ENV}={path} " + _vllm(
                sc, " --scheduler-cls policies.vllm_scheduler.AsyncTableScheduler "
                    f"--max-num-batched-tokens {BUDGET_CAP}")]


def serve_commands(sc: Scenario, serving: tuple[str, str]) -> tuple[str, ...]:
    """The commands that put a policy (``BudgetPolicy.serving()``) into vLLM for a scenario."""
    how, what = serving
    if how == "budget":
        return (_vllm(sc, f" --max-num-batched-tokens {what}"),)
    if how == "default":
        return (_vllm(sc, "") + f"   # vLLM's default budget here: {int(what):,} tokens",)
    if how == "table":
        return tuple(_serve_table(sc, what))
    if how == "rule":
        out = (f"tables/{sc.hardware_profile().name}__{sc.model_profile().name}__"
               f"{what.replace(':', '-')}.json")
        return (f"python -m eval export --rule {what} {_scenario_flags(sc, engine=True)} --out {out}",
                *_serve_table(sc, out))
    out = str(Path(what) / "table.json")  # a run: its model exported
    return (f"python -m eval export {what} --out {out}", *_serve_table(sc, out))


def pick(verdicts: dict, per_stream: dict, servings: dict) -> str | None:
    """The policy to serve among those whose ``verdicts`` against the best fixed budget
    are "beats": the simplest (:data:`SIMPLICITY`) that the one furthest ahead does not
    beat in turn, paired on ``per_stream``; None where none beats."""
    winners = [n for n, v in verdicts.items() if v.kind == "beats" and servings.get(n)]
    if not winners:
        return None
    top = max(winners, key=lambda n: verdicts[n].rel)
    return next(n for n in sorted(winners, key=lambda n: (SIMPLICITY[servings[n][0]], -verdicts[n].rel))
                if n == top or paired_verdict(per_stream[top], per_stream[n]).kind != "beats")


def _streams(n: int, held_out: bool) -> str:
    return f"{n} {'held-out ' if held_out else ''}stream{'s' * (n != 1)}"


def capacity_answer(study, held_out: bool = False, names: dict | None = None) -> Answer:
    """The answer of a capacity study (:class:`eval.capacity.CapacityStudy`): serve the
    policy that beats the best fixed budget, or that budget. ``names`` gives a policy the
    words a sentence calls it by (the learned policy rather than its run's path)."""
    sc = study.scenario
    slo = slo_words(sc)
    res = study.policies

    def called(n: str) -> str:
        return (names or {}).get(n, n)

    servings = {n: r.serving for n, r in res.items() if r.serving}
    if study.best.capacity <= 0:
        serving = [n for n in servings if res[n].capacity > 0]
        if not serving:
            return Answer(f"Nothing meets {slo} at any load tried, fixed or adaptive: loosen the "
                          "SLO, or serve on faster hardware or a smaller model.")
        top = max(serving, key=lambda n: res[n].capacity)
        return Answer(f"Serve {called(top)}: it meets {slo} ({res[top].text()} req/s on "
                      f"{_streams(len(res[top].per_stream), held_out)}) where no fixed budget does "
                      "at any load tried.", serve_commands(sc, servings[top]))
    b = study.best_budget
    verdicts = {n: study.verdict(n) for n in res if not res[n].kind == "reference"}
    choice = pick({n: v for n, v in verdicts.items() if n in servings},
                  {n: res[n].per_stream for n in servings}, servings)
    if choice is None:
        text = (f"No gain you can count on over a fixed {b:,} tokens: set "
                f"`--max-num-batched-tokens {b}` ({study.best.text()} req/s under {slo}, on "
                f"{_streams(len(study.best.per_stream), held_out)}).")
        unserved = [n for n, v in verdicts.items() if v.kind == "beats" and n not in servings]
        if unserved:
            top = max(unserved, key=lambda n: verdicts[n].rel)
            text += (f" {called(top)} beats it ({verdicts[top].figure}), but no table holds it: its "
                     "fraction moves continuously, and an engine serves rules through tables.")
        else:
            close = max((n for n in verdicts if res[n].kind != "static"), key=lambda n: verdicts[n].rel,
                        default=None)
            if close is not None:
                text += (f" The closest policy, {called(close)}, is {verdicts[close].figure} against it "
                         f"({verdicts[close].kind}).")
        return Answer(text, serve_commands(sc, ("budget", str(b))))
    v = verdicts[choice]
    text = (f"Serve {called(choice)}: {v.rel:.1%} more requests/s than the best fixed budget ({b:,} "
            f"tokens) under {slo}, on {_streams(v.streams, held_out)} ({v.figure}).")
    top = max((n for n in servings if verdicts[n].kind == "beats"), key=lambda n: verdicts[n].rel)
    if top != choice and f"{verdicts[top].rel:.1%}" != f"{v.rel:.1%}":  # not a tie as printed
        ahead = called(top)
        text += (f" {ahead[:1].upper()}{ahead[1:]} is further ahead of the fixed budget "
                 f"({verdicts[top].rel:+.1%}) but not beyond the interval against {called(choice)} "
                 f"({paired_verdict(res[top].per_stream, res[choice].per_stream).figure}).")
    return Answer(text, serve_commands(sc, servings[choice]))


GOOD_ENOUGH = 0.99
"""Goodput at which a fixed load no longer separates policies that meet the p99 targets."""


def load_words(sc: Scenario) -> str:
    return f"at {sc.rate:g} req/s" if not sc.trace else f"at {sc.rate_scale:g}x the trace's speed"


def suggest_load(sc: Scenario, capacity_rps: float | None, factor: float | None) -> str:
    """A sentence pointing to a load near capacity, where policies part."""
    if not capacity_rps or not factor:
        return (" Find where they part with `python -m eval capacity` and the same flags, then "
                "compare near that rate.")
    flag = (f"--rate {sc.rate * factor * 0.95:.3g}" if not sc.trace
            else f"--rate-scale {sc.rate_scale * factor * 0.95:.3g}")
    return (f" The best fixed budget's capacity under the SLO is about {capacity_rps:.3g} req/s: "
            f"compare near it (`{flag}`), or run `python -m eval capacity` with the same flags.")


def unseparated(cmp) -> bool:
    """Whether a comparison's load cannot name a best policy: no one meets the p99 targets
    on any stream (past capacity), or every policy that meets them on every stream, the best
    fixed budget among them, serves at least :data:`GOOD_ENOUGH` of requests (below it)."""
    b, best = cmp.best_static()
    if not any(r.slo_streams() for r in [*cmp.results.values(), *cmp.ladder.values()]):
        return True
    return best.meets_slo and best.mean("goodput") >= GOOD_ENOUGH and all(
        r.mean("goodput") >= GOOD_ENOUGH for r in cmp.results.values() if r.serving and r.meets_slo)


def load_answer(cmp, capacity_rps: float | None = None, factor: float | None = None) -> Answer:
    """The answer of a comparison at one load (:class:`eval.compare.Comparison`). Only
    policies that meet p99 TTFT and p99 ITL on every stream can be named best; where the
    load does not separate them (:func:`unseparated`) the answer says so and points to a
    load near capacity (``capacity_rps``, at ``factor`` times this load, where known)."""
    sc = cmp.scenario
    slo, load = slo_words(sc), load_words(sc)
    b, best = cmp.best_static()
    res = cmp.results
    breaking = [n for n, r in res.items() if not r.meets_slo]
    servings = {n: r.serving for n, r in res.items() if r.serving and r.meets_slo}
    broken = (f" {', '.join(breaking)} break{'s' * (len(breaking) == 1)} p99 TTFT or ITL on some "
              "stream." if breaking else "")
    if unseparated(cmp):
        if not best.slo_streams():
            return Answer(f"No policy and no fixed budget meets p99 {slo} on any stream {load}: the "
                          "load is past capacity." + suggest_load(sc, capacity_rps, factor))
        return Answer(f"{load.capitalize()}, every policy that meets p99 {slo} on every stream serves "
                      f"{GOOD_ENOUGH:.0%} of requests or more within their targets: this load does "
                      f"not separate them.{broken}" + suggest_load(sc, capacity_rps, factor))
    if not best.meets_slo:
        if not servings:
            return Answer(f"No fixed budget and no policy meets p99 {slo} on every stream {load}."
                          + suggest_load(sc, capacity_rps, factor))
        top = max(servings, key=lambda n: res[n].mean("goodput"))
        return Answer(f"Serve {top}: {load} it meets p99 {slo} on every stream, where no fixed "
                      f"budget does (goodput {res[top].mean('goodput'):.3f}).{broken}",
                      serve_commands(sc, servings[top]))
    verdicts = {n: cmp.verdict(n) for n in servings}
    per_stream = {n: [s["goodput"] for s in res[n].runs] for n in servings}
    choice = pick(verdicts, per_stream, servings)
    if choice is None:
        return Answer(f"No gain you can count on over a fixed {b:,} tokens {load}: set "
                      f"`--max-num-batched-tokens {b}` (goodput {best.mean('goodput'):.3f}, p99 TTFT "
                      f"and ITL within {slo} on all {len(best.runs)} streams).{broken}",
                      serve_commands(sc, ("budget", str(b))))
    v = verdicts[choice]
    return Answer(f"Serve {choice}: goodput {res[choice].mean('goodput'):.3f} against "
                  f"{best.mean('goodput'):.3f} for the best fixed budget that meets the p99 targets "
                  f"({b:,} tokens), {load} under {slo}, on {v.streams} streams ({v.figure}).{broken}",
                  serve_commands(sc, servings[choice]))
