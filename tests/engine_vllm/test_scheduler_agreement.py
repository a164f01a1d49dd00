"""The simulator schedules as vLLM V1 does: vLLM's real ``Scheduler`` (no model: fake
runner outputs) and the simulator's scheduler, driven through the same requests with the
same budget each step, schedule the same tokens for every request at every step; tight
budgets, a full batch and a KV cache small enough to preempt included. Where they cannot
agree (a prefill chunk capped by ``long_prefill_token_threshold`` ahead of decodes in
vLLM's running list), the test shows the difference and ``envs/engine.py`` says why."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from envs.engine import EngineConfig, Simulator  # noqa: E402
from envs.profiles import HardwareProfile  # noqa: E402
from envs.workload import Workload  # noqa: E402
from tests.engine_vllm.fixtures import BLOCK, create_scheduler, fake_output, make_request, model_dir  # noqa: E402

# Every pass takes one second whatever it carries, so that arrivals at half seconds fall
# between the same two passes on both sides.
ONE_SECOND_PASS = HardwareProfile("one-second-pass", 1e18, 1e18, 1e15, bandwidth_fraction=1.0,
                                  flops_fraction=1.0, per_pass_overhead_s=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("models"))


class PassByPass(Simulator):
    """The simulator without its decode-only stretches (each pass scheduled on its own),
    noting every pass's tokens per request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[dict[int, int]] = []

    def _decode_stretch(self, until_s: float) -> bool:
        return False  # the caller then schedules the next decode pass by itself

    def _execute(self, plan) -> None:
        tokens = {r.rid: 1 for r in self._decodes.values()}
        tokens.update({r.rid: x for r, x, _ in plan.chunks})
        self.passes.append(tokens)
        super()._execute(plan)


def simulated(requests, budgets, max_num_seqs: int, kv_blocks: int, threshold: int = 0):
    """Each pass's {request: tokens} in the simulator; ``requests`` are (arrival s, prompt,
    output), sorted; pass ``p`` gets ``budgets[p % len]`` or the running decodes if more."""
    arrival, prompt, output = (np.array(c) for c in zip(*requests))
    sim = PassByPass(ONE_SECOND_PASS, "llama-3-8b", Workload.from_arrays(arrival, prompt, output),
                     EngineConfig(max_num_seqs=max_num_seqs, num_kv_blocks=kv_blocks,
                                  long_prefill_token_threshold=threshold, block_size=BLOCK))
    sim.run(lambda s: max(budgets[sim.pass_index % len(budgets)], s["running_decodes"]))
    return sim.passes, sim.preemptions


def drive(sched, requests, budgets, before_step=None, hasher=None):
    """vLLM's scheduler ``sched`` through ``requests`` ((arrival s, prompt, output), the
    prompt a token count of 7s or the token ids; ``hasher`` names their blocks for prefix
    caching) on a clock that moves as the simulator's does: one second a step, jumping to
    the next arrival when nothing is left to run; step k at ``budgets[k % len]`` or the
    running decodes if more; ``before_step(k)`` is called before each step. Returns each
    step's {request: tokens} and the preemptions."""
    now, nxt, passes, preemptions = 0.0, 0, [], 0
    while nxt < len(requests) or sched.has_unfinished_requests():
        while nxt < len(requests) and requests[nxt][0] <= now:
            _, prompt, output = requests[nxt]
            tokens = prompt if isinstance(prompt, list) else None
            sched.add_request(make_request(str(nxt), len(tokens) if tokens else prompt, output,
                                           tokens, hasher))
            nxt += 1
        if not sched.has_unfinished_requests():
            now = requests[nxt][0]
            continue
        if before_step is not None:
            before_step(len(passes))
        decodes = sum(1 for r in sched.running
                      if r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1)
        budget = max(budgets[len(passes) % len(budgets)], decodes)
        if hasattr(sched, "chunkpilot_budget"):  # chunkpilot's scheduler sets the budget itself
            sched.chunkpilot_budget = lambda budget=budget: budget
        sched.max_num_scheduled_tokens = budget
        out = sched.schedule()
        preemptions += len(out.preempted_req_ids or ())
        passes.append({int(rid): k for rid, k in out.num_scheduled_tokens.items()})
        sched.update_from_output(out, fake_output(sched, out))
        now += 1.0
    return passes, preemptions


def in_vllm(model, requests, budgets, max_num_seqs: int, num_blocks: int, threshold: int = 0):
    """The same in vLLM's Scheduler (:func:`drive`)."""
    sched = create_scheduler(Scheduler, model, max_num_batched_tokens=8192,
                             max_num_seqs=max_num_seqs, num_blocks=num_blocks)
    sched.scheduler_config.long_prefill_token_threshold = threshold
    return drive(sched, requests, budgets)


