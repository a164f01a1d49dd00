"""One engine-state vocabulary (envs.state): the simulator's fast running sums report what
the vocabulary's own counting reports over the same requests, held as vLLM holds them.

At every decision of random runs (KV pressure and preemptions, chunk caps, idle spells,
partial prefills) the simulator's requests are turned into faithful fakes of vLLM's
``Request`` objects (vLLM's counter names; a request in the simulator's prefilling list
is one whose last scheduled chunk left work: vLLM's ``is_prefill_chunk``), and
``envs.state.read_requests`` over them, the function the vLLM adapter calls every step,
must give exactly the simulator's ``SchedulerState``. The slack counts: the engine's
``StepSlack``, told of every pass as it completes, against the simulator's count from its
pass log. The same over real vLLM objects: tests/engine_vllm/test_state.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.engine import Simulator
from envs.slack import StepSlack
from envs.state import BY_NAME, QUANTITIES, SLACK_COUNTS, TABLE_INPUTS, read_requests
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL
from tests.strategies import engine_workloads

REQUEST_COUNTED = [n for n in TABLE_INPUTS if n not in SLACK_COUNTS + ("kv_usage", "last_step_s")]


def as_vllm(sim: Simulator) -> tuple[list, list]:
    """(running in admission order, waiting in queue order) as vLLM ``Request``-like objects."""
    p = sim.pass_index

    def fake(r, prefilling: bool):
        if r.rid in sim._decodes:  # a decode's counters are kept lazily: bring them to pass p
            computed, output = r.offset + p, r.generated_at_start + p - r.decode_start
        else:
            computed, output = r.computed, r.generated
        return SimpleNamespace(request_id=r.rid, num_prompt_tokens=r.prompt, num_output_tokens=output,
                               num_tokens=r.prompt + output, num_computed_tokens=computed,
                               arrival_time=r.arrival, is_prefill_chunk=prefilling)

    running = sorted([(r, False) for r in sim._decodes.values()] + [(r, True) for r in sim.prefilling],
                     key=lambda rp: rp[0].admit_seq)
    return [fake(r, pre) for r, pre in running], [fake(r, False) for r in sim.waiting]


@st.composite
def runs(draw):
    workload, cfg = draw(engine_workloads((2, 25), [0.0, 0.0, 0.01, 0.1, 0.5, 3.0], 1200, 150, 3, 10,
                                          [0, 0, 48, 300]))
    extra = draw(st.lists(st.sampled_from([0, 1, 7, 64, 400, 4096]), min_size=1, max_size=6))
    return workload, cfg, extra


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_simulator_state_is_the_vocabulary_s_count_over_its_requests(run):
    workload, cfg, extra = run
    sim = Simulator(TOY_HW, TOY_MODEL, workload, cfg)
    itl = 0.004
    engine, mark, i = None, 0, 0
    seen = {"preempted": 0, "recomputing": 0, "partial": 0, "without_first": 0}
    while sim.advance():
        state = sim.state()
        running, waiting = as_vllm(sim)
        got = read_requests(running, waiting, sim.now, TABLE_INPUTS)
        for name in REQUEST_COUNTED:
            assert got[name] == state[name], (name, got[name], state[name])
        # The engine's slack count, told of each pass as it completes, is the simulator's.
        durations, decodes = sim.pass_records(mark) if engine else (np.zeros(0), np.zeros(0))
        mark = sim.pass_index
        if engine is None:
            engine = StepSlack(itl, sim.now)
        for d, k in zip(durations, decodes):
            engine.step_done(float(d), int(k))
        mine, its = engine.read(sim.now), state.itl_slack(itl)
        assert (mine.slow, mine.tokens) == (its.slow, its.tokens)
        seen["preempted"] += sim.preemptions > 0
        seen["recomputing"] += any(r.generated and r.computed for r in sim.prefilling)
        seen["partial"] += any(r.computed for r in sim.prefilling)
        seen["without_first"] += state.oldest_wait_s > 0
        sim.step(max(state.running_decodes, 1) + extra[i % len(extra)])
        i += 1


def test_the_random_runs_reach_the_cases_that_tell_definitions_apart():
    """The runs above meet preemptions, recomputations in progress, partial prefills beside
    decodes and idle spells (a test that never met them could not tell a wrong definition)."""
    from hypothesis import find

    def reaches(case):
        def ok(run):
            workload, cfg, extra = run
            sim = Simulator(TOY_HW, TOY_MODEL, workload, cfg)
            i = 0
            while sim.advance():
                if case(sim):
                    return True
                sim.step(max(sim.state().running_decodes, 1) + extra[i % len(extra)])
                i += 1
            return False
        return ok

    for case in (lambda s: any(r.generated and r.computed for r in s.prefilling),  # recomputing
                 lambda s: s._decodes and any(r.computed for r in s.prefilling),  # partial beside decodes
                 lambda s: s.waiting and s.waiting[0].generated and s.state().oldest_wait_s == 0):
        find(runs(), reaches(case), settings=settings(max_examples=400, deadline=None))


def test_the_simulator_state_offers_every_quantity_of_the_vocabulary():
    sim = Simulator(TOY_HW, TOY_MODEL, Workload.from_arrays([0.0], [10], [3]))
    assert sim.advance()
    state = sim.state()
    for q in QUANTITIES:
        if q.name not in SLACK_COUNTS:
            assert state[q.name] is not None, q.name
    assert set(state.as_dict()) == {q.name for q in QUANTITIES} - set(SLACK_COUNTS)
    assert all(BY_NAME[n].unit and BY_NAME[n].counting for n in TABLE_INPUTS)


def test_oldest_wait_is_that_of_the_oldest_request_without_a_first_token():
    """A preempted request has had its first token: its wait is not a TTFT at stake. Three
    requests on a cache that holds two: the latest admitted is preempted while both others
    decode, and waits at the queue's head with its TTFT behind it; the oldest wait is then
    the fourth's, which has no token yet (0 before it arrives)."""
    from tests.conftest import make_sim

    sim = make_sim([(0.0, 64, 40), (0.0, 64, 40), (0.0, 64, 40), (0.5, 64, 4)], budget_blocks=14)
    checked = 0
    while sim.advance():
        state = sim.state()
        head = sim.waiting[0] if sim.waiting else None
        if head is not None and head.generated:  # a preempted request waits at the head
            fresh = [r for r in list(sim.waiting) + sim.prefilling if not r.generated]
            want = sim.now - min(r.arrival for r in fresh) if fresh else 0.0
            assert state.oldest_wait_s == pytest.approx(want)
            assert state.oldest_wait_s < sim.now - head.arrival
            checked += 1
        sim.step(max(state.running_decodes, 1) + 64)
    assert checked and sim.preemptions


def test_the_serving_guide_holds_the_vocabulary_as_defined():
    """docs/serving.md's table of what the scheduler reads is envs.state's, regenerated."""
    from pathlib import Path

    from envs.state import markdown
    guide = (Path(__file__).resolve().parent.parent / "docs/serving.md").read_text()
    assert markdown() in guide
