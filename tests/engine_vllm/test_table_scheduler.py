"""chunkpilot's table inside vLLM's real V1 scheduler (no model: fake runner outputs)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")


from policies.table import BudgetTable, TableError
from tests.engine_vllm.fixtures import (create_scheduler, fake_clock, fake_output, make_request,
                                        model_dir, table_dict)

# Budget by running decodes: 1,024 with none, 256 with 1-3, 128 with 4 or more.
TABLE = table_dict([("running_decodes", [1, 4]), ("waiting_prefill_tokens", [1])],
                   [64, 1024, 64, 256, 64, 128], default_budget=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("models"))


def expected_budget(table, decoding: set, prompts: dict, done: dict):
    """The table's budget from what the test has seen (no preemption here): the requests
    that have sampled and not finished decode; every other prompt token is still to
    prefill (``done``: prompt tokens scheduled so far)."""
    decodes = len(decoding)
    todo = sum(prompts[r] - done.get(r, 0) for r in prompts if r not in decoding and done.get(r, 0) < prompts[r])
    budget = table.lookup(running_decodes=decodes, waiting_prefill_tokens=todo)
    return max(budget, decodes), decodes


def account(out, runner, decoding: set, done: dict, finished_at: dict, sampled: dict) -> None:
    """Update the test's account with one step: prompt tokens scheduled, tokens sampled."""
    for rid, tokens in out.num_scheduled_tokens.items():
        if rid not in decoding:
            done[rid] = done.get(rid, 0) + tokens
    for rid, toks in zip(runner.req_ids, runner.sampled_token_ids):
        if toks:
            sampled[rid] = sampled.get(rid, 0) + 1
            decoding.add(rid)
            if sampled[rid] == finished_at[rid]:
                decoding.discard(rid)


@pytest.mark.parametrize("cls_name", ["TableScheduler", "AsyncTableScheduler"])
def test_every_step_schedules_what_the_table_says(model, cls_name):
    import policies.vllm_scheduler as vs

    table = BudgetTable(TABLE)
    sched = create_scheduler(getattr(vs, cls_name), model, max_num_batched_tokens=1024,
                             chunkpilot_table=table)
    # Five short requests start decoding, then a 3,000-token prompt arrives among them.
    prompts, finished_at, decoding, done, sampled = {}, {}, set(), {}, {}
    for i in range(5):
        sched.add_request(make_request(f"short{i}", 20, 40))
        prompts[f"short{i}"], finished_at[f"short{i}"] = 20, 40
    long_chunks = []
    for step in range(60):
        if step == 3:
            sched.add_request(make_request("long", 3000, 4))
            prompts["long"], finished_at["long"] = 3000, 4
        want, decodes = expected_budget(table, decoding, prompts, done)
        long = sched.requests.get("long")
        rem_long = long.num_prompt_tokens - long.num_computed_tokens if long else 0
        out = sched.schedule()
        total = sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens == total
        assert total <= want, (step, total, want)
        if rem_long > 0:  # prefill work waits: decodes first, the prompt fills the rest
            assert total == min(want, decodes + rem_long), (step, total, want, decodes, rem_long)
        if "long" in out.num_scheduled_tokens and sched.requests["long"].num_computed_tokens <= 3000:
            long_chunks.append(out.num_scheduled_tokens["long"])
        runner = fake_output(sched, out)
        account(out, runner, decoding, done, finished_at, sampled)
        sched.update_from_output(out, runner)
        assert sched.chunkpilot_history[-1][1] == want
    assert sched.chunkpilot_fallbacks == 0
    # The long prompt was chunked by the table's budget for 5 running decodes (128),
    # i.e. 123 prompt tokens a step, until its last chunk.
    assert sum(long_chunks[:-1]) + long_chunks[-1] >= 3000 - 1
    assert max(long_chunks) <= 128
    assert len(long_chunks) >= 3000 // 128


