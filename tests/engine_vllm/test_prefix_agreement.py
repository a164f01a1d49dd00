"""Prefix caching in the simulator against vLLM's own (``KVCacheManager``, ``BlockPool``): the
real ``Scheduler`` with ``enable_prefix_caching`` (no model: fake runner outputs) and the
simulator, driven through the same requests whose prompts share prefixes, schedule the same
tokens for every request at every step, so they find the same prefixes cached: hits,
prompts whose cached prefix ends inside a block, eviction from a pool too small to keep
everything, and preempted requests recomputing on their own cached blocks. vLLM hashes the
tokens; the simulator reads block ids named the same way (``envs.prefix_cache``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from envs.engine import EngineConfig  # noqa: E402
from envs.pricing import COST_FIELDS  # noqa: E402
from envs.sharing import token_block_ids  # noqa: E402
from envs.workload import Workload  # noqa: E402
from tests.engine_vllm.fixtures import BLOCK, block_hasher, create_scheduler, model_dir  # noqa: E402
from tests.engine_vllm.test_scheduler_agreement import (ONE_SECOND_PASS, PassByPass,  # noqa: E402
                                                        drive, first_difference)


SEEDS = 30
"""Random cases per test (each a few hundred steps on both sides)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("models"))


def case(seed: int, kv_tight: bool):
    """Requests from three families of shared prefixes (each a family's first S tokens, S
    drawn per request, then its own tokens), arriving while others run."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 20))
    families = [[1000 * f + k for k in range(600)] for f in range(3)]
    arrival = np.sort(rng.integers(0, 30, n)) + 0.5 * (rng.random(n) < 0.7)
    prompts, outputs = [], []
    for i in range(n):
        shared = int(rng.integers(0, 600))
        own = int(rng.integers(1, 200))  # its own last tokens: no two prompts are the same
        prompts.append(families[int(rng.integers(0, 3))][:shared] + [10**6 + 1000 * i + k for k in range(own)])
        outputs.append(int(rng.integers(1, 40)))
    budgets = [int(b) for b in rng.choice((16, 40, 64, 100, 256, 512, 2048), 7)]
    max_seqs = int(rng.integers(2, 10))
    need = max(-(-(len(p) + o) // BLOCK) for p, o in zip(prompts, outputs)) + 1  # and the null block
    blocks = need + int(rng.integers(0, 2 * need)) if kv_tight else 5000
    order = np.argsort(arrival, kind="stable")
    rows = [(float(arrival[i]), prompts[i], outputs[i]) for i in order]
    return rows, budgets, max_seqs, blocks


def shared_workload(rows) -> Workload:
    """The rows' requests, their prompts' block ids named from their tokens."""
    prompts = [p for _, p, _ in rows]
    return Workload(np.array([a for a, _, _ in rows]), np.array([len(p) for p in prompts], dtype=np.int64),
                    np.array([o for _, _, o in rows], dtype=np.int64), "shared",
                    token_block_ids(prompts, BLOCK), BLOCK)


def simulated(rows, budgets, max_num_seqs: int, kv_blocks: int, cls=PassByPass):
    sim = cls(ONE_SECOND_PASS, "llama-3-8b", shared_workload(rows),
              EngineConfig(max_num_seqs=max_num_seqs, num_kv_blocks=kv_blocks, block_size=BLOCK))
    sim.run(lambda s: max(budgets[sim.pass_index % len(budgets)], s["running_decodes"]))
    return sim.passes, sim.preemptions, sim.prefix_counts


def in_vllm(model, rows, budgets, max_seqs: int, num_blocks: int):
    sched = create_scheduler(Scheduler, model, max_num_batched_tokens=8192, max_num_seqs=max_seqs,
                             num_blocks=num_blocks, prefix_caching=True)
    return drive(sched, rows, budgets, hasher=block_hasher())


@pytest.mark.parametrize("kv_tight", [False, True], ids=["ample-kv", "tight-kv"])
def test_vllm_and_the_simulator_find_the_same_prefixes_cached(model, kv_tight):
    """Every step, every request gets the same tokens on both sides: a request whose
    prefix is cached schedules only the rest, so the same tokens mean the same hits."""
    hit = preempted = resumed_on_cache = 0
    for seed in range(SEEDS):
        rows, budgets, max_seqs, blocks = case(seed, kv_tight)
        sim, sim_pre, counts = simulated(rows, budgets, max_seqs, blocks - 1)
        real, real_pre = in_vllm(model, rows, budgets, max_seqs, blocks)
        assert first_difference(sim, real) is None, (seed, first_difference(sim, real))
        assert sim_pre == real_pre
        hit += counts.first_cached_tokens
        preempted += real_pre
        resumed_on_cache += counts.cached_tokens > counts.first_cached_tokens
    assert hit > 0
    assert (preempted > 0) == kv_tight and (resumed_on_cache > 0) == kv_tight


COUNTED = ("running_decodes", "waiting_requests", "waiting_prefill_tokens", "decode_context_tokens",
           "head_prefilled_tokens", "head_remaining_tokens", "head_cached_tokens")
"""The request-counted table inputs (the wait is on two clocks, the KV usage the engine's)."""
PRICING = ("next_prefills",)
"""What a time budget prices a pass with beyond them (the adapter reads it for a
time-fraction table with prefix caching on)."""


def test_the_adapter_reads_the_cache_as_the_simulator_does(model):
    """vLLM's scheduler with chunkpilot's adapter and the simulator, scheduling the same
    tokens: before every step with prefill work, the state the adapter would hand a table
    (a waiting head's cached tokens looked up in vLLM's cache, a running head's recorded
    at its first admission, the prefills after the head with the prefixes cached when they
    joined the queue) is the simulator's, quantity by quantity."""
    import policies.vllm_scheduler as vs
    from policies.table import BudgetTable
    from tests.engine_vllm.fixtures import table_dict

    # A time-fraction table: with prefix caching the adapter reads what its conversion
    # prices with too (next_prefills); the steps' budgets are the case's own (drive).
    data = table_dict([(n, [1]) for n in COUNTED], [64] * 2 ** len(COUNTED), default_budget=64)
    del data["budgets"]
    data["fractions"] = [1.0] * 2 ** len(COUNTED)
    data["action"] = {"kind": "time_fraction", "itl_s": 0.1, "cap": 8192,
                      "cost": dict.fromkeys(COST_FIELDS, 1e-3) | {"exposed": 0.5}}
    table = BudgetTable(data)
    assert table.pricing_needs == set(PRICING) | {"head_remaining_tokens"}
    seen = {"waiting head": 0, "running head": 0,  # compared steps whose head had a hit,
            "later cached": 0}  # and whose next prefills had one
    for seed in range(12):
        rows, budgets, max_seqs, blocks = case(seed, kv_tight=seed % 2 == 1)
        expected = {}

        class Recording(PassByPass):
            def _schedule(self, budget):
                if self.prefilling or self.waiting:
                    expected[self.pass_index] = {n: self.state()[n] for n in COUNTED + PRICING}
                return super()._schedule(budget)

        simulated(rows, budgets, max_seqs, blocks - 1, Recording)
        sched = create_scheduler(vs.TableScheduler, model, max_num_batched_tokens=8192,
                                 max_num_seqs=max_seqs, num_blocks=blocks, prefix_caching=True,
                                 chunkpilot_table=table)

        def compare(step):
            got = sched.chunkpilot_state()
            if step in expected:
                assert {n: got[n] for n in COUNTED + PRICING} == expected[step], (seed, step)
                seen["later cached"] += any(cached for cached, _ in got["next_prefills"])
                if got["head_cached_tokens"]:
                    running = any(r.num_output_tokens == 0 and r.num_computed_tokens < r.num_tokens
                                  for r in sched.running)
                    seen["running head" if running else "waiting head"] += 1

        drive(sched, rows, budgets, compare, block_hasher())
    assert all(seen.values()), seen
