"""Hypothesis strategies the property tests share."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from envs.engine import EngineConfig
from envs.workload import Workload


@st.composite
def engine_workloads(draw, requests: tuple[int, int], gaps: list[float], max_prompt: int,
                     max_output: int, kv_factor: int, max_seqs: int, thresholds: list[int]):
    """(workload, engine config): ``requests`` = (fewest, most) requests, arriving ``gaps``
    seconds apart (each drawn from the list); a KV cache of one to ``kv_factor`` times the
    largest request's blocks (16-token blocks), so preemptions come and go; up to
    ``max_seqs`` running; a chunk cap drawn from ``thresholds`` (0: none)."""
    n = draw(st.integers(*requests))
    waits = draw(st.lists(st.sampled_from(gaps), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, max_prompt), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, max_output), min_size=n, max_size=n))
    need = max(-(-(a + b) // 16) for a, b in zip(prompts, outputs))
    cfg = EngineConfig(num_kv_blocks=draw(st.integers(need, need * kv_factor)),
                       max_num_seqs=draw(st.integers(1, max_seqs)),
                       long_prefill_token_threshold=draw(st.sampled_from(thresholds)))
    return Workload.from_arrays(np.cumsum(waits).tolist(), prompts, outputs), cfg
