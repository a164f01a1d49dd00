"""The state the vLLM adapter hands a table, against ``envs.state``'s definitions, on vLLM's
real scheduler (no model: fake runner outputs). The expected values come from the test's
own account of what happened to each request (what each step scheduled, sampled and
preempted), never from vLLM's counters, so a wrong definition in the adapter fails here:
after a preemption a request recomputing its prompt and output is a prefill, not a
decode, and its output tokens are prefill work too."""

from __future__ import annotations

import time

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

from envs.state import SLACK_COUNTS, TABLE_INPUTS
from policies.table import BudgetTable
from tests.engine_vllm.fixtures import (create_scheduler, fake_clock, fake_output, make_request,
                                        model_dir, table_dict)

NAMES = [n for n in TABLE_INPUTS if n not in SLACK_COUNTS]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("models"))


class Account:
    """What the test knows of each request from the scheduler's outputs alone."""

    def __init__(self):
        self.prompt, self.outputs, self.arrival = {}, {}, {}
        self.computed = {}  # tokens scheduled since its last admission
        self.sampled = set()  # sampled since its last admission: decoding
        self.running: list[str] = []  # in admission order
        self.waiting: list[str] = []  # in the order the scheduler takes them
        self.finished, self.max_tokens = set(), {}

    def add(self, request, max_tokens: int) -> None:
        rid = request.request_id
        self.prompt[rid], self.outputs[rid], self.arrival[rid] = len(request.prompt_token_ids), 0, request.arrival_time
        self.max_tokens[rid] = max_tokens
        self.waiting.append(rid)

    def expected(self, now_wall: float) -> dict:
        decoding = [r for r in self.running if r in self.sampled]
        prefilling = [r for r in self.running if r not in self.sampled]
        todo = {r: self.prompt[r] + self.outputs[r] - self.computed.get(r, 0) for r in prefilling + self.waiting}
        head = prefilling[0] if prefilling else (self.waiting[0] if self.waiting else None)
        first_less = [self.arrival[r] for r in prefilling + self.waiting if self.outputs[r] == 0]
        return {"running_decodes": len(decoding), "waiting_requests": len(self.waiting),
                "waiting_prefill_tokens": sum(todo.values()),
                "decode_context_tokens": sum(self.computed[r] for r in decoding),
                "head_prefilled_tokens": self.computed.get(head, 0) if head in self.running else 0,
                "head_remaining_tokens": todo[head] if head else 0,
                "head_cached_tokens": 0,  # no prefix caching here (test_prefix_agreement.py has it)
                "oldest_wait_s": now_wall - min(first_less) if first_less else 0.0}

    def step(self, output) -> None:
        """Apply one scheduled step: its preemptions, its admissions, its tokens, its samples."""
        for rid in output.preempted_req_ids or ():
            self.running.remove(rid)
            self.waiting.insert(0, rid)
            self.computed[rid] = 0
            self.sampled.discard(rid)
        for rid, tokens in output.num_scheduled_tokens.items():
            if rid not in self.running:
                self.waiting.remove(rid)
                self.running.append(rid)
                self.computed[rid] = 0
                self.sampled.discard(rid)
            self.computed[rid] += tokens
            if self.computed[rid] == self.prompt[rid] + self.outputs[rid]:  # its work is done: a token
                self.outputs[rid] += 1
                self.sampled.add(rid)
                if self.outputs[rid] == self.max_tokens[rid]:
                    self.running.remove(rid)
                    self.finished.add(rid)
                else:  # decoding: all but its last sampled token is in the cache
                    self.computed[rid] = self.prompt[rid] + self.outputs[rid] - 1


def assert_as_counted(got: dict, want: dict, step: int) -> None:
    """The state the table read is the account's, quantity by quantity (the wait to within
    the clock's drift between the two readings; KV usage and step times come from the
    engine, not from the requests)."""
    for name in NAMES:
        if name == "oldest_wait_s":
            assert got[name] == pytest.approx(want[name], abs=0.05), (step, name)
        elif name not in ("kv_usage", "last_step_s"):
            assert got[name] == want[name], (step, name, got[name], want[name])


def test_every_quantity_follows_the_vocabulary_through_preemptions(model):
    """A cache of 40 blocks (640 tokens) for four 100-token prompts that decode 200 tokens
    each, and a 300-token prompt arriving among them, 64 tokens a step: partial prefills
    beside decodes, and preemptions whose requests recompute their prompt and output over
    several steps. Every step, the state the table reads is the vocabulary's, from the
    test's own account."""
    import policies.vllm_scheduler as vs

    data = table_dict([(n, [1]) for n in NAMES], [64] * 2 ** len(NAMES), default_budget=64)
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=64, num_blocks=40,
                             chunkpilot_table=BudgetTable(data))
    assert sched.chunkpilot_table.needs == set(NAMES)
    account = Account()
    for i in range(4):
        req = make_request(f"r{i}", 100, 200)
        req.arrival_time -= 10.0 * (4 - i)  # arrived seconds apart: the oldest wait tells them apart
        sched.add_request(req)
        account.add(req, 200)
    preempted = recomputing = partial_with_decodes = 0
    for step in range(400):
        if step == 6:
            req = make_request("long", 300, 20)
            sched.add_request(req)
            account.add(req, 20)
        want = account.expected(time.time())
        usage = sched.kv_cache_manager.usage
        out = sched.schedule()
        got = sched.chunkpilot_history[-1][0]
        assert_as_counted(got, want, step)
        preempted += len(out.preempted_req_ids or ())
        recomputing += any(account.outputs[r] and r not in account.sampled for r in account.running)
        partial_with_decodes += bool(want["running_decodes"] and want["head_prefilled_tokens"])
        assert got["kv_usage"] == usage
        account.step(out)
        sched.update_from_output(out, fake_output(sched, out))
    assert preempted and recomputing and partial_with_decodes
    assert sched.chunkpilot_history[0][0]["last_step_s"] == 0.0  # nothing before the first