def test_table_larger_than_the_engine_ceiling_fails_at_load(model):
    from policies.vllm_scheduler import TableScheduler

    with pytest.raises(TableError, match="--max-num-batched-tokens 1024"):
        create_scheduler(TableScheduler, model, max_num_batched_tokens=512,
                         chunkpilot_table=BudgetTable(TABLE))


def test_missing_table_is_a_clear_error(model, monkeypatch):
    from policies.vllm_scheduler import TableScheduler

    monkeypatch.delenv("CHUNKPILOT_TABLE", raising=False)
    with pytest.raises(TableError, match="CHUNKPILOT_TABLE"):
        create_scheduler(TableScheduler, model, max_num_batched_tokens=1024)


def test_time_fraction_table_turns_its_fraction_into_tokens_each_step(model, monkeypatch):
    """A time-fraction table in vLLM's scheduler: each step's budget is the running decodes
    plus the chunk the stored cost model fits in the cell's fraction of the ITL target,
    computed from the scheduler's own queues (decode contexts, the head's prefix)."""
    import policies.vllm_scheduler as vs
    from envs.pricing import Coefficients, time_budget

    data = table_dict([("kv_usage", [0.5])], [1, 1], default_budget=256)
    del data["budgets"]
    cost = {"weights_s": 0.004, "kv_s_per_token": 2e-8, "token_s": 4e-5, "pair_s": 1e-9,
            "exposed": 0.2, "fixed_s": 0.001, "serial_s_per_token": 0.0}
    data.update(action={"kind": "time_fraction", "itl_s": 0.02, "cap": 1024, "cost": cost},
                fractions=[1.0, 0.5])
    table = BudgetTable(data)
    monkeypatch.setenv("CHUNKPILOT_CORRECT_SPEED", "0")  # the stored model's speed: no fake runner has one
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=table)
    for i in range(4):
        sched.add_request(make_request(f"short{i}", 20, 60))
    checked = 0
    coefficients = Coefficients.of(cost)
    for step in range(40):
        if step == 3:
            sched.add_request(make_request("long", 3000, 4))
        fraction = 1.0 if sched.kv_cache_manager.usage < 0.5 else 0.5
        out = sched.schedule()
        state, got = sched.chunkpilot_history[-1]  # what the state means: test_state.py
        n = state["running_decodes"]
        want = time_budget(coefficients, n, state["decode_context_tokens"],
                           state["head_prefilled_tokens"], fraction * 0.02, 1024)
        assert got == max(want, n), (step, got)
        checked += bool(n and state["head_prefilled_tokens"])
        sched.update_from_output(out, fake_output(sched, out))
    assert checked >= 5


COST = {"weights_s": 0.004, "kv_s_per_token": 2e-8, "token_s": 4e-5, "pair_s": 1e-9,
        "exposed": 0.2, "fixed_s": 0.001, "serial_s_per_token": 0.0}
"""A small part's cost coefficients: a 20 ms ITL target holds a few hundred tokens."""


def two_fraction_table(feature: str, edge: float) -> dict:
    """A time-fraction table over one feature: the 20 ms target below ``edge``, 4x it above."""
    data = table_dict([("kv_usage", [0.5])], [1, 1], default_budget=256)
    del data["budgets"]
    data.update(action={"kind": "time_fraction", "itl_s": 0.02, "cap": 1024, "cost": dict(COST)},
                features=[{"name": feature, "edges": [edge]}], fractions=[1.0, 4.0])
    return data


