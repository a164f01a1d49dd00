"""A continuous-batching serving engine, simulated pass by pass (vLLM V1 semantics).

Each pass the scheduler fills a token budget: every running decode gets one token
first, then partially prefilled requests (in admission order) and then waiting
requests (in arrival order, preempted ones at the front) share what is left, each
capped by ``long_prefill_token_threshold`` (lifted, as vLLM does, when a single request
is running or waiting); a prompt larger than what is left is chunked over several
passes. The KV cache is paged (``block_size`` tokens a block); a waiting request is
admitted only if its whole sequence fits in the free blocks (vLLM's
``scheduler_reserve_full_isl``, on by default), though only its chunk's blocks are
allocated; when a pass needs blocks that are not free, the most recently admitted
running request is preempted and later recomputed from scratch, as vLLM V1 does
(``Scheduler.schedule``: ``self.running.pop()``). Waiting requests are not admitted in a
pass that preempted. Every pass is priced by :mod:`envs.cost`.

vLLM V1 walks its running list in admission order instead, each request taking what it
needs from the budget left. The two schedule the same tokens for every request at every
step (``tests/engine_vllm/test_scheduler_agreement.py`` drives vLLM's ``Scheduler`` and
this one through the same requests and budgets, preemptions included) except in one
case: with a chunk cap, a decode admitted behind a request whose prompt is still being
chunked gets its token in vLLM only if that chunk leaves budget for it, and here always.
Without a cap (vLLM's default) the case cannot arise: a chunk then takes all the budget
left, so nothing is admitted behind a partial prefill. Modelling it would make a decode's
tokens depend on the order of the running list, which the decode stretches below (every
decode advances every pass) cannot express. A budget that covers the decodes and the
capped chunks avoids the case in vLLM too.

As in vLLM, a pass is scheduled first and executed second: :meth:`Simulator._schedule`
decides preemptions, admissions and chunks (allocating KV blocks, as vLLM's
``schedule()`` does) and returns a frozen :class:`PassPlan`; :meth:`Simulator._execute`
prices the plan and applies its tokens (vLLM's ``update_from_output``).

Requests carry counters, never a phase flag: ``computed`` tokens in the KV cache
and ``generated`` output tokens; a request is prefilling while
``computed < prompt + generated`` and decoding once only its last sampled token
is missing from the cache.

Speed. Decode-only passes are the vast majority and need no decision: their
price depends only on the number of decodes ``N`` and the total decode context,
which grows by ``N`` every pass. Each decode's context is kept lazily as
``offset + pass_index``, so the total is ``sum(offsets) + N * pass_index``; the
pass at which a decode finishes is known the moment its prefill completes; and
the decodes that need a new KV block this pass are those whose offset falls in
one residue class modulo the block size. A decode-only pass therefore costs a
handful of operations whatever the number of requests (see
``benchmarks/bench_simulator.py``). Only passes that move prefill work touch
individual requests.

The budget of a pass with prefill work is asked of a caller-supplied policy,
``policy(state: SchedulerState) -> int``; passes without prefill work need no
budget. :meth:`Simulator.advance` runs to the next pass that needs a decision and
:meth:`Simulator.step` runs that pass, which is what the Gymnasium environment
drives; :meth:`Simulator.run` does both in a loop. What every pass did is kept in
:attr:`Simulator.log` (a :class:`~envs.records.PassLog`), read through its methods, and
every request in :attr:`Simulator.requests` (a :class:`~envs.records.RequestBook`: live
requests as their objects, finished ones as compact records); both cost a few hundred
bytes a request, and ``summary_only`` keeps neither.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from itertools import islice
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from envs.cost import PassShape, Roofline
from envs.errors import MAX_TOKENS, ConfigError, fraction, integer, require, show
from envs.metrics import SimResult, StreamedResult, StreamingSummary
from envs.prefix_cache import PrefixCache, PrefixCounts, Units, check_hash_block_tokens, units_of
from envs.pricing import free_ride_root
from envs.profiles import HardwareProfile, ModelProfile, get_hardware, get_model
from envs.records import FLUSH_VALUES, PassLog, RequestBook
from envs.slack import ItlSlackMeter, SlackCounter
from envs.state import NEXT_PREFILLS, QUANTITIES, SLACK_COUNTS
from envs.workload import Workload

if TYPE_CHECKING:  # for annotations only
    from envs.metrics import SLO

INF = math.inf
_new_tuple = tuple.__new__
MAX_KV_BLOCKS = 2**40
"""Largest KV cache in blocks (16 PiB of 16-token blocks at 1 KiB a token): far above any
device, and small enough that block counts and their token totals stay int64."""
MAX_BLOCK_SIZE = 1024
"""Largest KV block in tokens (vLLM's are 8 to 256)."""
NO_CAP = 1 << 62
"""A chunk cap no request reaches (``long_prefill_token_threshold`` 0, or lifted)."""
JITTER_DRAWS = 1 << 16
JITTER_SEED = 0
"""The step jitter's draws: a fixed sequence, indexed by pass (``jitter_draws``)."""


@functools.lru_cache(maxsize=8)
def jitter_draws(quantiles: tuple[float, ...]) -> np.ndarray | None:
    """A profile's ``step_jitter`` drawn, one per pass index modulo ``JITTER_DRAWS``: the
    quantile function, linear between the given quantiles, at a uniform draw of a fixed
    sequence. None for no jitter.

    Indexing by pass keeps the simulator deterministic, and its forks and every policy on
    the same stream meet the same sequence (common random numbers). 65,536 draws exceed
    the passes with prefill of a run's p99 window, so a cycle repeats no tail a percentile
    would count twice."""
    if not quantiles:
        return None
    u = np.random.default_rng(JITTER_SEED).random(JITTER_DRAWS)
    draws = np.interp(u, np.linspace(0.0, 1.0, len(quantiles)), np.asarray(quantiles, dtype=float))
    draws.setflags(write=False)
    return draws


@dataclass(frozen=True)
class EngineConfig:
    """The engine's static settings (vLLM's names where it has them)."""

    max_num_seqs: int = 256
    """Most requests running at once (decoding or partially prefilled)."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's chunk in a pass; 0 means no cap (vLLM's default). With a cap
    and a budget below the decodes plus the capped chunks, vLLM can starve a decode that
    the simulator serves (see the module docstring)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Share of device memory the engine may use for weights and KV cache."""
    num_kv_blocks: int | None = None
    """Override the KV capacity in blocks (None: derive it from memory)."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV blocks of prompt prefixes seen before (vLLM V1's automatic
    prefix caching, on by default there too; :mod:`envs.prefix_cache`). It acts on a
    workload that names its prompts' blocks (``Workload.block_hashes``); a workload that
    does not is served as with it off (a preempted request's recomputation is then priced
    in full, where vLLM would hit its own blocks still cached)."""

    def __post_init__(self) -> None:
        integer("max_num_seqs", self.max_num_seqs, 1, MAX_TOKENS)
        integer("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, MAX_TOKENS,
                "0 = no cap")
        integer("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                self.enable_prefix_caching, "must be true or false")
        if self.num_kv_blocks is not None:
            integer("num_kv_blocks", self.num_kv_blocks, 1, MAX_KV_BLOCKS)

    def kv_blocks(self, hardware: HardwareProfile, model: ModelProfile) -> int:
        """Blocks that fit in the memory left after the weights (vLLM's profile run,
        without its activation reserve)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        usable = hardware.memory_bytes * model.tensor_parallel * self.gpu_memory_utilization
        free = usable - model.weight_bytes
        if free <= 0:
            raise ConfigError(
                f"model: {model.name} weights need {model.weight_bytes / 2**30:.1f} GiB but "
                f"{hardware.name} x{model.tensor_parallel} at gpu_memory_utilization="
                f"{self.gpu_memory_utilization} offers {usable / 2**30:.1f} GiB; "
                "use a larger part, more tensor parallelism, or a smaller model")
        blocks = free // (model.kv_bytes_per_token * self.block_size)
        if blocks > MAX_KV_BLOCKS:
            raise ConfigError(
                f"hardware.memory_bytes: {hardware.name} x{model.tensor_parallel} holds {blocks:.3g} "
                f"KV blocks of {model.name}, must hold <= {MAX_KV_BLOCKS} (check the profiles' "
                "memory_bytes and bytes_per_kv_element, or set num_kv_blocks)")
        return int(blocks)


def check_static_budget(budget: int, config: EngineConfig) -> None:
    """vLLM refuses ``max_num_batched_tokens < max_num_seqs`` at start-up: a full batch of
    decodes would leave no room for any prompt, ever."""
    require(isinstance(budget, (int, np.integer)) and not isinstance(budget, bool)
            and config.max_num_seqs <= budget <= MAX_TOKENS, "budget", budget,
            f"must be an integer >= max_num_seqs ({config.max_num_seqs}) and <= {MAX_TOKENS} for a "
            "static budget, or lower max_num_seqs")


class Request:
    """One request's counters (vLLM's ``Request``: counters, no phase flag).

    ``computed`` tokens are in the KV cache and ``generated`` output tokens have been
    sampled; ``offset`` is only meaningful while decoding (its context at pass ``q`` is
    ``offset + q``), and the simulator brings ``computed``/``generated`` up to date
    when the request stops decoding. ``segments`` are the [start, end) pass ranges it
    decoded in; ``resume_gaps`` the whole waits after each preemption.
    """

    __slots__ = ("rid", "pos", "arrival", "prompt", "output", "warm", "computed", "generated",
                 "blocks", "admit_seq", "offset", "decode_start", "generated_at_start", "finish_pass",
                 "first_token_s", "last_token_s", "finish_s", "preemptions", "segments",
                 "resume_gaps", "recomputed", "block_ids", "covered", "units", "held", "filled",
                 "first_cached_tokens", "joined_cached_tokens")

    def __init__(self, rid: int, arrival: float, prompt: int, output: int, warm: bool = False):
        self.rid = rid
        self.pos = -1  # its index in Simulator.requests
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.warm = warm
        self.computed = 0
        self.generated = 0
        self.blocks = 0
        self.admit_seq = -1
        self.offset = 0
        self.decode_start = -1
        self.generated_at_start = 0
        self.finish_pass = -1
        self.first_token_s = math.nan
        self.last_token_s = math.nan
        self.finish_s = math.nan
        self.preemptions = 0
        self.segments: list[tuple[int, int]] = []  # [start, end) passes spent decoding
        self.resume_gaps: list[float] = []
        self.recomputed = 0  # prefill tokens its preemptions added (work done again)
        # With prefix caching: the workload's ids of its blocks and the tokens they cover,
        # its units (envs.prefix_cache.units_of), and per unit the blocks it holds cached
        # and the blocks it has filled (cached or not).
        self.block_ids = None
        self.covered = 0
        self.units = None
        self.held: list | None = None
        self.filled: list | None = None
        self.first_cached_tokens = 0  # what its first admission found cached (vLLM's prefill stats)
        self.joined_cached_tokens = 0  # what was cached when it last joined the waiting queue

    @property
    def target(self) -> int:
        """Tokens that must be in the KV cache before the next token can be sampled."""
        return self.prompt + self.generated

    def clone(self) -> "Request":
        """A copy with its own lists; past decode segments are left behind."""
        c = Request.__new__(Request)
        for slot in Request.__slots__:
            setattr(c, slot, getattr(self, slot))
        c.segments = []
        c.resume_gaps = list(self.resume_gaps)
        if self.held is not None:
            c.held, c.filled = list(self.held), list(self.filled)
        return c


class PassPlan(NamedTuple):
    """One scheduled pass, as plain data (vLLM's ``SchedulerOutput``).

    Invariants: ``shape.num_decodes`` decodes each take one token; ``chunks`` are
    (request, tokens, prefix) with ``tokens >= 1`` and sum ``shape.prefill_tokens``
    <= ``budget - shape.num_decodes``; KV blocks for all of it are already allocated;
    ``preempted`` requests were sent back to the waiting queue while scheduling.
    """

    index: int
    budget: int
    shape: PassShape
    chunks: tuple[tuple[Request, int, int], ...]
    preempted: tuple[Request, ...]


class SchedulerState:
    """What a budget policy sees before a pass, in :mod:`envs.state`'s vocabulary: every
    name of ``envs.state.QUANTITIES`` but the slack counts (``FIELDS``), counted as it says
    (``tests/test_state.py`` checks them against ``envs.state.read_requests`` over the same
    requests). The slack counts depend on an ITL target: :meth:`itl_slack` reads them.

    A live, read-only view of the simulator, valid until the next pass runs (so a policy
    that reads nothing costs nothing); ``state[name]`` reads a quantity by name and
    :meth:`as_dict` takes a snapshot. Beyond the quantities it offers the engine's cost
    model (``cost``: what a time budget is priced with).
    """

    __slots__ = ("_sim",)
    FIELDS = tuple(q.name for q in QUANTITIES if q.name not in SLACK_COUNTS)
    """The quantities :meth:`as_dict` takes (the slack counts need an ITL target)."""

    def __init__(self, sim: "Simulator"):
        self._sim = sim

    @property
    def simulator(self) -> "Simulator":
        """The simulator behind this view (for look-ahead policies that fork it)."""
        return self._sim

    cost = property(lambda self: self._sim.cost)
    running_decodes = property(lambda self: self._sim._num_decodes)
    waiting_requests = property(lambda self: len(self._sim.waiting))
    waiting_prefill_tokens = property(lambda self: self._sim.waiting_prefill_tokens)
    kv_usage = property(lambda self: self._sim._kv_used / self._sim.total_blocks)
    last_step_s = property(lambda self: self._sim.last_pass_s)
    running_requests = property(lambda self: self._sim._num_decodes + len(self._sim.prefilling))
    prefilling_requests = property(lambda self: len(self._sim.prefilling))
    kv_used_blocks = property(lambda self: self._sim._kv_used)
    kv_total_blocks = property(lambda self: self._sim.total_blocks)
    kv_total_tokens = property(lambda self: self._sim.total_blocks * self._sim._block_size)
    max_num_seqs = property(lambda self: self._sim.config.max_num_seqs)
    now_s = property(lambda self: self._sim.now)

    @property
    def decode_context_tokens(self) -> int:
        sim = self._sim
        return sim._offset_sum + sim._num_decodes * sim.pass_index

    @property
    def head_prefilled_tokens(self) -> int:
        sim = self._sim
        if sim.prefilling:
            return sim.prefilling[0].computed
        return sim.waiting_head_hit() if sim.waiting else 0

    @property
    def head_remaining_tokens(self) -> int:
        head = self._sim.head()
        return head.target - self.head_prefilled_tokens if head else 0

    @property
    def head_cached_tokens(self) -> int:
        sim = self._sim
        if sim.prefilling:
            return sim.prefilling[0].first_cached_tokens
        return sim.waiting_head_hit() if sim.waiting else 0

    @property
    def next_prefills(self) -> tuple[tuple[int, int], ...]:
        sim = self._sim
        if sim._prefix is None:
            return ()
        out = [(r.computed, r.target - r.computed) for r in islice(sim.prefilling, 1, NEXT_PREFILLS + 1)]
        start = 0 if sim.prefilling else 1
        out += [(r.joined_cached_tokens, r.target - r.computed - r.joined_cached_tokens)
                for r in islice(sim.waiting, start, start + NEXT_PREFILLS - len(out))]
        return tuple(out)

    @property
    def oldest_wait_s(self) -> float:
        return self._sim.oldest_wait_s()

    @property
    def free_ride_tokens(self) -> int:
        sim = self._sim
        return int(free_ride_root(sim.cost, sim._num_decodes, self.decode_context_tokens,
                                  self.head_prefilled_tokens))

    def itl_slack(self, itl_s: float) -> ItlSlackMeter:
        """The slack counts at ITL target ``itl_s`` (``itl_slow_tokens`` and
        ``itl_decode_tokens``: ``Simulator.itl_slack``)."""
        return self._sim.itl_slack(itl_s)

    def __getitem__(self, name: str):
        return getattr(self, name)

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}


Policy = Callable[[SchedulerState], int]


def _passes_to_reach(A: float, B: float, K: int, D: float) -> int:
    """The fewest passes k in [1, K] of an arithmetic sequence of durations A + B*i whose
    total k*(A + B*(k-1)/2) reaches D (K when none before does): the quadratic's root,
    then corrected by whole passes for rounding."""
    h = A - B / 2
    k = max(1, min(K, math.ceil((-h + math.sqrt(h * h + 2 * B * D)) / B)))
    while k > 1 and (k - 1) * (A + B * (k - 2) / 2) >= D:
        k -= 1
    while k < K and k * (A + B * (k - 1) / 2) < D:
        k += 1
    return k


class Simulator:
    """One engine serving one workload. Deterministic: a profile's step jitter is a fixed
    sequence of draws by pass index (``jitter_draws``), and nothing else is drawn."""

    def __init__(self, hardware: HardwareProfile | str, model: ModelProfile | str,
                 workload: Workload | None = None, config: EngineConfig | None = None,
                 record_shapes: bool = False, summary_only: "SLO | None" = None):
        """``record_shapes``: also keep every pass's shape and every finished request's decode
        segments (tests). ``summary_only``: keep no record of finished requests or past
        passes, only :meth:`~envs.metrics.StreamedResult.summary`'s figures under this SLO,
        in memory that does not grow with the run (percentiles within 0.05%)."""
        self.hardware = get_hardware(hardware)
        self.model = get_model(model)
        self.config = config or EngineConfig()
        self.roofline = Roofline.of(self.hardware, self.model)
        self.cost = self.roofline.coefficients()
        """The engine's cost model: every pass is priced by envs.pricing from it (the hot
        loops below unroll the formula; tests check every pass against pass_price)."""
        hw = self.hardware
        self._jitter = jitter_draws(hw.step_jitter)
        self._jitter_scale = (hw.step_jitter_s, hw.step_jitter_share)
        """A pass with prefill work priced ``t`` takes ``t + (a + b * t) * _jitter[pass index %
        JITTER_DRAWS]`` with ``(a, b) = _jitter_scale``, never under half its price (None:
        its price). Decode-only passes take their price: their stretches are one arithmetic
        sequence, and they stay far below the ITL target wherever a budget matters
        (``HardwareProfile.step_jitter``)."""
        self.total_blocks = self.config.kv_blocks(self.hardware, self.model)
        self._block_size = self.config.block_size
        self._chunk_cap = self.config.long_prefill_token_threshold or NO_CAP
        self.workload = workload if workload is not None else Workload.from_arrays([], [], [])
        self._check_every_request_fits()
        self._view_workload()
        self._hash_block_tokens = self.workload.hash_block_tokens or 1
        self._prefix = (PrefixCache(self.total_blocks) if self.config.enable_prefix_caching
                        and self.workload.block_hashes is not None else None)
        """The cached blocks (None: prefix caching off, or a workload without block ids)."""
        if self._prefix is not None:
            check_hash_block_tokens(self._hash_block_tokens, self._block_size)
        self._head_hit = (None, 0)  # (pass, request) and its hit: waiting_head_hit's last answer
        self._freeing: list | None = None  # (prefix caching) requests finished in this pass
        self._joining: list[Request] = []  # (prefix caching) requests preempted in this pass
        self.prefix_counts = PrefixCounts()
        """What prefix caching served (counted only with it)."""
        self._next_arrival = 0  # index of the next arrival
        self.log = PassLog()
        self._slack: dict[float, SlackCounter] = {}
        self.stream = None
        if summary_only is not None:
            require(not record_shapes, "summary_only", summary_only, "keeps no records: not with record_shapes")
            self.stream = StreamingSummary(summary_only, self.total_blocks)
        self.requests = RequestBook(self.log, keep_segments=record_shapes,
                                    sink=self.stream.add_requests if self.stream else None)
        self._next_rid = 0  # ids restart with each simulator (and continue in its forks)
        self.waiting: deque[Request] = deque()
        # Arrived requests in arrival order, those with a first token dropped from the
        # front as they get it: the front is the oldest without one.
        self._awaiting_first: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self._decodes: dict[int, Request] = {}
        self._num_decodes = 0  # running decodes
        self._offset_sum = 0  # sum of decode offsets: total decode context = this + decodes * pass
        self._by_residue = [0] * self._block_size  # decodes by offset modulo the block size
        self._offset_blocks = 0  # sum of offset // block size over decodes
        self._kv_used = 0  # KV blocks in use
        self._finish_at: dict[int, list[Request]] = {}
        self._finish_heap: list[int] = []  # finish passes; stale entries dropped lazily
        self._admit_seq = 0
        self.pass_index = 0
        self.now = 0.0
        self.waiting_prefill_tokens = 0
        self.preemptions = 0
        self.finished = 0
        self.last_pass_s = 0.0
        self._shapes: list[PassShape] | None = [] if record_shapes else None
        self._pending_decision = False
        self._decode_alloc_pass = -1
        self._view = SchedulerState(self)
        # Running TTFT sums: requests still waiting for their first token, and the TTFT
        # of those that have it (see ttft_accrued).
        self._first_wait_n = 0
        self._first_wait_arrivals = 0.0
        self._ttft_sum = 0.0

    def _view_workload(self) -> None:
        """Views of the workload's (read-only) arrays, indexed one request at a time on the hot
        path: they give Python numbers as fast as a list, without a copy."""
        self._arrival_s = memoryview(self.workload.arrival_s)
        self._prompt_tokens = memoryview(self.workload.prompt_tokens)
        self._output_tokens = memoryview(self.workload.output_tokens)

    def __getstate__(self) -> dict:  # a memoryview does not pickle: copies take the views afresh
        state = dict(self.__dict__)
        for name in ("_arrival_s", "_prompt_tokens", "_output_tokens", "_jitter"):
            del state[name]  # the jitter's draws are made afresh from the profile (cached)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._view_workload()
        self._jitter = jitter_draws(self.hardware.step_jitter)

    def _check_every_request_fits(self) -> None:
        """A request whose prompt and output exceed the whole KV cache could never run."""
        w, bs = self.workload, self._block_size
        if not len(w):
            return
        blocks = (w.prompt_tokens + w.output_tokens + bs - 1) // bs
        if int(blocks.max()) > self.total_blocks:
            i = int(blocks.argmax())
            cache = (f"num_kv_blocks={self.total_blocks} blocks of {bs} tokens"
                     if self.config.num_kv_blocks is not None else
                     f"the whole cache of {self.model.name} on {self.hardware.name}")
            raise ConfigError(
                f"prompt_tokens+output_tokens of request {i}: got "
                f"{int(w.prompt_tokens[i] + w.output_tokens[i])} tokens of KV cache, must be <= "
                f"{self.total_blocks * bs} ({cache})")

    # Fields a fork shares (never mutated after construction), copies (live state;
    # requests are cloned) and starts afresh (records). A test checks that every field
    # is in exactly one of them, so a new field cannot be forgotten here.
    _FORK_SHARED = ("hardware", "model", "config", "roofline", "cost", "total_blocks",
                    "_block_size", "_chunk_cap", "workload", "_arrival_s", "_prompt_tokens",
                    "_output_tokens", "_jitter", "_jitter_scale", "_hash_block_tokens")
    _FORK_COPIED = ("_next_arrival", "_next_rid", "_num_decodes", "_offset_sum", "_offset_blocks",
                    "_kv_used", "_admit_seq",
                    "pass_index", "now", "waiting_prefill_tokens", "preemptions", "finished",
                    "last_pass_s", "_pending_decision", "_decode_alloc_pass", "_first_wait_n",
                    "_first_wait_arrivals", "_ttft_sum", "_head_hit", "_freeing")
    _FORK_CLONED = ("requests", "waiting", "_awaiting_first", "prefilling", "_decodes", "_finish_at",
                    "_finish_heap", "_by_residue", "_slack", "_prefix", "prefix_counts")
    _FORK_FRESH = ("log", "_shapes", "_view", "stream", "_joining")

    def fork(self, future: Workload | None = None,
             outputs: dict[int, int] | None = None) -> "Simulator":
        """A copy of the live state that can run ahead without touching this simulator.

        Finished requests and the records of past passes are left behind (the fork starts
        with an empty log and only the live requests, cloned), so a fork costs about the
        number of requests in flight. Used by look-ahead controllers. With ``future`` (a
        workload whose arrival times are this simulator's clock), the fork's requests yet
        to arrive are those of ``future`` from now on instead of this stream's: a sampled
        future, where the stream's own is one a controller could not know. A request of
        it that could never fit in the KV cache is left out. With ``outputs`` (request id ->
        output tokens, for requests in flight), those requests end after that many tokens
        in the fork instead of their own (never before the next token, never beyond what
        the KV cache holds): an engine does not know when a request will stop.
        """
        new = Simulator.__new__(Simulator)
        for name in self._FORK_SHARED + self._FORK_COPIED:
            setattr(new, name, getattr(self, name))
        if future is not None:
            new.workload = self._with_future(future)
            new._view_workload()
        clones: dict[int, Request] = {}

        def clone(r: Request) -> Request:
            c = clones.get(r.rid)
            if c is None:
                c = clones[r.rid] = r.clone()
            return c

        new.waiting = deque(clone(r) for r in self.waiting)
        new._awaiting_first = deque(clone(r) for r in self._awaiting_first if not r.generated)
        new.prefilling = [clone(r) for r in self.prefilling]
        new._decodes = {rid: clone(r) for rid, r in self._decodes.items()}
        new._finish_at = {p: [clone(r) for r in rs] for p, rs in self._finish_at.items()}
        new._finish_heap = list(self._finish_heap)
        new._by_residue = list(self._by_residue)
        new._prefix = self._prefix.copy() if self._prefix is not None else None
        new.prefix_counts = replace(self.prefix_counts)
        new.log = PassLog(self.pass_index)
        if outputs:
            new._set_outputs(clones, outputs)
        new._slack = {itl: c.forked(self.log, self.now, new.log.position())
                      for itl, c in self._slack.items()}  # this simulator's counts stay as they are
        new.stream = None
        new.requests = RequestBook(new.log)
        for r in sorted(clones.values(), key=lambda r: (r.arrival, r.rid)):
            new.requests.add(r)
        new._shapes = None
        new._view = SchedulerState(new)
        new._joining = []
        return new

    def generated_so_far(self) -> dict[int, int]:
        """Output tokens sampled so far by each request in flight (waiting, prefilling or
        decoding), by request id."""
        out = {r.rid: r.generated for r in self.waiting}
        out.update((r.rid, r.generated) for r in self.prefilling)
        p = self.pass_index
        out.update((rid, r.generated_at_start + p - r.decode_start) for rid, r in self._decodes.items())
        return out

    def _set_outputs(self, clones: dict[int, Request], outputs: dict[int, int]) -> None:
        """(fork) The cloned requests' output lengths set to ``outputs``, their finishes anew."""
        room = self.total_blocks * self._block_size
        generated = self.generated_so_far()
        for rid, out in outputs.items():
            r = clones.get(rid)
            if r is None:
                continue
            out = max(min(int(out), room - r.prompt), generated[rid] + 1)
            if rid in self._decodes:
                r.finish_pass += out - r.output
            r.output = out
        self._finish_at = {}
        for r in self._decodes.values():
            self._finish_at.setdefault(r.finish_pass, []).append(r)
        self._finish_heap = sorted(self._finish_at)  # a sorted list is a heap

    def _with_future(self, future: Workload) -> Workload:
        """This stream's requests that have arrived, then ``future``'s from now on."""
        w, k, bs = self.workload, self._next_arrival, self._block_size
        keep = (future.arrival_s >= self.now) & (
            (future.prompt_tokens + future.output_tokens + bs - 1) // bs <= self.total_blocks)
        hashes = None
        if w.block_hashes is not None or future.block_hashes is not None:
            hashes = ((w.block_hashes[:k] if w.block_hashes is not None else (None,) * k)
                      + (tuple(future.block_hashes[i] for i in np.flatnonzero(keep))
                         if future.block_hashes is not None else (None,) * int(keep.sum())))
        return Workload(np.concatenate([w.arrival_s[:k], future.arrival_s[keep]]),
                        np.concatenate([w.prompt_tokens[:k], future.prompt_tokens[keep]]),
                        np.concatenate([w.output_tokens[:k], future.output_tokens[keep]]),
                        f"{w.name}+future", hashes, w.hash_block_tokens or future.hash_block_tokens,
                        w.hashes_cover_output)

    def itl_slack(self, itl_s: float) -> ItlSlackMeter:
        """The decode tokens so far over ``itl_s`` and in all, over the last few minutes
        (:mod:`envs.slack`): how much of a p99 target's slack is left."""
        counter = self._slack.get(itl_s)
        if counter is None:  # counts from its first reading on
            counter = self._slack[itl_s] = SlackCounter(itl_s, self.now, self.log.position())
        return counter.update(self.log, self.now)

    # --- setting up --------------------------------------------------------------------

    def add_running(self, context_tokens: int, output_tokens: int) -> None:
        """Start a request already decoding with ``context_tokens`` in its KV cache and
        ``output_tokens`` still to generate (a warm start; excluded from the metrics)."""
        integer("context_tokens", context_tokens, 1, MAX_TOKENS)
        integer("output_tokens", output_tokens, 1, MAX_TOKENS - 1)
        require(self._num_decodes + len(self.prefilling) < self.config.max_num_seqs, "running", self._num_decodes + 1,
                f"must be <= max_num_seqs ({self.config.max_num_seqs})")
        blocks = -(-context_tokens // self._block_size)
        require(self._kv_used + blocks <= self.total_blocks, "running x context_tokens",
                context_tokens, f"the running users' KV must fit in {self.total_blocks} blocks")
        r = Request(self._next_rid, self.now, context_tokens, output_tokens + 1, warm=True)
        self._next_rid += 1
        self.requests.add(r)
        r.generated = 1
        r.computed = context_tokens
        r.blocks = blocks
        self._kv_used += blocks
        self._admit(r)
        r.first_token_s = r.last_token_s = self.now
        self._start_decode(r, self.pass_index - 1)

    # --- state ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return (self._next_arrival >= len(self._arrival_s) and not self.waiting and not self.prefilling
                and self._num_decodes == 0)

    def head(self) -> Request | None:
        """The request next in line for prefill: the first partially prefilled one, else
        the first waiting one."""
        if self.prefilling:
            return self.prefilling[0]
        return self.waiting[0] if self.waiting else None

    def waiting_head_hit(self) -> int:
        """The tokens the first waiting request would find cached if admitted now (0 without
        prefix caching): what vLLM's ``KVCacheManager.get_computed_blocks`` looks up. The
        pass's own allocations, made before it is admitted, may evict some of them."""
        r = self.waiting[0]
        if self._prefix is None or r.held is None:
            return 0
        key = (self.pass_index, r.rid)
        if self._head_hit[0] != key:
            self._prefix.settle(self._kv_used)
            bs = self._block_size
            self._head_hit = (key, self._prefix.hits(self._units(r), (r.target - 1) // bs)[0] * bs)
        return self._head_hit[1]

    def oldest_wait_s(self) -> float:
        """``envs.state``'s oldest_wait_s: how long the earliest-arrived request without a
        first token has waited (a preempted request has had one); 0 without one."""
        awaiting = self._awaiting_first
        return self.now - awaiting[0].arrival if awaiting else 0.0

    def state(self) -> SchedulerState:
        return self._view

    def ttft_accrued(self) -> float:
        """Sum over arrived requests of the time each has waited for its first token so far
        (its TTFT once it has one). Its growth between two decisions is the TTFT that the
        passes in between cost."""
        return self._ttft_sum + self._first_wait_n * self.now - self._first_wait_arrivals

    @property
    def num_awaiting_first_token(self) -> int:
        return self._first_wait_n

    # --- running -------------------------------------------------------------------------

    def run(self, policy: Policy) -> "SimResult":
        """Serve the whole workload, asking ``policy`` for each budget that matters."""
        # A run allocates many small acyclic objects; the cyclic collector's passes over
        # them cost about a third of the run and free nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            state, advance, schedule, execute = self._view, self.advance, self._schedule, self._execute
            while advance():
                budget = policy(state)
                if budget.__class__ is int and 0 < budget <= MAX_TOKENS and budget >= self._num_decodes:
                    self._pending_decision = False  # step(budget), its checks passed
                    execute(schedule(budget))
                else:
                    self.step(budget)  # converts a numpy integer, or refuses the budget
            return self.result()
        finally:
            if collecting:
                gc.enable()

    def result(self) -> "SimResult":
        return StreamedResult(self) if self.stream is not None else SimResult.of(self)

    def advance(self, until_s: float = INF) -> bool:
        """Simulate passes that need no decision. True when the next pass needs a budget;
        False when everything has finished (or the clock passed ``until_s``)."""
        if len(self.log.runs) > FLUSH_VALUES:  # between decisions, a stretch adds a few runs
            self._file_away()
        arrivals, n_arrivals = self._arrival_s, len(self._arrival_s)
        max_seqs = self.config.max_num_seqs
        while True:
            if self._next_arrival < n_arrivals and arrivals[self._next_arrival] <= self.now:
                self._admit_arrivals()
            if self.prefilling or (self.waiting and self._num_decodes < max_seqs):
                self._pending_decision = True  # a partial prefill, or a waiting request with room
                return True
            if self.now >= until_s:
                return False
            if self._num_decodes == 0:
                if self._next_arrival >= n_arrivals:
                    return False  # nothing running, waiting or still to arrive
                gap = arrivals[self._next_arrival] - self.now
                if gap > 0:
                    self.log.idle += (self.pass_index, gap)
                    self.now = arrivals[self._next_arrival]
                continue
            if not self._decode_stretch(until_s):
                self._execute(self._schedule(self._num_decodes))  # the next decode pass must preempt

    def step(self, budget: int) -> None:
        """Run the pass that :meth:`advance` stopped at, with ``budget`` tokens."""
        if not self._pending_decision:
            raise RuntimeError("step() called without a pending decision; call advance() first")
        if (not isinstance(budget, (int, np.integer)) or isinstance(budget, bool)
                or not max(self._num_decodes, 1) <= budget <= MAX_TOKENS):
            raise ConfigError(f"budget: got {show(budget)}, must be an integer >= {max(self._num_decodes, 1)} "
                              f"(the running decodes each take one token) and <= {MAX_TOKENS}")
        self._pending_decision = False
        self._execute(self._schedule(int(budget)))

    def _file_away(self) -> None:
        """Move the pass log and the finished requests into compact blocks; a summary-only
        simulator folds the passes no live request still needs into its figures instead."""
        self.requests.flush()
        if self.stream is not None:
            needed = self.pass_index
            for r in self.requests.live():  # a live request's worst gap still reads its passes
                if r.segments:
                    needed = min(needed, r.segments[0][0])
                elif r.rid in self._decodes:
                    needed = min(needed, r.decode_start)
            for counter in self._slack.values():  # count the passes before letting them go
                counter.update(self.log, self.now)
            dropped = self.log.drop_before(needed)
            if dropped is not None:
                self.stream.add_passes(dropped)

    def _admit_arrivals(self) -> None:
        arr = self._arrival_s
        now = self.now
        i = self._next_arrival
        while i < len(arr) and arr[i] <= now:
            r = Request(self._next_rid, arr[i], self._prompt_tokens[i], self._output_tokens[i])
            self._next_rid += 1
            if self._prefix is not None:
                self._name_blocks(r, i)
                self._note_joined(r)
            self.requests.add(r)
            self.waiting.append(r)
            self._awaiting_first.append(r)
            self.waiting_prefill_tokens += r.prompt
            self._first_wait_n += 1
            self._first_wait_arrivals += r.arrival
            i += 1
        self._next_arrival = i

    # --- one pass with prefill work: schedule, then execute --------------------------------

    def _schedule(self, budget: int) -> PassPlan:
        """Decide this pass (vLLM's ``schedule()``): allocate the decodes' KV slots,
        preempting if blocks run out; continue partial prefills in admission order; then,
        unless something was preempted, admit waiting requests in arrival order."""
        p = self.pass_index
        victims: list[Request] = []
        need = self._by_residue[-p % self._block_size]
        if self._kv_used + need <= self.total_blocks:  # the decodes' slots fit: nobody is preempted
            self._kv_used += need
            self._decode_alloc_pass = p
        else:
            self._allocate_decode_slots(p, victims)
        chunks: list[tuple[Request, int, int]] = []
        left = budget - self._num_decodes
        # vLLM lifts the cap when a single request is running or waiting: nobody to starve
        cap = self._chunk_cap if self._num_decodes + len(self.prefilling) + len(self.waiting) > 1 else NO_CAP
        if self.prefilling:
            left = self._schedule_partials(left, chunks, victims, cap)
        if not victims and self.waiting:
            if self._prefix is None:
                self._admit_waiting(left, chunks, cap)
            else:
                self._admit_waiting_cached(left, chunks, cap)
        n = self._num_decodes
        pre_tokens = pre_prefix = pairs = 0
        for _, x, q in chunks:
            pre_tokens += x
            pre_prefix += q
            pairs += x * q + x * (x + 1) // 2  # == chunk_attention_pairs(x, q)
        # PassShape(...) and PassPlan(...), built as the tuples they are (twice as fast as
        # a named tuple's own constructor, once for every pass that carries prefill)
        shape = _new_tuple(PassShape, (n, self._offset_sum + n * p, pre_tokens, pre_prefix, pairs))
        return _new_tuple(PassPlan, (p, budget, shape, tuple(chunks), tuple(victims)))

    def _allocate_decode_slots(self, p: int, victims: list[Request]) -> None:
        """Every decode's token of pass ``p`` needs a KV slot; those at a block boundary
        need a new block. Preempt the latest admitted until they fit."""
        bs, total = self._block_size, self.total_blocks
        need = self._by_residue[-p % bs]
        while self._kv_used + need > total:
            victim = self._latest_running()
            if victim.rid in self._decodes and (victim.offset + p) % bs == 0:
                need -= 1
            self._preempt(victim)
            victims.append(victim)
        self._kv_used += need
        self._decode_alloc_pass = p  # decodes hold this pass's slot from here on

    def _schedule_partials(self, left: int, chunks: list, victims: list[Request], thresh: int) -> int:
        """Chunks for partially prefilled requests, in admission order, each at most
        ``thresh`` tokens; the budget left."""
        bs, total = self._block_size, self.total_blocks
        for r in list(self.prefilling) if self.prefilling else ():
            # A request preempted earlier in this pass is not scheduled, and neither is
            # anything admitted after it (victims go latest-first).
            if left <= 0 or r.admit_seq < 0:
                break
            q = r.computed
            x = min(r.prompt + r.generated - q, thresh, left)
            new_blocks = -(-(q + x) // bs) - r.blocks
            while self._kv_used + new_blocks > total:
                victim = self._latest_running()
                self._preempt(victim)
                victims.append(victim)
                if victim is r:
                    break
            if r.admit_seq < 0:  # r itself was preempted: vLLM stops scheduling here
                break
            r.blocks += new_blocks
            self._kv_used += new_blocks
            if self._prefix is not None:  # the blocks this chunk fills are cached now, after
                self._prefix.settle(self._kv_used)  # what allocating them evicted
                self._prefix.fill(self._units(r), r.held, r.filled, (q + x) // bs)
            chunks.append((r, x, q))
            left -= x
        return left

    def _admit_waiting(self, left: int, chunks: list, thresh: int) -> None:
        """Admit waiting requests in arrival order while budget, sequences and KV blocks
        last, each chunk at most ``thresh`` tokens."""
        waiting, prefilling = self.waiting, self.prefilling
        bs, total = self._block_size, self.total_blocks
        max_seqs = self.config.max_num_seqs
        used = self._kv_used
        while waiting and left > 0 and self._num_decodes + len(prefilling) < max_seqs:
            r = waiting[0]
            x = min(r.prompt + r.generated, thresh, left)
            nb = -(-x // bs)
            # vLLM admits a request only if its whole sequence fits in the free blocks
            # (scheduler_reserve_full_isl, on by default), though it allocates the chunk's
            if used + -(-(r.prompt + r.generated) // bs) > total:
                break
            waiting.popleft()
            r.admit_seq = self._admit_seq
            self._admit_seq += 1
            prefilling.append(r)
            r.blocks = nb
            used += nb
            chunks.append((r, x, 0))
            left -= x
        self._kv_used = used

    def _admit_waiting_cached(self, left: int, chunks: list, thresh: int) -> None:
        """``_admit_waiting`` with prefix caching: each request admitted starts from the
        longest run of its leading blocks still cached (at most those before its last
        token, which it computes to sample: vLLM's ``max_cache_hit_length``). Its cached
        tokens are computed already: they take none of the budget and no new block, only
        the blocks of theirs that sat in the free queue; its chunk reads them as a prefix.
        Like vLLM, the whole sequence must fit in the free blocks, less those it shares
        with running requests."""
        waiting, prefilling, cache = self.waiting, self.prefilling, self._prefix
        bs, total = self._block_size, self.total_blocks
        max_seqs = self.config.max_num_seqs
        counts = self.prefix_counts
        while waiting and left > 0 and self._num_decodes + len(prefilling) < max_seqs:
            r = waiting[0]
            target = r.prompt + r.generated
            cache.settle(self._kv_used)  # what earlier allocations evicted is gone
            units = self._units(r)
            hit, from_queue = cache.hits(units, (target - 1) // bs)
            if self._kv_used + -(-target // bs) - (hit - from_queue) > total:
                break
            waiting.popleft()
            r.admit_seq = self._admit_seq
            self._admit_seq += 1
            prefilling.append(r)
            cache.acquire(units, hit, r.held, r.filled)
            cached = hit * bs
            if r.generated == 0 and not r.preemptions:
                r.first_cached_tokens = cached
                counts.first_admissions += 1
                counts.hit_admissions += hit > 0
                counts.first_prompt_tokens += r.prompt
                counts.first_cached_tokens += cached
            counts.cached_tokens += cached
            r.computed = cached
            self.waiting_prefill_tokens -= cached - r.joined_cached_tokens
            r.joined_cached_tokens = 0
            x = min(target - cached, thresh, left)
            r.blocks = -(-(cached + x) // bs)
            self._kv_used += r.blocks - hit + from_queue
            cache.settle(self._kv_used)  # vLLM allocates (and evicts), then caches
            cache.fill(units, r.held, r.filled, (cached + x) // bs)
            chunks.append((r, x, cached))
            left -= x

    def _note_joined(self, r: Request) -> None:
        """(prefix caching) r joined the waiting queue (it arrived, or the pass that
        preempted it has run): what is cached of it now counts out of the tokens still to
        prefill (``envs.state``'s *cached* for a waiting request)."""
        self._prefix.settle(self._kv_used)
        bs = self._block_size
        hit = self._prefix.hits(self._units(r), (r.target - 1) // bs)[0] * bs
        r.joined_cached_tokens = hit
        self.waiting_prefill_tokens -= hit

    def _name_blocks(self, r: Request, i: int) -> None:
        """(prefix caching) Arrival ``i``'s block ids and the tokens they cover."""
        w = self.workload
        r.held, r.filled = [], []
        ids = w.block_hashes[i] if w.block_hashes is not None else None
        if ids is None:
            return
        r.block_ids = ids
        r.covered = min(len(ids) * self._hash_block_tokens,
                        r.prompt + (r.output if w.hashes_cover_output else 0))

    def _units(self, r: Request) -> Units:
        """(prefix caching) r's units, made on first use."""
        if r.units is None:
            r.units = units_of(r.block_ids, self._hash_block_tokens, r.covered, self._block_size, r.rid,
                               (r.prompt + r.output) // self._block_size)
        return r.units

    def _execute(self, plan: PassPlan) -> None:
        """Run a scheduled pass: price it, advance the clock, apply its tokens (vLLM's
        ``update_from_output``), and record it."""
        p, shape = plan.index, plan.shape
        n, ctx, prefill, prefix, pairs = shape
        # envs.pricing.pass_price(self.cost, *shape), unrolled
        weights_s, kv_s, token_s, pair_s, e, fixed_s, serial_s = self.cost
        tokens = n + prefill
        m = weights_s + kv_s * (ctx + prefix + tokens)
        c = token_s * tokens + pair_s * (ctx + n + pairs)
        dt = (m + e * c if m > c else c + e * m) + (fixed_s + serial_s * tokens)
        if self._jitter is not None and prefill:
            a, b = self._jitter_scale
            j = (a + b * dt) * self._jitter[p & (JITTER_DRAWS - 1)]
            dt = dt + j if j > -0.5 * dt else 0.5 * dt
        now = self.now + dt
        self.now = now
        self.last_pass_s = dt
        log = self.log
        log.runs += (1, dt, 0.0, n)
        if self._shapes is not None:
            self._shapes.append(shape)
        self.pass_index = p + 1
        self.waiting_prefill_tokens -= prefill
        if self._prefix is not None:
            self._freeing = []
        for r, x, _ in plan.chunks:
            r.computed += x
            if r.computed == r.prompt + r.generated:
                self._complete_prefill(r, p, now)
        if p in self._finish_at:
            self._finish_decodes(p)
        if self._prefix is not None:
            self._free_finished()
            if self._joining:
                for r in self._joining:
                    if r.admit_seq < 0:  # still waiting
                        self._note_joined(r)
                self._joining.clear()
        log.prefill += (p, prefill, plan.budget, len(plan.chunks), self._kv_used)

    def _complete_prefill(self, r: Request, p: int, now: float) -> None:
        """r's whole prompt (or recomputation) is in the cache: it samples a token."""
        self.prefilling.remove(r)
        r.generated += 1
        if r.generated == 1:
            awaiting = self._awaiting_first
            while awaiting and awaiting[0].generated:
                awaiting.popleft()
            r.first_token_s = now
            self._first_wait_n -= 1
            self._first_wait_arrivals -= r.arrival
            self._ttft_sum += now - r.arrival
        else:  # resumed after a preemption: the whole wait is one gap
            r.resume_gaps.append(now - r.last_token_s)
        r.last_token_s = now
        if r.generated >= r.output:
            if self._freeing is not None:
                self._freeing.append(r)
            else:
                self._release(r, r.blocks)
            r.finish_s = now
            self.finished += 1
            self.requests.finish(r)
        else:
            self._start_decode(r, p)

    # --- decode-only stretches ------------------------------------------------------------

    def _decode_stretch(self, until_s: float) -> bool:
        """Decode-only passes until an arrival, a completion or ``until_s``. False when the
        next pass needs KV blocks that are not free (the caller preempts)."""
        n, offset_sum, bs = self._num_decodes, self._offset_sum, self._block_size
        used, total = self._kv_used, self.total_blocks
        p, now = self.pass_index, self.now
        # In K passes a decode needs at most ceil(K / bs) new blocks, so this many passes
        # cannot run out; near capacity, go one pass at a time with the exact count.
        limit = p + bs * ((total - used) // n)
        if limit == p:
            if used + self._by_residue[-p % bs] > total:
                return False
            limit = p + 1
        heap, finish_at = self._finish_heap, self._finish_at
        while heap and heap[0] not in finish_at:  # the next pass in which decodes finish
            heapq.heappop(heap)
        nf = heap[0] if heap else INF
        if nf < limit:
            limit = nf + 1  # stop after the pass in which decodes finish
        i = self._next_arrival
        stop = self._arrival_s[i] if i < len(self._arrival_s) else INF
        if until_s < stop:
            stop = until_s
        # envs.pricing.pass_price(self.cost, n, context) of pass q, whose decodes' context is
        # offset_sum + n * q: memory and compute are each linear in q.
        weights_s, kv_s, token_s, pair_s, e, fixed_s, serial_s = self.cost
        outside = fixed_s + serial_s * n  # n tokens in every pass of the stretch
        # Pass q's price is linear in q on each side of the roofline's max; when both
        # ends of the stretch lie on the same side, the whole stretch is one arithmetic
        # sequence A + B*i and its length follows from a quadratic.
        x0 = offset_sum + n * (p + 1)
        x1 = offset_sum + n * limit
        m0, c0 = weights_s + kv_s * x0, token_s * n + pair_s * x0
        m1, c1 = weights_s + kv_s * x1, token_s * n + pair_s * x1
        p0 = p
        if (m0 >= c0) == (m1 >= c1):
            if m0 >= c0:
                A, B = m0 + e * c0 + outside, (kv_s + e * pair_s) * n
            else:
                A, B = c0 + e * m0 + outside, (pair_s + e * kv_s) * n
            k = K = limit - p
            D = stop - now
            if D < INF and K * (A + B * (K - 1) / 2) >= D:  # the arrival comes within the stretch
                k = _passes_to_reach(A, B, K, D)
            now += k * (A + B * (k - 1) / 2)
            dt = A + B * (k - 1)
            p += k
            self.log.runs += (k, A, B, n)
        else:
            dt = self.last_pass_s
            runs = self.log.runs
            while p < limit:
                x = offset_sum + n * (p + 1)  # context read + tokens written == (query, key) pairs
                m = weights_s + kv_s * x
                c = token_s * n + pair_s * x
                dt = (m + e * c if m > c else c + e * m) + outside
                runs += (1, dt, 0.0, n)
                now += dt
                p += 1
                if now >= stop:
                    break
        # Blocks allocated in passes [p0, p): in pass q, the decodes whose offset is -q modulo
        # the block size (their context reaches a block boundary); every decode once per
        # block size of passes. (_decode_blocks(p) - _decode_blocks(p0), without the sums.)
        full, rest = divmod(p - p0, bs)
        grown = n * full
        if rest:
            by_residue, j = self._by_residue, -p0 % bs
            lo = j - rest + 1
            grown += sum(by_residue[lo:j + 1]) if lo >= 0 else (sum(by_residue[:j + 1])
                                                                + sum(by_residue[bs + lo:]))
        self._kv_used = used + grown
        self.pass_index, self.now, self.last_pass_s = p, now, dt
        if self._shapes is not None:
            for q in range(p0, p):
                self._shapes.append(PassShape(n, offset_sum + n * q))
        if p - 1 == nf:
            self._finish_decodes(nf)
        return True

    def _decode_blocks(self, p: int) -> int:
        """KV blocks the decodes hold at the start of pass p: sum of ceil((offset + p) / bs).

        With offset = bs*k + j and p = bs*a + b, ceil((offset + p) / bs) = k + a
        + [j + b >= 1] + [j + b >= bs + 1], summed per residue class j.
        """
        bs, by_residue, n = self._block_size, self._by_residue, self._num_decodes
        a, b = divmod(p, bs)
        blocks = self._offset_blocks + n * a + (n - by_residue[0] if b == 0 else n)
        if b >= 2:
            blocks += sum(by_residue[bs + 1 - b:])
        return blocks

    # --- bookkeeping ------------------------------------------------------------------------

    def _admit(self, r: Request) -> None:
        r.admit_seq = self._admit_seq
        self._admit_seq += 1

    def _start_decode(self, r: Request, last_pass: int) -> None:
        """r sampled a token at the end of ``last_pass``; it decodes from the next pass."""
        start = last_pass + 1
        r.offset = r.computed - start  # context at pass q is offset + q
        r.decode_start = start
        r.generated_at_start = r.generated
        r.finish_pass = last_pass + r.output - r.generated
        self._decodes[r.rid] = r
        self._num_decodes += 1
        self._offset_sum += r.offset
        self._offset_blocks += r.offset // self._block_size
        self._by_residue[r.offset % self._block_size] += 1
        waiting_list = self._finish_at.get(r.finish_pass)
        if waiting_list is None:
            self._finish_at[r.finish_pass] = [r]
            heapq.heappush(self._finish_heap, r.finish_pass)
        else:
            waiting_list.append(r)

    def _stop_decode(self, r: Request, end_pass: int) -> None:
        """r decoded in passes [dec_start, end_pass); bring its counters up to date."""
        del self._decodes[r.rid]
        self._num_decodes -= 1
        self._offset_sum -= r.offset
        self._offset_blocks -= r.offset // self._block_size
        self._by_residue[r.offset % self._block_size] -= 1
        r.generated = r.generated_at_start + end_pass - r.decode_start
        r.computed = r.offset + end_pass
        r.blocks = -(-r.computed // self._block_size)
        if end_pass > r.decode_start:
            r.segments.append((r.decode_start, end_pass))

    def _finish_decodes(self, p: int) -> None:
        now, finish = self.now, self.requests.finish
        done = self._finish_at.pop(p)
        for r in done:
            self._stop_decode(r, p + 1)
            r.finish_s = r.last_token_s = now
            if self._prefix is not None:
                if self._freeing is None:
                    self._freeing = []
                self._freeing.append(r)
            else:
                self._kv_used -= r.blocks  # (_release)
                r.blocks, r.admit_seq = 0, -1
            finish(r)
        self.finished += len(done)
        if self._prefix is not None:
            self._free_finished()

    def _free_finished(self) -> None:
        """(prefix caching) Release the requests that finished this pass in the order vLLM
        frees them, its running list's (``Scheduler.update_from_output`` walks the step's
        requests in the order scheduled): the order their blocks join the free queue."""
        freeing, self._freeing = self._freeing, None
        if freeing:
            for r in sorted(freeing, key=lambda r: r.admit_seq):
                self._release(r, r.blocks)

    def _release(self, r: Request, blocks: int) -> None:
        if self._prefix is not None:
            # Its blocks join the free queue (those another request holds stay in use).
            self._prefix.settle(self._kv_used)
            if r.held is None:  # a warm start's blocks: never named
                r.held, r.filled = [], []
            blocks = self._prefix.release(self._units(r), r.held, r.filled,
                                          r.computed // self._block_size, blocks)
        self._kv_used -= blocks
        r.blocks = 0
        r.admit_seq = -1

    def _latest_running(self) -> Request:
        best = None
        for r in self._decodes.values():
            if best is None or r.admit_seq > best.admit_seq:
                best = r
        for r in self.prefilling:
            if best is None or r.admit_seq > best.admit_seq:
                best = r
        if best is None:  # cannot happen: capacity covers any single request
            raise RuntimeError("KV cache exhausted with nothing to preempt")
        return best

    def _preempt(self, r: Request) -> None:
        """Free r's blocks and send it to the front of the queue, to be recomputed."""
        p = self.pass_index
        if r.rid in self._decodes:
            self._finish_at[r.finish_pass].remove(r)
            if not self._finish_at[r.finish_pass]:
                del self._finish_at[r.finish_pass]
            # Preempted by a prefill chunk after this pass's decode slots were allocated
            # (decodes go first): give back the block its slot may have opened.
            slot_block = self._decode_alloc_pass == p and (r.offset + p) % self._block_size == 0
            self._stop_decode(r, p)
            r.blocks += slot_block
            r.last_token_s = self.now
            added = r.target  # its whole context, and its last sampled token, again
        else:
            self.prefilling.remove(r)
            added = r.computed  # the part of its prefill already done, again
        self.waiting_prefill_tokens += added
        r.recomputed += added
        self._release(r, r.blocks)
        r.computed = 0
        if self._prefix is not None:  # what it finds cached, once the pass is scheduled
            self._joining.append(r)
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    # --- checking ---------------------------------------------------------------------------

    def audit(self) -> None:
        """Recompute the running sums from the requests and compare (for tests)."""
        p, bs = self.pass_index, self._block_size
        decs = list(self._decodes.values())
        assert self._num_decodes == len(decs)
        assert self._offset_sum == sum(r.offset for r in decs)
        counts = [0] * bs
        for r in decs:
            counts[r.offset % bs] += 1
        assert counts == self._by_residue
        decode_blocks = sum(-(-(r.offset + p) // bs) for r in decs)
        assert decode_blocks == self._decode_blocks(p)
        assert self._offset_blocks == sum(r.offset // bs for r in decs)
        blocks = decode_blocks + sum(r.blocks for r in self.prefilling)
        if self._prefix is not None:  # a block several requests hold is in the pool once
            blocks -= self._prefix.shared_blocks()
            self._prefix.settle(self._kv_used)  # (what the next read would evict first)
            self._prefix.check(self._kv_used)
        assert blocks == self._kv_used, (blocks, self._kv_used)
        assert self._kv_used <= self.total_blocks
        assert self.waiting_prefill_tokens == sum(
            r.target - r.computed - r.joined_cached_tokens for r in self.waiting) + sum(
            r.target - r.computed for r in self.prefilling)
        assert sum(len(v) for v in self._finish_at.values()) == self._num_decodes

    def pass_records(self, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(duration in seconds, decodes carried) of every pass from pass ``start`` on."""
        return self.log.pass_records(start)

    def pass_durations(self, start: int = 0) -> np.ndarray:
        """Every pass's duration from pass ``start`` on, in seconds."""
        return self.log.pass_records(start)[0]

    def request_gaps(self, index: int) -> np.ndarray:
        """Every inter-token gap of ``self.requests[index]`` in order of its tokens: the passes
        it decoded in, and for each preemption the whole wait before it resumed. With its
        first-token time these give all of its token times."""
        r = self.requests[index]
        durations = self.pass_durations()
        parts, resumes = [], iter(r.resume_gaps)
        for k, (lo, hi) in enumerate(self.requests.segments_of(index)):
            if k:  # a segment after the first follows a preemption and its resumption
                parts.append(np.array([next(resumes)]))
            parts.append(durations[lo:hi])
        rest = list(resumes)  # a resumption that finished the request, or one not yet followed
        if rest:
            parts.append(np.array(rest))
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def shapes(self) -> list[PassShape]:
        if self._shapes is None:
            raise RuntimeError("construct the Simulator with record_shapes=True")
        return self._shapes


def fork(sim: Simulator) -> Simulator:
    """``sim.fork()``: a copy of its live state that can run ahead without touching it."""
    return sim.fork()
