"""Forking a simulator: the fork runs ahead, the original is untouched."""

from __future__ import annotations

from envs.engine import fork
from envs.workload import SyntheticSpec
from envs.engine import EngineConfig, Simulator


def test_fork_runs_ahead_without_touching_the_original():
    w = SyntheticSpec(rate=20, num_requests=200).build(0)
    sim = Simulator("h100-sxm", "llama-3-8b", w, EngineConfig(num_kv_blocks=2500, max_num_seqs=32))
    for _ in range(60):
        assert sim.advance()
        sim.step(1024)
    before = (sim.now, sim.pass_index, sim.state().kv_used_blocks, len(sim.waiting), sim.state().running_decodes,
              [r.computed for r in sim.prefilling])
    f = fork(sim)
    f.audit()
    while f.advance():
        f.step(4096)
    assert f.done and f.now > sim.now
    assert (sim.now, sim.pass_index, sim.state().kv_used_blocks, len(sim.waiting), sim.state().running_decodes,
            [r.computed for r in sim.prefilling]) == before
    sim.audit()
    # The original still runs to the same end as a fresh run with the same budgets, and
    # the fork to the same end as a fresh run that switched to 4096 where it was forked.
    while sim.advance():
        sim.step(1024)
    assert sim.done
    # (A fork leaves the requests finished before it behind.)
    forked_at = before[0]
    for ran, switch in ((sim, 1024), (f, 4096)):
        fresh = Simulator("h100-sxm", "llama-3-8b", w, EngineConfig(num_kv_blocks=2500, max_num_seqs=32))
        decisions = 0
        while fresh.advance():
            fresh.step(1024 if decisions < 60 else switch)
            decisions += 1
        assert (fresh.now, fresh.pass_index, fresh.preemptions) == (ran.now, ran.pass_index, ran.preemptions)
        kept = [r for r in fresh.requests if ran is sim or r.finish_s > forked_at]
        assert len(kept) == len(ran.requests) > 150
        assert ([(r.arrival, r.first_token_s, r.finish_s) for r in kept]
                == [(r.arrival, r.first_token_s, r.finish_s) for r in ran.requests])
