"""Prefix caching in the simulator (envs/prefix_cache.py): hand-computed cases, the trace's
block mapping, invariants under random workloads, and what stays as it was with it off."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.engine import EngineConfig, Simulator
from envs.errors import ConfigError
from envs.prefix_cache import PrefixCache, PrefixCounts, units_of
from envs.pricing import pass_price
from envs.workload import BUNDLED_TRACES, Workload, load_trace

HW, MODEL = "h100-sxm", "llama-3-8b"


def workload(rows, block_tokens=16, cover_output=False):
    """rows: (arrival_s, prompt_tokens, output_tokens, ids)."""
    arrival, prompt, output, ids = zip(*rows)
    return Workload(np.array(arrival, dtype=np.float64), np.array(prompt, dtype=np.int64),
                    np.array(output, dtype=np.int64), "test",
                    tuple(np.array(i, dtype=np.int64) for i in ids), block_tokens, cover_output)


def serve(w, budget=8192, blocks=1000, caching=True, record=True, audit=True, max_num_seqs=256):
    sim = Simulator(HW, MODEL, w, EngineConfig(num_kv_blocks=blocks, enable_prefix_caching=caching,
                                               max_num_seqs=max_num_seqs), record_shapes=record)
    while sim.advance():
        sim.step(budget)
        if audit:
            sim.audit()
    return sim


# --- hand-computed cases -------------------------------------------------------------------

def test_a_second_request_reuses_three_full_blocks_and_not_the_partial_one():
    # A: 56 tokens = 3 full blocks and 8 tokens of a fourth; B, after A has finished, the
    # same 56 tokens. B finds A's 3 full blocks (48 tokens); the partial block was never cached.
    ids = [1, 2, 3, 4]
    sim = serve(workload([(0.0, 56, 1, ids), (5.0, 56, 1, ids)]))
    assert sim.prefix_counts == PrefixCounts(2, 1, 112, 48, 48)
    a, b = sim.shapes[0], sim.shapes[-1]
    assert tuple(a) == (0, 0, 56, 0, 56 * 57 // 2)
    # B's one chunk: its 8 new tokens, reading the 48 cached ones as their prefix
    assert tuple(b) == (0, 0, 8, 48, 8 * 48 + 8 * 9 // 2)
    durations = sim.pass_durations()
    assert durations[-1] == pytest.approx(pass_price(sim.cost, 0, 0, 8, 48, 8 * 48 + 36))
    summary = sim.result().summary()
    assert summary["prefix_hit_rate_requests"] == 0.5
    assert summary["prefix_hit_rate_tokens"] == 48 / 112
    assert summary["prefill_tokens_saved"] == 48


def test_the_state_counts_a_waiting_request_s_cached_tokens_out():
    # B arrives after A, with A's 48 cached tokens: before B's first pass, its head and the
    # queue read only its 8 uncached tokens as prefill to do, and its chunk's prefix is 48.
    ids = [1, 2, 3, 4]
    sim = Simulator(HW, MODEL, workload([(0.0, 56, 1, ids), (5.0, 56, 1, ids), (5.0, 40, 1, [9, 8, 7])]),
                    EngineConfig(num_kv_blocks=1000))
    seen = []

    def policy(state):
        seen.append((state.waiting_prefill_tokens, state.head_prefilled_tokens,
                     state.head_remaining_tokens, state.head_cached_tokens))
        return 8192

    sim.run(policy)
    assert seen[0] == (56, 0, 56, 0)  # A: nothing cached yet
    assert seen[1] == (8 + 40, 48, 8, 48)  # B (48 of 56 cached) and a new 40-token prompt
    sim.audit()


def test_the_state_lists_the_prefills_after_the_head_with_their_cached_prefixes():
    # A caches 48 tokens; B, C and D arrive after it with the same 48 cached and 8, 8 and 24
    # to prefill, E with nothing cached: behind the waiting head B the pass would reach C,
    # D and E, each reading its own cached prefix. A budget of 4 leaves B in prefill:
    # then the waiting ones behind it follow it.
    ids = [1, 2, 3, 4]
    rows = [(0.0, 56, 1, ids), (5.0, 56, 1, ids), (5.0, 56, 1, ids), (5.0, 72, 1, ids + [5]),
            (5.0, 40, 1, [9, 8, 7])]
    sim = Simulator(HW, MODEL, workload(rows), EngineConfig(num_kv_blocks=1000))
    seen = []

    def policy(state):
        seen.append(state.next_prefills)
        return 8192 if len(seen) == 1 else 4

    sim.run(policy)
    assert seen[0] == ()  # A alone
    assert seen[1] == ((48, 8), (48, 24), (0, 40))  # B waiting at the head: C, D, E
    assert seen[2] == ((48, 8), (48, 24), (0, 40))  # B in prefill: the same three wait
    off = Simulator(HW, MODEL, workload(rows), EngineConfig(num_kv_blocks=1000,
                                                            enable_prefix_caching=False))
    off.run(lambda state: seen.append(state.next_prefills) or 8192)
    assert seen[-1] == ()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    # 64 tokens = 4 full blocks, all cached by A: B may hit only the blocks before its last
    # token (vLLM's max_cache_hit_length), so it recomputes the last block's 16 tokens.
    ids = [1, 2, 3, 4]
    sim = serve(workload([(0.0, 64, 1, ids), (5.0, 64, 1, ids)]))
    assert sim.prefix_counts.first_cached_tokens == 48
    assert tuple(sim.shapes[-1])[2:4] == (16, 48)


def test_only_full_blocks_hit_when_the_cached_prefix_ends_inside_a_block():
    # A has 40 tokens (2 full blocks and 8 tokens under id 3); B shares those 40 tokens and
    # goes on. B hits 2 blocks (32 tokens), not 40, and its prefill is chunked from there.
    sim = serve(workload([(0.0, 40, 1, [1, 2, 3]), (5.0, 100, 1, [1, 2, 3, 9, 10, 11, 12])]),
                budget=16)
    assert sim.prefix_counts.first_cached_tokens == 32
    chunks = [tuple(s)[2:4] for s in sim.shapes if s.prefill_tokens][-5:]
    assert chunks == [(16, 32), (16, 48), (16, 64), (16, 80), (4, 96)]


def test_a_block_shared_by_two_running_requests_is_in_the_pool_once():
    # A decodes for a long time; B arrives meanwhile with the same 48-token prefix.
    w = workload([(0.0, 50, 400, [1, 2, 3, 4]), (0.5, 50, 400, [1, 2, 3, 5])])
    sim = Simulator(HW, MODEL, w, EngineConfig(num_kv_blocks=1000))
    while sim._num_decodes < 2:
        sim.advance()
        sim.step(8192)
    assert sim.prefix_counts.first_cached_tokens == 48
    assert sim._prefix.shared_blocks() == 3
    a, b = sim.requests[0], sim.requests[1]
    held = [-(-(r.offset + sim.pass_index) // 16) for r in (a, b)]
    assert sim._kv_used == sum(held) - 3
    sim.audit()


def test_eviction_takes_the_least_recently_freed_tail_first():
    cache = PrefixCache(10)
    # ids 1 and 2 consecutive (one unit of 2 blocks), then 5 and 9 (a unit each)
    a = units_of(np.array([1, 2, 5, 9]), 16, 64, 16, rid=0, blocks=4)
    assert (a.keys, a.sizes) == ([1, 5, 9], [2, 1, 1])
    held, done = [], []
    cache.fill(a, held, done, 4)
    cache.settle(4)
    assert cache.blank == 6
    assert cache.release(a, held, done, 4, 4) == 4  # tail first: 9, 5, then 2 and 1
    cache.settle(0)
    assert list(cache.queue.values()) == [[9, 0, 1], [5, 0, 1], [1, 0, 2]]
    cache.settle(9)  # 9 blocks in use by others: the 6 blank ones, then 9, 5 and block 2
    assert cache.blank == 0 and cache.evicted == 3
    assert list(cache.queue.values()) == [[1, 0, 1]]
    assert cache.hits(a, 4) == (1, 1)  # block 1 is left, in the queue
    cache.check(9)


def test_a_hit_on_a_queued_block_takes_it_out_of_the_queue():
    cache = PrefixCache(100)
    a = units_of(np.array([7]), 512, 512, 16, rid=0, blocks=32)  # one unit of 32 blocks
    assert a.keys == [7 * 32]
    held, done = [], []
    cache.fill(a, held, done, 32)
    cache.settle(32)
    cache.release(a, held, done, 32, 32)
    cache.settle(0)
    b = units_of(np.array([7]), 512, 160, 16, rid=1, blocks=10)  # the unit's first 10 blocks
    assert cache.hits(b, 10) == (10, 10)
    hb, db = [], []
    cache.acquire(b, 10, hb, db)
    assert cache.queued == 22  # blocks 10-31 are still free, cached
    cache.check(10)
    cache.settle(10 + 68 + 5)  # allocations take the 68 blank ones, then 5 of unit 7's top
    assert cache.units[7 * 32][0] == 27 and cache.queued == 17
    cache.check(10 + 68 + 5)


def test_a_preempted_request_resumes_on_its_own_cached_blocks():
    # Two 200-token prompts decoding in 40 blocks: the KV cache runs out, the later one is
    # preempted, and its recomputation finds its blocks (prompt and decoded) still cached.
    rows = [(0.0, 200, 300, list(range(1, 14))), (0.01, 200, 300, list(range(101, 114)))]
    on = serve(workload(rows), blocks=40)
    off = serve(workload(rows), blocks=40, caching=False)
    assert on.preemptions >= 1 and off.preemptions >= 1
    counts = on.prefix_counts
    assert (counts.first_admissions, counts.first_prompt_tokens, counts.first_cached_tokens) == (2, 400, 0)
    cached_all = counts.cached_tokens
    assert cached_all > 0  # the resumption's hit
    computed = sum(s.prefill_tokens for s in on.shapes)
    recomputed = sum(r.recomputed for r in on.requests)
    assert computed == 400 + recomputed - cached_all
    assert on.now < off.now


# --- the trace's blocks ----------------------------------------------------------------------

def test_512_token_trace_blocks_map_to_32_kv_blocks_each():
    # id 7: KV blocks 0-31, numbered 7 * 32 + place; id 9: its 88 tokens hold 5 full KV
    # blocks; then the request's own unit
    u = units_of(np.array([7, 9]), 512, 600, 16, rid=3, blocks=40)
    assert (u.keys, u.starts, u.sizes) == ([224, 288, -4], [0, 32, 37], [32, 5, 3])
    # consecutive ids run on: one unit
    u = units_of(np.array([7, 8]), 512, 600, 16, rid=3, blocks=37)
    assert (u.keys, u.starts, u.sizes) == ([224], [0], [37])
    # a KV block larger than the ids' blocks is named by the last id it reaches
    u = units_of(np.array([1, 2, 3, 4]), 512, 2048, 1024, rid=0, blocks=2)
    assert (u.keys, u.sizes) == ([2], [2])
    u = units_of(np.array([1, 2, 3, 7]), 512, 2048, 1024, rid=0, blocks=2)
    assert (u.keys, u.sizes) == ([2, 7], [1, 1])
    with pytest.raises(ConfigError, match="hash_block_tokens: got 500"):
        units_of(np.array([1]), 500, 500, 16, rid=0, blocks=31)


def independent_leading_reuse(path):
    """Over the trace in arrival order: each prompt's leading run of ids seen before, in
    ids and in tokens (512 a hit id, at most the prompt)."""
    seen, hit_ids, ids_total, hit_tokens, tokens = set(), 0, 0, 0, 0
    with open(path) as f:
        for row in csv.DictReader(f):
            ids, p = row["block_hashes"].split(), int(row["prompt_tokens"])
            run = 0
            while run < len(ids) and ids[run] in seen:
                run += 1
            hit_ids += run
            ids_total += len(ids)
            hit_tokens += min(run * 512, p)
            tokens += p
            seen.update(ids)
    return hit_ids / ids_total, hit_tokens / tokens


def test_the_blocks_trace_hits_what_an_independent_count_finds_with_an_unbounded_pool():
    blocks, tokens = independent_leading_reuse(BUNDLED_TRACES / "mooncake_synthetic_blocks.csv")
    assert round(blocks, 3) == 0.640 and round(tokens, 3) == 0.651
    w = load_trace("mooncake_synthetic_blocks")
    sim = Simulator(HW, "llama-3-70b-tp4", w, EngineConfig(num_kv_blocks=2**26))
    summary = sim.run(lambda s: 8192).summary()
    assert abs(summary["prefix_hit_rate_tokens"] - tokens) < 0.005


@pytest.mark.parametrize("hash_block_tokens", [16, 512])
def test_units_are_the_runs_of_consecutive_block_numbers_for_long_id_lists(hash_block_tokens):
    """Past 64 ids the runs are found with numpy: the same units as numbering every KV
    block and cutting where the numbers stop going up by one."""
    per = hash_block_tokens // 16
    rng = np.random.default_rng(1)
    for n_ids in (3, 64, 65, 70, 300):
        starts = np.cumsum(rng.integers(1, 12, n_ids)) * 1000
        runs = np.sort(rng.choice(np.arange(1, n_ids), size=min(5, n_ids - 1), replace=False))
        ids = np.arange(n_ids) + np.repeat(starts[:len(runs) + 1], np.diff([0, *runs, n_ids]))
        covered = n_ids * hash_block_tokens - 5  # the last id's block is partial
        blocks = covered // 16 + 7  # and decodes write 7 more
        units = units_of(ids, hash_block_tokens, covered, 16, 42, blocks)
        numbers = [int(ids[j // per]) * per + j % per for j in range(covered // 16)]
        expected_keys, expected_starts = [numbers[0]], [0]
        for j in range(1, len(numbers)):
            if numbers[j] != numbers[j - 1] + 1:
                expected_keys.append(numbers[j])
                expected_starts.append(j)
        ends = [*expected_starts[1:], len(numbers)]
        assert units.keys == [*expected_keys, -43]
        assert units.starts == [*expected_starts, len(numbers)]
        assert units.sizes == [e - b for b, e in zip(expected_starts, ends)] + [blocks - len(numbers)]


def test_block_ids_must_be_integers_and_match_the_block_size(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens,block_hashes\n0,600,5,1 x\n")
    with pytest.raises(ConfigError, match=r"line 2: block_hashes: got '1 x'"):
        load_trace(bad)
    bad.write_text("arrival_s,prompt_tokens,output_tokens,block_hashes\n0,600,5,1 2 3\n")
    with pytest.raises(ConfigError, match="trace_block_tokens: got 512, but request 0"):
        load_trace(bad)
    assert load_trace(bad, block_tokens=256).hash_block_tokens == 256


# --- with it off, and without block ids -----------------------------------------------------

def same_run(a, b):
    ra, rb = a.result(), b.result()
    return (np.array_equal(ra.first_token_s, rb.first_token_s) and np.array_equal(ra.finish_s, rb.finish_s)
            and np.array_equal(a.pass_durations(), b.pass_durations()))


def test_off_serves_the_blocks_trace_as_the_trace_without_ids():
    with_ids = load_trace("mooncake_synthetic_blocks", max_requests=300)
    without = load_trace("mooncake_synthetic", max_requests=300)
    off = Simulator(HW, "llama-3-70b-tp4", with_ids, EngineConfig(enable_prefix_caching=False))
    plain = Simulator(HW, "llama-3-70b-tp4", without)
    off.run(lambda s: 4096)
    plain.run(lambda s: 4096)
    assert same_run(off, plain)
    assert "prefix_hit_rate_tokens" not in off.result().summary()


# --- invariants -------------------------------------------------------------------------------

@st.composite
def shared_prefix_workloads(draw):
    n = draw(st.integers(2, 24))
    block_tokens = draw(st.sampled_from([16, 32, 8]))
    rows, t = [], 0.0
    for i in range(n):
        t += draw(st.floats(0, 0.3))
        prompt = draw(st.integers(1, 300))
        ids_needed = -(-prompt // block_tokens)
        family = draw(st.integers(0, 3))
        shared = draw(st.integers(0, ids_needed))
        ids = [family * 1000 + j for j in range(shared)] + [10**6 + i * 1000 + j
                                                           for j in range(ids_needed - shared)]
        rows.append((t, prompt, draw(st.integers(1, 200)), ids))
    return workload(rows, block_tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=shared_prefix_workloads(), blocks=st.integers(32, 120), budget=st.integers(16, 400),
       seqs=st.integers(1, 8))
def test_invariants_hold_pass_by_pass(w, blocks, budget, seqs):
    """No block both free and in use (the pool's count against the cache's, audited every
    pass); cached tokens are never scheduled: every prompt token of every admission is
    cached or computed, once; and every request finishes."""
    sim = serve(w, budget=max(budget, seqs), blocks=blocks, max_num_seqs=seqs)
    assert sim.finished == len(w)
    computed = sum(s.prefill_tokens for s in sim.shapes)
    recomputed = sum(r.recomputed for r in sim.requests)
    assert computed == int(w.prompt_tokens.sum()) + recomputed - sim.prefix_counts.cached_tokens
    assert 0 <= sim.prefix_counts.first_cached_tokens <= sim.prefix_counts.first_prompt_tokens == int(w.prompt_tokens.sum())


def test_a_fork_carries_its_own_cache():
    w = load_trace("mooncake_synthetic_blocks", max_requests=120)
    sim = Simulator(HW, "llama-3-70b-tp4", w, EngineConfig(num_kv_blocks=20000))
    for _ in range(60):
        sim.advance()
        sim.step(2048)
    fork = sim.fork()
    fork.run(lambda s: 2048)
    sim.run(lambda s: 2048)
    assert fork.prefix_counts == sim.prefix_counts
    assert fork.now == sim.now


@pytest.mark.parametrize("spec", ["time-budget-slack", "time-budget-deadline"])
def test_a_rule_and_its_table_price_the_next_requests_cached_prefixes_alike(spec):
    """Agents whose instructions are nine tenths of each prompt, at three times the
    scenario's load: passes that reach past the head admit requests that each re-read
    their cached instructions. The rule and its exported table give the same budget at
    every pass, and on some passes a pass within the ITL target is priced below what the
    head's prefix alone would allow."""
    from envs.pricing import state_budget, time_budget
    from envs.scenario import Scenario
    from eval.export.rules import rule_table
    from policies.specs import make_policy
    from policies.table import BudgetTable
    from policies.table_policy import TablePolicy

    sc = Scenario(hardware="h100-sxm", model="llama-3-8b", rate=24.0, num_requests=150,
                  prompt="uniform:64:1024", sharing="agent:0.9:8")
    made = rule_table(spec, sc, sc.stream(0, 1, 7, 60))
    table = TablePolicy(BudgetTable(made.to_dict()))
    rule = make_policy(spec, sc)
    sim = sc.simulator(sc.stream(0, 1, 11))
    cut = 0
    while sim.advance():
        state = sim.state()
        want = rule(state)
        assert table(state) == want
        alone = time_budget(state.cost, state.running_decodes, state.decode_context_tokens,
                            state.head_prefilled_tokens, sc.slo_itl_s, rule.cap)
        cut += state_budget(state.cost, state, sc.slo_itl_s, rule.cap) < alone
        sim.step(want)
    assert sim.prefix_counts.first_cached_tokens > 0 and cut > 0