def first_difference(a: list[dict], b: list[dict]):
    for p, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return p, x, y
    return (None if len(a) == len(b) else (min(len(a), len(b)), len(a), len(b)))


def random_case(seed: int, kv_tight: bool, budget_choices=(8, 16, 40, 64, 100, 256, 512, 1024, 4096)):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 24))
    arrival = np.sort(rng.integers(0, 40, n)) + 0.5 * (rng.random(n) < 0.7)
    prompt = np.where(rng.random(n) < 0.3, rng.integers(300, 2500, n), rng.integers(1, 120, n))
    output = rng.integers(1, 50, n)
    budgets = [int(b) for b in rng.choice(budget_choices, 7)]
    max_seqs = int(rng.integers(3, 12))
    need = int(((prompt + output) // BLOCK + 1).max())
    blocks = need + int(rng.integers(0, 3 * need)) if kv_tight else 5000
    requests = sorted(zip(arrival.tolist(), prompt.tolist(), output.tolist()))
    return requests, budgets, max_seqs, blocks


@pytest.mark.parametrize("kv_tight", [False, True], ids=["ample-kv", "tight-kv"])
def test_vllm_and_the_simulator_schedule_the_same_tokens_each_step(model, kv_tight):
    """Random request sets (a third of them long prompts, arrivals while others run),
    budgets from 8 to 4,096 tokens changing every step, three to eleven sequences at
    most, and (tight-kv) a KV cache of one to four largest requests' worth of blocks:
    every step, every request gets the same tokens on both sides."""
    preempted = 0
    for seed in range(40):
        requests, budgets, max_seqs, blocks = random_case(seed, kv_tight)
        # vLLM keeps one block back (its null block): the simulator gets the rest
        sim, sim_pre = simulated(requests, budgets, max_seqs, blocks - 1)
        real, real_pre = in_vllm(model, requests, budgets, max_seqs, blocks)
        assert first_difference(sim, real) is None, (seed, first_difference(sim, real))
        assert sim_pre == real_pre
        preempted += real_pre
    assert (preempted > 0) == kv_tight  # the tight caches did preempt


@pytest.mark.parametrize("kv_tight", [False, True], ids=["ample-kv", "tight-kv"])
def test_with_a_chunk_cap_they_agree_where_the_budget_covers_every_capped_chunk(model, kv_tight):
    """long_prefill_token_threshold 64, budgets of 1,024 and 4,096 tokens (more than eleven
    decodes and eleven capped chunks take): several prompts chunked side by side, 64
    tokens each a step, the same on both sides."""
    for seed in range(20):
        requests, budgets, max_seqs, blocks = random_case(seed, kv_tight, (1024, 4096))
        sim, _ = simulated(requests, budgets, max_seqs, blocks - 1, threshold=64)
        real, _ = in_vllm(model, requests, budgets, max_seqs, blocks, threshold=64)
        assert first_difference(sim, real) is None, (seed, first_difference(sim, real))


def test_a_lone_request_is_not_capped(model):
    """vLLM lifts the cap when one request is running or waiting (nobody to starve); the
    simulator too: a lone 1,000-token prompt takes 512 tokens a step, not 64."""
    requests = [(0.0, 1000, 3), (10.5, 1000, 3)]
    sim, _ = simulated(requests, [512], 4, 5000, threshold=64)
    real, _ = in_vllm(model, requests, [512], 4, 5000, threshold=64)
    assert sim == real
    assert sim[:3] == [{0: 512}, {0: 488}, {0: 1}]


def test_where_a_capped_chunk_is_ahead_of_a_decode_vllm_starves_the_decode(model):
    """The one place they differ, by design (envs/engine.py): with a cap, vLLM walks its
    running list in admission order, so a decode admitted after a request whose prompt is
    still being chunked gets its token only if the chunk leaves budget; the simulator
    gives every decode its token first. A 1,000-token prompt A and a 10-token prompt B
    arrive together, cap 64, budgets 80 and 64 in turn: B finishes its prompt in the first
    step, behind A; then in every 64-token step vLLM gives A all 64 and B nothing, while
    the simulator gives B its token and A 63."""
    requests = [(0.0, 1000, 2), (0.0, 10, 6)]
    sim, _ = simulated(requests, [80, 64], 4, 5000, threshold=64)
    real, _ = in_vllm(model, requests, [80, 64], 4, 5000, threshold=64)
    assert sim[0] == real[0] == {0: 64, 1: 10}
    assert real[1:4] == [{0: 64}, {0: 64, 1: 1}, {0: 64}]
    assert sim[1:4] == [{0: 63, 1: 1}, {0: 64, 1: 1}, {0: 63, 1: 1}]