def test_last_step_is_the_step_s_own_time_not_the_idle_wait(model, monkeypatch):
    """last_step_s is the last completed step's duration, from its scheduling to its output;
    an engine idle between two steps (no request for a while) does not lengthen it."""
    import policies.vllm_scheduler as vs

    clock = fake_clock(monkeypatch)
    data = table_dict([("last_step_s", [0.02])], [256, 256], default_budget=256)
    sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=256,
                             chunkpilot_table=BudgetTable(data))
    sched.add_request(make_request("a", 20, 3))
    seen = []
    for took, idle in ((0.03, 0.0), (0.01, 0.0), (0.05, 7.0), (0.02, 0.0)):
        clock[0] += idle
        out = sched.schedule()
        seen.append(sched.chunkpilot_history[-1][0]["last_step_s"])
        clock[0] += took
        sched.update_from_output(out, fake_output(sched, out))
        if not sched.running and not sched.waiting:
            sched.add_request(make_request(f"b{len(seen)}", 20, 3))
    assert seen == pytest.approx([0.0, 0.03, 0.01, 0.05])


def test_async_scheduling_counts_the_step_in_flight_as_done(model):
    """vLLM's async scheduler schedules each step before the previous one's output arrives
    (here: one step late). The state a table reads counts the step in flight as done, as
    the synchronous scheduler and the simulator would see it after that step: a prompt
    whose last chunk is in flight is decoding, a decode's in-flight token is in its
    context, a request whose last token is in flight has finished."""
    import policies.vllm_scheduler as vs

    data = table_dict([(n, [1]) for n in NAMES], [64] * 2 ** len(NAMES), default_budget=64)
    sched = create_scheduler(vs.AsyncTableScheduler, model, max_num_batched_tokens=64,
                             async_scheduling=True, chunkpilot_table=BudgetTable(data))
    account = Account()
    arrivals = {0: ("a", 100, 30), 2: ("b", 20, 5), 5: ("c", 150, 12), 9: ("d", 40, 1), 14: ("e", 90, 25)}
    pending = None
    in_flight_decodes = finished_in_flight = 0
    for step in range(120):
        if step in arrivals:
            rid, prompt, out_tokens = arrivals[step]
            req = make_request(rid, prompt, out_tokens)
            sched.add_request(req)
            account.add(req, out_tokens)
        want = account.expected(time.time())
        out = sched.schedule()
        got = sched.chunkpilot_history[-1][0]
        assert_as_counted(got, want, step)
        in_flight_decodes += bool(pending and want["running_decodes"])
        finished_in_flight += sum(1 for r in sched.running
                                  if r.num_output_tokens + r.num_output_placeholders >= r.max_tokens)
        account.step(out)
        if pending is not None:
            sched.update_from_output(*pending)
        pending = (out, fake_output(sched, out))
    assert account.finished == set("abcde")
    assert in_flight_decodes > 20 and finished_in_flight > 0


def test_under_async_scheduling_a_step_runs_from_the_previous_step_s_output(model, monkeypatch):
    """Async scheduling schedules step 2 while step 1 runs: step 2's own time starts when
    step 1's output arrives, not when step 2 was scheduled."""
    import policies.vllm_scheduler as vs

    clock = fake_clock(monkeypatch)
    data = table_dict([("last_step_s", [0.02])], [256, 256], default_budget=256)
    sched = create_scheduler(vs.AsyncTableScheduler, model, max_num_batched_tokens=256,
                             async_scheduling=True, chunkpilot_table=BudgetTable(data))
    sched.add_request(make_request("a", 20, 6))
    first = sched.schedule()  # at 100.000
    clock[0] += 0.001
    second = sched.schedule()  # at 100.001, while the first runs
    clock[0] += 0.029
    sched.update_from_output(first, fake_output(sched, first))  # at 100.030: 0.030 since its scheduling
    assert sched.schedule() is not None and sched.chunkpilot_history[-1][0]["last_step_s"] == pytest.approx(0.030)
    clock[0] += 0.012
    sched.update_from_output(second, fake_output(sched, second))  # at 100.042
    sched.schedule()
    assert sched.chunkpilot_history[-1][0]["last_step_s"] == pytest.approx(0.012)  # not 0.041