@pytest.mark.parametrize("threshold", [0, 48])
def test_the_vllm_count_of_the_cache_state_is_the_simulator_s(threshold):
    """envs.state.read_requests over the simulator's requests as vLLM holds them, its cache
    lookups answered as the adapter answers them, gives the simulator's state before every
    pass: the head's cached prefix and the prefills after it, in prefill (several, with a
    per-request chunk cap) and waiting, with preemptions on a tight cache."""
    from envs.scenario import Scenario
    from envs.state import read_requests
    from tests.test_state import as_vllm

    sc = Scenario(hardware=HW, model=MODEL, rate=40.0, num_requests=120, prompt="uniform:64:1024",
                  sharing="agent:0.8:3")
    sim = Simulator(HW, MODEL, sc.stream(0, 1, 3), EngineConfig(
        num_kv_blocks=700, long_prefill_token_threshold=threshold))
    names = ("head_prefilled_tokens", "head_remaining_tokens", "head_cached_tokens",
             "waiting_prefill_tokens", "next_prefills")
    seen = {"running later": 0, "waiting later cached": 0}
    rng = np.random.default_rng(0)
    while sim.advance():
        state = sim.state()
        live = {r.rid: r for r in (*sim.waiting, *sim.prefilling)}

        def cached(request, when):
            r = live[request.request_id]
            if when == "now":
                return sim.waiting_head_hit()
            return r.first_cached_tokens if when == "at admission" else r.joined_cached_tokens

        running, waiting = as_vllm(sim)
        got = read_requests(running, waiting, sim.now, names, cached)
        assert {n: got[n] for n in names} == {n: state[n] for n in names}
        seen["running later"] += len(sim.prefilling) > 1
        seen["waiting later cached"] += any(c for c, _ in state.next_prefills)
        sim.step(state.running_decodes + int(rng.choice([16, 200, 2048])))
    assert seen["waiting later cached"] and (seen["running later"] or not threshold), seen
    assert sim.preemptions > 0
