"""The scheduler: vLLM V1 semantics on hand-traced cases, KV pressure, budgets, speed paths."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from envs.cost import PassShape, price, price_pass
from envs.engine import EngineConfig, Simulator, check_static_budget
from envs.errors import ConfigError
from envs.profiles import get_hardware, get_model
from envs.workload import SyntheticSpec
from tests.conftest import TOY_HW, TOY_MODEL, make_sim


def run_static(sim: Simulator, budget: int):
    return sim.run(lambda state: budget)


def test_one_request_chunked_then_decoded_by_hand():
    # 1,000-token prompt, budget 512: chunks (512, prefix 0) and (488, prefix 512); the
    # first token comes at the end of the second pass; two decode passes follow.
    sim = make_sim([(0.0, 1000, 3)])
    res = run_static(sim, 512)
    assert sim.shapes == [
        PassShape.of([], [(512, 0)]),
        PassShape.of([], [(488, 512)]),
        PassShape.of([1000]),
        PassShape.of([1001]),
    ]
    d = [price_pass(TOY_HW, TOY_MODEL, [], [(512, 0)]).total_s,
         price_pass(TOY_HW, TOY_MODEL, [], [(488, 512)]).total_s,
         price_pass(TOY_HW, TOY_MODEL, [1000]).total_s,
         price_pass(TOY_HW, TOY_MODEL, [1001]).total_s]
    assert res.ttft_s[0] == pytest.approx(d[0] + d[1])
    assert res.finish_s[0] == pytest.approx(sum(d))
    assert res.tpot_s[0] == pytest.approx((d[2] + d[3]) / 2)
    assert res.max_gap_s[0] == pytest.approx(max(d[2], d[3]))
    assert res.pass_budget.tolist() == [512, 512, -1, -1]
    assert res.pass_decodes.tolist() == [0, 0, 1, 1]


def test_decodes_go_first_then_the_waiting_prompt_fills_the_rest():
    # A is decoding when B arrives; budget 300 gives A its token and B a 299-token chunk.
    sim = make_sim([(0.0, 100, 50), (0.0101, 1000, 2)])
    run_static(sim, 300)
    mixed = [s for s in sim.shapes if s.num_decodes and s.prefill_tokens]
    assert mixed[0].num_decodes == 1 and mixed[0].prefill_tokens == 299
    assert mixed[1].prefill_tokens == 299 and mixed[1].prefill_prefix_tokens == 299


def test_partial_prefill_continues_before_new_arrivals_are_admitted():
    sim = make_sim([(0.0, 1000, 2), (0.0, 1000, 2)])
    run_static(sim, 600)
    # Pass 0: A gets 600; pass 1: A's remaining 400 first, then B gets 200.
    assert sim.shapes[0] == PassShape.of([], [(600, 0)])
    assert sim.shapes[1] == PassShape.of([], [(400, 600), (200, 0)])


def test_long_prefill_token_threshold_caps_each_request():
    sim = make_sim([(0.0, 1000, 2), (0.0, 1000, 2)], long_prefill_token_threshold=128)
    run_static(sim, 512)
    assert sim.shapes[0] == PassShape.of([], [(128, 0), (128, 0)])


def test_a_lone_request_is_not_capped():
    # vLLM lifts the cap when one request is running or waiting: nobody to starve. The
    # second request arrives after the first has finished, and is alone too.
    sim = make_sim([(0.0, 1000, 2), (5.0, 300, 2)], long_prefill_token_threshold=128)
    run_static(sim, 512)
    prefills = [s.prefill_tokens for s in sim.shapes if s.prefill_tokens]
    assert prefills == [512, 488, 300]


def test_a_request_is_admitted_only_when_its_whole_prompt_fits():
    # Cache of 10 blocks. A (100-token prompt, 7 blocks) decodes; B's 80-token prompt
    # needs 5 blocks in all, though its first 32-token chunk needs only 2: as vLLM
    # (scheduler_reserve_full_isl) B waits until A finishes and frees its blocks.
    sim = make_sim([(0.0, 100, 6), (0.0015, 80, 2)], budget_blocks=10)
    while sim.advance():
        sim.step(132 if sim.pass_index == 0 else 32)
    a, b = sim.requests
    ends = sim.result().pass_end_s
    first_b = next(i for i, s in enumerate(sim.shapes) if i > 0 and s.prefill_tokens)
    assert ends[first_b - 1] == a.finish_s  # B's first chunk runs once A is gone
    assert sim.shapes[first_b].prefill_tokens == 32


def test_max_num_seqs_limits_admission():
    sim = make_sim([(0.0, 10, 20)] * 3, max_num_seqs=2)
    run_static(sim, 512)
    assert sim.shapes[0].prefill_tokens == 20  # two prompts admitted, the third waits
    res = sim.result()
    assert res.finished.all()
    assert res.first_token_s[2] > res.first_token_s[0]


def test_preemption_of_the_most_recent_request_and_recompute():
    # Cache of 5 blocks (80 tokens). A and B (30-token prompts) both fit (2 blocks each);
    # at their 33rd token both need a third block: B, admitted last, is preempted and
    # waits until A has finished, then recomputes its prompt plus its 3 output tokens.
    sim = make_sim([(0.0, 30, 40), (0.0, 30, 40)], budget_blocks=5)
    res = run_static(sim, 256)
    a, b = sim.requests
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert res.total_preemptions == 1
    assert b.finish_s > a.finish_s
    recompute = [s for s in sim.shapes if s.prefill_tokens and s is not sim.shapes[0]]
    assert recompute[0].prefill_tokens == 30 + 3
    assert len(b.resume_gaps) == 1 and b.resume_gaps[0] > 0
    assert res.max_gap_s[1] == pytest.approx(b.resume_gaps[0])
    assert a.generated == 40 and b.generated == 40


def test_preempted_request_goes_to_the_front_of_the_queue():
    # A and B (30-token prompts, 2 blocks each) run in a 5-block cache; C (17 tokens, 2
    # blocks) arrives after them and waits for the one free block to become two. In pass 3
    # A and B both need a third block: B, admitted last, is preempted and goes to the front
    # of the queue, ahead of C, which arrived before the preemption.
    sim = make_sim([(0.0, 30, 40), (0.0, 30, 40), (0.004, 17, 2)], budget_blocks=5)
    preempting = None
    while sim.advance():
        before = sim.preemptions
        sim.step(256)
        if sim.preemptions > before and preempting is None:
            preempting = sim.pass_index - 1
            a, b, c = sim.requests
            assert b.preemptions == 1 and b.computed == 0
            assert list(sim.waiting) == [b, c]
    assert preempting == 3
    a, b, c = sim.requests
    # Nothing is prefilled until A finishes and frees its blocks; then B's prompt and its 3
    # tokens are recomputed and C admitted behind it, in one pass.
    ends = sim.result().pass_end_s
    recompute = next(i for i, s in enumerate(sim.shapes) if i > preempting and s.prefill_tokens)
    assert ends[recompute - 1] == a.finish_s
    assert sim.shapes[recompute].prefill_tokens == (30 + 3) + 17
    assert c.first_token_s == ends[recompute] and len(b.resume_gaps) == 1


def test_a_preempted_request_waits_until_its_whole_sequence_fits():
    # A and B (30-token prompts) grow to a third block each in a 5-block cache; C waits
    # behind them, so that every pass asks for a budget. B, admitted last, is preempted
    # in the pass where both need that block. Its first 16-token chunk would fit in the
    # two blocks its preemption leaves free, but its 33 tokens need three: as vLLM
    # (scheduler_reserve_full_isl) it waits until A finishes, instead of being admitted
    # and evicted again, and nothing behind it is admitted meanwhile.
    sim = make_sim([(0.0, 30, 40), (0.0, 30, 40), (0.003, 17, 2)], budget_blocks=5,
                   long_prefill_token_threshold=16)
    preempting_passes = 0
    while sim.advance():
        before, waiting = sim.preemptions, set(map(id, sim.waiting))
        sim.step(256)
        if sim.preemptions > before:
            preempting_passes += 1
            preempted_in = sim.pass_index - 1
            a, b, c = sim.requests
            assert list(sim.waiting) == [b, c] and b.computed == 0 and waiting <= set(map(id, sim.waiting))
            assert sim.shapes[-1].prefill_tokens == 0
            assert sim.total_blocks - sim.state().kv_used_blocks == 2
    assert preempting_passes == 1
    a, b, c = sim.requests
    ends = sim.result().pass_end_s
    resumed = next(i for i, s in enumerate(sim.shapes) if i > preempted_in and s.prefill_tokens)
    assert ends[resumed - 1] == a.finish_s
    assert all(r.generated == r.output for r in sim.requests) and b.preemptions == 1


def test_kv_usage_never_exceeds_capacity_under_pressure():
    w = SyntheticSpec(rate=50, num_requests=200, prompt="uniform:100:2000",
                      output="uniform:10:300").build(3)
    sim = Simulator(TOY_HW, TOY_MODEL, w, EngineConfig(num_kv_blocks=400, max_num_seqs=32))
    res = sim.run(lambda s: 1024)
    assert res.total_preemptions > 0
    assert res.kv_used_blocks.max() <= 400
    assert res.finished.all()


def test_budget_below_running_decodes_is_refused():
    sim = make_sim([(0.0, 10, 50), (0.0, 10, 50), (0.05, 100, 5)])
    assert sim.advance()
    sim.step(64)
    while sim.advance():
        if sim.state().running_decodes >= 2:
            with pytest.raises(ConfigError, match=r"budget: got 1, must be an integer >= 2"):
                sim.step(1)
            break
        sim.step(64)


def test_step_without_decision_is_an_error():
    sim = make_sim([(0.0, 10, 5)])
    with pytest.raises(RuntimeError):
        sim.step(64)


def test_static_budget_below_max_num_seqs_is_refused():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        check_static_budget(128, EngineConfig(max_num_seqs=256))
    check_static_budget(256, EngineConfig(max_num_seqs=256))


def test_prompt_that_can_never_fit_is_refused():
    with pytest.raises(ConfigError, match=r"prompt_tokens\+output_tokens of request 1: got 2000 tokens of KV cache, must be <= 1600"):
        make_sim([(0.0, 10, 5), (0.0, 1990, 10)], budget_blocks=100)


def test_kv_capacity_from_memory():
    from envs.profiles import H100_SXM, LLAMA_3_8B
    blocks = EngineConfig().kv_blocks(H100_SXM, LLAMA_3_8B)
    expected = (80 * 2**30 * 0.9 - 8.03e9 * 2) / (131072 * 16)
    assert blocks == int(expected)
    with pytest.raises(ConfigError, match="weights need"):
        from envs.profiles import L40S, get_model
        EngineConfig().kv_blocks(L40S, get_model("llama-3-70b-tp4").__class__(
            **{**get_model("llama-3-70b-tp4").__dict__, "tensor_parallel": 1}))


def test_idle_server_jumps_to_the_next_arrival():
    sim = make_sim([(0.0, 100, 2), (10.0, 100, 2)])
    res = run_static(sim, 512)
    assert res.first_token_s[1] == pytest.approx(10.0 + price_pass(TOY_HW, TOY_MODEL, [], [(100, 0)]).total_s)
    assert res.pass_end_s[-1] == pytest.approx(sim.now)


CPU_LIKE = replace(get_hardware("h100-sxm"), name="cpu-like", attention_bandwidth_ratio=0.2,
                   attention_flops_ratio=0.4, overlap=0.25)


# Every refinement of the cost model at once, on a tensor-parallel group.
FITTED_LIKE = replace(get_hardware("h100-sxm-datasheet"), name="fitted-like", overlap=0.4,
                      per_layer_overhead_s=3e-5, elementwise_bytes_per_s=1.4e12,
                      interconnect_bytes_per_s=3.7e11, allreduce_latency_s=1e-5)
TP2 = replace(get_model("llama-3-8b"), name="llama-3-8b-tp2", tensor_parallel=2)


@pytest.mark.parametrize("hardware, model", [("h100-sxm-datasheet", "llama-3-8b"),
                                             (CPU_LIKE, "llama-3-8b"), (FITTED_LIKE, TP2)],
                         ids=["roofline", "partial-overlap", "layers-kernels-allreduce"])
def test_every_simulated_pass_is_priced_by_the_pure_function(hardware, model):
    # Decode stretches are priced in closed form; with partial overlap, slow attention,
    # per-token small kernels and all-reduces they must still equal the per-pass price.
    w = SyntheticSpec(rate=30, num_requests=150).build(7)
    sim = Simulator(hardware, model, w, EngineConfig(num_kv_blocks=3000, max_num_seqs=64),
                    record_shapes=True)
    rng = np.random.default_rng(0)
    while sim.advance():
        sim.step(max(sim.state().running_decodes, 1) + int(rng.choice([0, 64, 512, 2048, 8192])))
    durations = sim.pass_durations()
    expected = np.array([price(sim.roofline, s).total_s for s in sim.shapes])
    assert len(durations) == len(expected)
    np.testing.assert_allclose(durations, expected, rtol=1e-12)
    assert sim.result().total_preemptions > 0


def test_same_seed_same_numbers():
    spec = SyntheticSpec(rate=8, num_requests=300, arrival="gamma", burstiness=0.5)
    runs = []
    for _ in range(2):
        sim = Simulator("h100-sxm", "llama-3-8b", spec.build(11))
        runs.append(sim.run(lambda s: 2048).summary())
    assert runs[0] == runs[1]
    other = Simulator("h100-sxm", "llama-3-8b", spec.build(12)).run(lambda s: 2048).summary()
    assert other != runs[0]


def test_policy_sees_live_state():
    seen = []

    def policy(state):
        seen.append((state.waiting_requests, state.running_decodes, state.waiting_prefill_tokens,
                     state.head_prefilled_tokens, state.head_remaining_tokens))
        return 256

    sim = make_sim([(0.0, 600, 3), (0.0, 100, 3)])
    sim.run(policy)
    assert seen[0] == (2, 0, 700, 0, 600)
    assert seen[1] == (1, 0, 444, 256, 344)  # A partially prefilled (running), B waits


def test_warm_start_running_users_are_excluded_from_metrics():
    sim = make_sim([(0.0, 500, 2)])
    for _ in range(4):
        sim.add_running(100, 1000)
    res = run_static(sim, 2048)
    assert len(res.arrival_s) == 1
    assert sim.shapes[0] == PassShape.of([100] * 4, [(500, 0)])


def test_request_gaps_give_every_token_time():
    sim = make_sim([(0.0, 30, 40), (0.0, 30, 40)], budget_blocks=5)
    res = run_static(sim, 256)
    for i, r in enumerate(sim.requests):
        gaps = sim.request_gaps(i)
        assert len(gaps) == r.output - 1  # one gap between each pair of tokens
        assert res.first_token_s[i] + gaps.sum() == pytest.approx(res.finish_s[i])
        assert gaps.max() == pytest.approx(res.max_gap_s[i])