def test_slack_table_counts_slow_tokens_from_step_times(model, monkeypatch):
    """A table over the p99 ITL slack in vLLM's scheduler: each completed step adds its
    decodes to the counts, and to the slow ones when their gap (from the previous step's
    output to this one's, on a fake clock here) was longer than the 20 ms target: a slow
    step, or time the engine spent between two steps while they waited for a token; the
    table spends the slack (4x the target) while 0.8% of the decode tokens cover one more
    slow step: from step 127 (500 tokens, less their decay), then again once the wait is
    paid for (1,000) and once the slow step is (1,500)."""
    import math
    import policies.vllm_scheduler as vs

    data = two_fraction_table("itl_slack_passes", 1.0)
    monkeypatch.setenv("CHUNKPILOT_CORRECT_SPEED", "0")  # 10 ms steps: not this cost model's
    clock = fake_clock(monkeypatch)
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    for i in range(4):
        sched.add_request(make_request(f"short{i}", 20, 500))
    seen, read_at = [], []
    for step in range(420):
        if step == 150:
            clock[0] += 2.0  # 2 s between two steps: the four decodes waited that long
        read_at.append(clock[0])
        out = sched.schedule()
        state, got = sched.chunkpilot_history[-1]
        seen.append((state["itl_slow_tokens"], state["itl_decode_tokens"], got))
        clock[0] += 0.1 if step == 300 else 0.01  # every step takes 10 ms, step 300 takes 100
        sched.update_from_output(out, fake_output(sched, out))
    # Step 0 prefills the four prompts; steps 1 on decode four tokens each. At the start of
    # step k the counts hold steps 0..k-1, each dated at the reading after it, and decay
    # with the time between readings.
    tokens = slow_want = 0.0
    for k in range(1, 420):
        keep = math.exp(-(read_at[k] - read_at[k - 1]) / 300.0)
        tokens = tokens * keep + (4 if k > 1 else 0)
        slow_want = slow_want * keep + (4 if k - 1 in (150, 300) else 0)
        slow, decode_tokens, budget = seen[k]
        assert (slow, decode_tokens) == pytest.approx((slow_want, tokens), rel=1e-9), k
        spend = 0.008 * decode_tokens - slow >= 4  # the slack covers one more slow step of 4
        assert (budget == 1024) == spend, (k, budget)  # 4x the target fills the ceiling, 1x does not
    spent = [k for k in range(1, 420) if seen[k][2] == 1024]
    starts = [k for k in spent if k - 1 not in spent]
    ends = [k for k in spent if k + 1 not in spent]
    assert (starts, ends) == ([127, 253, 379], [150, 300, 419])  # the wait, then the slow step, cost it


def test_due_time_table_reads_the_queue_vllm_holds(model, monkeypatch):
    """A table over prefill_due_s in vLLM's scheduler: the adapter hands the runtime the
    waiting prompt tokens, the oldest request's wait and the head's prefix, and the
    runtime's due time from them picks the cell (4x the target once the queue is due
    after 50 ms, else 1x: a 200-token prompt is due within about 10 ms, a 3,000-token one
    after 120 ms; the wait is the wall time, milliseconds here)."""
    import policies.vllm_scheduler as vs
    from envs.pricing import Coefficients, chunk_within, prefill_due_s

    cost = Coefficients.of(COST)
    data = two_fraction_table("prefill_due_s", 0.05)
    monkeypatch.setenv("CHUNKPILOT_CORRECT_SPEED", "0")
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    for i in range(4):
        sched.add_request(make_request(f"short{i}", 20, 200))
    seen = set()
    for step in range(120):
        if step % 10 == 5:
            sched.add_request(make_request(f"prompt{step}", 3000 if step % 20 == 5 else 200, 4))
        out = sched.schedule()
        state, got = sched.chunkpilot_history[-1]
        n = state["running_decodes"]
        if n and state["waiting_prefill_tokens"]:
            q = state["head_prefilled_tokens"]
            due = prefill_due_s(cost, n, state["decode_context_tokens"], q,
                                state["waiting_prefill_tokens"], state["oldest_wait_s"], 0.02, 1024)
            fraction = 4.0 if due >= 0.05 else 1.0
            chunk = chunk_within(cost, n, state["decode_context_tokens"], fraction * 0.02, q, 1024 - n)
            assert got == min(n + chunk, 1024), (step, got)
            seen.add(fraction)
        sched.update_from_output(out, fake_output(sched, out))
    assert seen == {1.0, 4.0}


