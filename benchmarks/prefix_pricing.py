"""What pricing a pass with the next requests' cached prefixes is worth to the time budgets.

    python benchmarks/prefix_pricing.py [--scenarios agent-90,conversation-8] [--seeds 5] \
        [--rules time-budget-slack,time-budget-deadline,time-budget]

A pass sized to a share of the ITL target may reach past the head request and admit the
next ones, each of which re-reads its own cached prefix. The time-budget rules price that
(``envs.pricing.state_budget`` over ``next_prefills``); their twins here see an engine
state without ``next_prefills`` and price the pass as the head's chunk alone. For each
prefix-caching scenario of the suite and each rule: the capacity of both (5 streams of
600 requests, the suite's seeds) and, at the rule's own capacity (the mean load factor over its
streams), the passes carrying
two or more prefill chunks and the share of those over the ITL target, and the same for
passes with one chunk. Prints a Markdown table (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse

import numpy as np

from eval.capacity import capacities, probe_stream
from eval.scenarios import PREFIX
from policies.specs import make_policy


class HeadOnly:
    """An engine state without ``next_prefills``: every other name as the state has it."""

    __slots__ = ("_state",)

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return () if name == "next_prefills" else getattr(self._state, name)

    def __getitem__(self, name):
        return getattr(self, name)

    def get(self, name, default=None):
        return getattr(self, name, default)


def head_only(spec: str, scenario):
    """The rule ``spec``, pricing each pass as the head's chunk alone."""
    rule = make_policy(spec, scenario)

    class Twin(type(rule)):
        def budget(self, state):
            return super().budget(HeadOnly(state))

    twin = make_policy(spec, scenario)
    twin.__class__ = Twin
    twin.name = f"{spec} (head only)"
    return twin


def passes_over(scenario, policy, load: float, seeds: int) -> tuple[int, float, int, float]:
    """(passes with 2+ chunks, their share over the ITL target, passes with 1 chunk, theirs)
    over the capacity search's ``seeds`` streams at ``load`` times the scenario's rate (a
    pass counts as over when it carries decodes and takes longer than the target)."""
    many = slow_many = one = slow_one = 0
    for i in range(seeds):
        sc, w = probe_stream(scenario, i, seeds, 600, load)
        policy.reset()
        sim = sc.simulator(w)
        sim.run(policy)
        durations, decodes = sim.pass_records()
        rows = sim.log.history().prefill_between(0, sim.pass_index)
        for p, chunks in zip(rows[:, 0], rows[:, 3]):
            slow = decodes[p] > 0 and durations[p] > scenario.slo_itl_s
            if chunks >= 2:
                many, slow_many = many + 1, slow_many + slow
            elif chunks == 1:
                one, slow_one = one + 1, slow_one + slow
    return many, slow_many / max(many, 1), one, slow_one / max(one, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="agent-90,conversation-8")
    ap.add_argument("--rules", default="time-budget-slack,time-budget-deadline,time-budget")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    print("| scenario | rule | capacity, priced with the next prefixes (req/s) | head only | "
          "head only against it | passes with 2+ chunks over the target: with / head only | "
          "with 1 chunk: with / head only |")
    print("|---|---|---:|---:|---:|---|---|")
    for name in args.scenarios.split(","):
        scenario = PREFIX[name]
        for spec in args.rules.split(","):
            full, twin = make_policy(spec, scenario), head_only(spec, scenario)
            found = capacities(scenario, [full, twin], args.seeds, 600)
            a, b = (np.array(found[p.name].per_stream) for p in (full, twin))
            ratio = float(np.mean(b / a - 1))
            load = float(np.mean(found[full.name].factors))
            mine, theirs = passes_over(scenario, full, load, args.seeds), passes_over(scenario, twin, load,
                                                                                    args.seeds)
            print(f"| {name} | {spec} | {a.mean():.2f} | {b.mean():.2f} | {100 * ratio:+.1f}% | "
                  f"{100 * mine[1]:.1f}% of {mine[0]} / {100 * theirs[1]:.1f}% of {theirs[0]} | "
                  f"{100 * mine[3]:.1f}% of {mine[2]} / {100 * theirs[3]:.1f}% of {theirs[2]} |",
                  flush=True)


if __name__ == "__main__":
    main()