@pytest.mark.parametrize("cls_name", ["TableScheduler", "AsyncTableScheduler"])
@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_the_scheduler_learns_the_engine_speed_from_its_steps(model, monkeypatch, cls_name, speed):
    """On a fake clock where each step takes ``speed`` times the stored cost model's price
    of the shape vLLM scheduled (each request's tokens after what it had computed, as read
    from vLLM's requests before the step), the scheduler's scale reaches ``speed`` once
    warmed up, the gauge shows it, and the budgets are the time budgets divided by it."""
    import policies.vllm_scheduler as vs
    from envs.pricing import Coefficients, time_budget
    from policies.table.correction import WARMUP, shape_price

    cost = Coefficients.of(COST)
    data = two_fraction_table("kv_usage", 2.0)  # one fraction in use: the target, 20 ms
    clock = fake_clock(monkeypatch)
    sched = create_scheduler(getattr(vs, cls_name), model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    for i in range(6):
        sched.add_request(make_request(f"short{i}", 20, 300))
    pending, checked = [], 0
    for step in range(120):
        if step % 15 == 3:
            sched.add_request(make_request(f"long{step}", 2500, 4))
        queued = list(sched.running) + list(sched.waiting)
        before = {r.request_id: r.num_computed_tokens for r in queued}
        sampled = {r.request_id: r.num_output_tokens for r in list(sched.running)}
        scale = sched.chunkpilot_speed.value
        out = sched.schedule()
        state, got = sched.chunkpilot_history[-1]
        n = state["running_decodes"]
        if n and step > WARMUP + 2:
            want = time_budget(cost, n, state["decode_context_tokens"], state["head_prefilled_tokens"],
                               0.02 / scale, 1024)
            assert got == max(want, n), (step, got, scale)
            checked += want < 1024
        shape = [(k, before.get(rid, 0), k == 1 and sampled.get(rid, 0) > 0
                  and before.get(rid, 0) >= sched.requests[rid].num_prompt_tokens)
                 for rid, k in out.num_scheduled_tokens.items()]
        pending.append((out, fake_output(sched, out), shape_price(cost, shape)))
        if cls_name == "TableScheduler" or len(pending) > 1:  # async: the output a step later
            done, runner, priced = pending.pop(0)
            clock[0] += speed * priced  # the step runs until its output arrives
            sched.update_from_output(done, runner)
    assert sched.chunkpilot_speed.value == pytest.approx(speed, rel=1e-6)
    assert checked >= 20
    gauge = sched.chunkpilot_metrics.speed_scale._value.get()
    assert gauge == pytest.approx(speed, rel=1e-6)


def test_the_speed_is_learnt_from_the_steps_the_budget_sized(model, monkeypatch):
    """An engine off its cost model by 0.5x on the steps a prefill chunk fills to the
    budget while requests decode, and by 3x on every other step (decodes alone, a short
    prompt whole within the budget): the scale is the 0.5 of the steps whose size the
    time budget chose, those whose time it must hold."""
    import policies.vllm_scheduler as vs
    from envs.pricing import Coefficients
    from policies.table.correction import shape_price

    cost = Coefficients.of(COST)
    data = two_fraction_table("kv_usage", 2.0)
    clock = fake_clock(monkeypatch)
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    for i in range(6):
        sched.add_request(make_request(f"short{i}", 20, 300))
    kinds = set()
    for step in range(150):
        if step % 15 == 3:
            sched.add_request(make_request(f"long{step}", 2500, 4))
        if step % 15 == 10:
            sched.add_request(make_request(f"prompt{step}", 8, 4))
        queued = list(sched.running) + list(sched.waiting)
        before = {r.request_id: r.num_computed_tokens for r in queued}
        sampled = {r.request_id: r.num_output_tokens for r in list(sched.running)}
        out = sched.schedule()
        shape = [(k, before.get(rid, 0), k == 1 and sampled.get(rid, 0) > 0
                  and before.get(rid, 0) >= sched.requests[rid].num_prompt_tokens)
                 for rid, k in out.num_scheduled_tokens.items()]
        filled = (any(d for _, _, d in shape) and not all(d for _, _, d in shape)
                  and out.total_num_scheduled_tokens == sched.max_num_scheduled_tokens)
        kinds.add((filled, all(d for _, _, d in shape)))
        clock[0] += (0.5 if filled else 3.0) * shape_price(cost, shape)
        sched.update_from_output(out, fake_output(sched, out))
    assert kinds == {(True, False), (False, True), (False, False)}  # all three kinds served
    assert sched.chunkpilot_speed.value == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("cls_name", ["TableScheduler", "AsyncTableScheduler"])
def test_the_step_record_is_what_vllm_scheduled_and_fits_the_engine_overhead(
        model, monkeypatch, tmp_path, cls_name):
    """With CHUNKPILOT_RECORD_STEPS a token table's scheduler (no cost model of its own)
    writes each step vLLM scheduled, every decode's context and chunk's prefix as read from
    vLLM's requests before the step, with the time the step took on a fake clock; the
    calibration reads the record back, and a fake engine 3 ms per step slower than the
    a100-80g's price of Llama-3-8B is fitted to exactly that overhead on top of it."""
    import policies.vllm_scheduler as vs
    from envs.calibrate.steps import fit_steps, read_steps
    from envs.cost import PassShape, Roofline, price
    from envs.profiles import get_hardware, get_model

    hw, mp = get_hardware("a100-80g"), get_model("llama-3-8b")
    roofline = Roofline.of(hw, mp)
    path = tmp_path / "steps.csv"
    monkeypatch.setenv("CHUNKPILOT_RECORD_STEPS", str(path))
    clock = fake_clock(monkeypatch)
    sched = create_scheduler(getattr(vs, cls_name), model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(TABLE))
    for i in range(6):
        sched.add_request(make_request(f"short{i}", 20, 60))
    pending, expected = [], []
    for step in range(80):
        if step % 15 == 3:
            sched.add_request(make_request(f"long{step}", 1500, 4))
        before = {r.request_id: r.num_computed_tokens for r in list(sched.running) + list(sched.waiting)}
        # Sampled, or being sampled by a step in flight (async scheduling's placeholders).
        sampled = {r.request_id: r.num_output_tokens + r.num_output_placeholders
                   for r in sched.running}
        out = sched.schedule()
        decodes, chunks = [], []
        for rid, k in out.num_scheduled_tokens.items():
            done = before.get(rid, 0)
            if k == 1 and sampled.get(rid, 0) > 0 and done >= sched.requests[rid].num_prompt_tokens:
                decodes.append(done)
            else:
                chunks.append((k, done))
        seconds = price(roofline, PassShape.of(decodes, chunks)).total_s + 0.003
        pending.append((out, fake_output(sched, out), decodes, chunks, seconds))
        if cls_name == "TableScheduler" or len(pending) > 1:  # async: the output a step later
            done_out, runner, decodes, chunks, seconds = pending.pop(0)
            clock[0] += seconds
            sched.update_from_output(done_out, runner)
            if decodes or chunks:
                expected.append((decodes, chunks, seconds))
    sched.chunkpilot_recorder.flush()
    steps = read_steps(str(path))
    assert len(steps) == len(expected) >= 60
    for (ctx, chunks, sec), (want_ctx, want_chunks, want_s) in zip(steps, expected):
        assert (ctx, chunks) == (want_ctx, want_chunks)
        assert sec == pytest.approx(want_s, rel=1e-5)
    assert any(c for _, c, _ in steps) and any(d for d, _, _ in steps)
    fit = fit_steps(steps, mp, True, hw)[0]
    assert fit.overhead_s == pytest.approx(hw.per_pass_overhead_s + 0.003, rel=1e-3)


def test_a_table_that_carries_is_re_priced_for_this_engine(model, monkeypatch):
    """A table over a deployment feature, served by vLLM: the scheduler re-prices it for its
    own KV cache and the SLO it serves, with the same function the simulator observes
    (``envs.deployment``), so the cell the deployment picks is this engine's; a range
    the engine lies outside is refused unless allowed."""
    import policies.vllm_scheduler as vs
    from envs.deployment import deployment
    from envs.pricing import Coefficients

    data = two_fraction_table("kv_prompts", 1.0)
    data["provenance"]["deployments"] = {"range": {}, "kv_tokens": 10 ** 9}
    monkeypatch.setenv("CHUNKPILOT_CORRECT_SPEED", "0")
    monkeypatch.setenv("CHUNKPILOT_SLO_TTFT_S", "2")
    monkeypatch.setenv("CHUNKPILOT_SLO_ITL_S", "0.02")
    table = BudgetTable(data)
    assert table.action.fraction({}) == 4.0  # a billion tokens of cache: above the edge
    for blocks in (4000, 40):
        sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                                 num_blocks=blocks, chunkpilot_table=table)
        kv = blocks * sched.cache_config.block_size
        want = deployment(Coefficients.of(COST), 2.0, 0.02, kv).as_dict()
        assert sched.chunkpilot_table.action.deployment == want
        assert sched.chunkpilot_table.action.fraction({}) == (4.0 if want["kv_prompts"] >= 1 else 1.0)
    data["provenance"]["deployments"]["range"] = {"kv_prompts": [100.0, 200.0]}
    with pytest.raises(TableError, match="outside the range of deployments it was made for: kv_prompts"):
        create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                         chunkpilot_table=BudgetTable(data))


def test_a_table_that_carries_takes_the_cost_model_of_the_deployment_named(model, monkeypatch, tmp_path):
    """CHUNKPILOT_HARDWARE and CHUNKPILOT_MODEL name the deployment served (profile files
    here, for vLLM's CPU backend and the tiny Llama): a table that carries is re-priced with
    their cost model, the prefill price it buckets computed from it; a named model that is
    not the engine's, and a table made for one deployment, are refused."""
    import policies.vllm_scheduler as vs
    from envs.cost import Roofline
    from envs.deployment import deployment
    from envs.profiles import get_hardware, get_model
    from tests.engine_vllm.fixtures import TINY_CPU_PROVENANCE

    hw_file, model_file = tmp_path / "cpu.json", tmp_path / "tiny.json"
    hw_file.write_text(json.dumps({**TINY_CPU_PROVENANCE["hardware"], "per_pass_overhead_s": 0.002}))
    model_file.write_text(json.dumps({**TINY_CPU_PROVENANCE["model"], "params": 550_912}))
    served = Roofline.of(get_hardware(str(hw_file)), get_model(str(model_file))).coefficients()
    data = two_fraction_table("prefill_tokens_per_itl", 2000)  # COST carries 375 tokens in 20 ms
    data["provenance"]["deployments"] = {"range": {}, "kv_tokens": 64000}
    monkeypatch.setenv("CHUNKPILOT_CORRECT_SPEED", "0")
    monkeypatch.setenv("CHUNKPILOT_SLO_ITL_S", "0.02")
    assert BudgetTable(data).action.fraction({}) == 1.0
    monkeypatch.setenv("CHUNKPILOT_HARDWARE", str(hw_file))
    monkeypatch.setenv("CHUNKPILOT_MODEL", str(model_file))
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    kv = 4000 * sched.cache_config.block_size
    want = deployment(served, 2.0, 0.02, kv).as_dict()
    assert sched.chunkpilot_table.action.cost == served
    assert sched.chunkpilot_table.action.deployment == want
    assert want["prefill_tokens_per_itl"] >= 2000  # the tiny model's prefill: cheaper than COST's
    assert sched.chunkpilot_table.action.fraction({}) == 4.0
    assert sched.chunkpilot_table.provenance["model"]["params"] == 550_912
    with monkeypatch.context() as m:
        m.setenv("CHUNKPILOT_MODEL", "llama-3-8b")
        with pytest.raises(TableError, match="describe another deployment than this engine runs: model"):
            create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                             chunkpilot_table=BudgetTable(data))
    with pytest.raises(TableError, match="re-price only a table that carries"):
        create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=1024,
                         chunkpilot_table=BudgetTable(two_fraction_table("running_decodes", 4)))
