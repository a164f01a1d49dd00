"""The price of one pass, from a cost model's coefficients: the one contract (standard
library only).

Everything in chunkpilot that prices a pass prices it here: the simulator (whose hot
loops are unrolled for speed and checked against this module by property tests), the
time-budget rules, the observation, the calibration fit, the export, and the table
runtime a serving engine imports (``policies.table``, which must not need numpy).

A cost model is seven coefficients in seconds (:class:`Coefficients`): the roofline of
a (hardware, model) pair multiplied out (``envs.cost.Roofline.coefficients``), or the
copy a time-fraction table stores. A pass carrying ``n`` decodes whose KV caches hold
``ctx`` tokens in all, and prefill chunks of ``x`` tokens in all after prefixes of ``q``
tokens in all with ``p`` (query, key) pairs of attention inside the chunks, costs::

    memory  = weights_s + kv_s_per_token * (ctx + q + n + x)   # weights; KV read, KV written
    compute = token_s * (n + x) + pair_s * (ctx + n + p)       # products; attention pairs
    outside = fixed_s + serial_s_per_token * (n + x)           # per pass; small kernels
    total   = max(memory, compute) + exposed * min(memory, compute) + outside

A decode with context c reads c tokens of KV, writes one, and its query attends to c + 1
keys; a chunk of x tokens after a q-token prefix reads the prefix once, writes x tokens
and has ``x * q + x * (x + 1) / 2`` pairs (full against the prefix, causal inside the
chunk: :func:`chunk_attention_pairs`). DESIGN.md section 2 derives the roofline;
``envs/cost.py`` its refinements (overlap, per-layer costs, tensor parallelism).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

COST_FIELDS = ("weights_s", "kv_s_per_token", "token_s", "pair_s", "exposed", "fixed_s",
               "serial_s_per_token")
"""The coefficients' names, as a time-fraction table stores them (``action.cost``)."""


class Coefficients(NamedTuple):
    """A cost model in seconds (see the module docstring). Immutable and hashable: the
    closed-form roots below cache their constants per cost model."""

    weights_s: float
    """Reading the weights once (every pass, whatever it carries)."""
    kv_s_per_token: float
    """Reading or writing one token's KV cache."""
    token_s: float
    """The weight products of one token (2 x params FLOPs)."""
    pair_s: float
    """The attention arithmetic of one (query, key) pair."""
    exposed: float
    """1 - overlap: the share of the shorter of memory and compute time that adds."""
    fixed_s: float
    """Fixed per pass: the engine's overhead, the layers' fixed cost, the all-reduces' latency."""
    serial_s_per_token: float
    """Per token, outside the max: the small kernels and the tensor-parallel all-reduces."""

    @classmethod
    def of(cls, cost: Mapping) -> "Coefficients":
        """From a mapping holding :data:`COST_FIELDS` (a table's ``action.cost``)."""
        return cls(*(float(cost[f]) for f in COST_FIELDS))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(COST_FIELDS, self))


def chunk_attention_pairs(chunk_tokens: int, prefix_tokens: int) -> int:
    """(query, key) pairs of a chunk: full against its prefix, causal inside itself."""
    return chunk_tokens * prefix_tokens + chunk_tokens * (chunk_tokens + 1) // 2


def combine(memory_s, compute_s, exposed, outside_s, maximum=max, minimum=min):
    """A pass's total from its parts: ``max(m, c) + exposed * min(m, c) + outside``. Numbers,
    or arrays with their library's elementwise ``maximum`` and ``minimum`` (the calibration
    fit passes numpy's)."""
    return maximum(memory_s, compute_s) + exposed * minimum(memory_s, compute_s) + outside_s


def pass_times(c: Coefficients, num_decodes: int, decode_context_tokens: int,
               prefill_tokens: int = 0, prefill_prefix_tokens: int = 0,
               prefill_attention_pairs: int = 0) -> tuple[float, float, float]:
    """(memory, compute, outside) seconds of a pass of this shape (the module docstring's
    n, ctx, x, q and p)."""
    n, x = num_decodes, prefill_tokens
    memory = c.weights_s + c.kv_s_per_token * (decode_context_tokens + prefill_prefix_tokens + n + x)
    compute = c.token_s * (n + x) + c.pair_s * (decode_context_tokens + n + prefill_attention_pairs)
    return memory, compute, c.fixed_s + c.serial_s_per_token * (n + x)


def pass_price(c: Coefficients, num_decodes: int, decode_context_tokens: int,
               prefill_tokens: int = 0, prefill_prefix_tokens: int = 0,
               prefill_attention_pairs: int = 0) -> float:
    """Seconds of a pass of this shape."""
    memory, compute, outside = pass_times(c, num_decodes, decode_context_tokens, prefill_tokens,
                                          prefill_prefix_tokens, prefill_attention_pairs)
    return combine(memory, compute, c.exposed, outside)


def chunk_price(c: Coefficients, num_decodes: int, decode_context_tokens: int, chunk_tokens: int,
                prefix_tokens: int = 0) -> float:
    """Seconds of a pass carrying these decodes and one chunk of ``chunk_tokens`` after a
    ``prefix_tokens`` prefix (no prefix without a chunk)."""
    x = chunk_tokens
    q = prefix_tokens if x else 0
    return pass_price(c, num_decodes, decode_context_tokens, x, q, x * q + x * (x + 1) // 2)


def decode_pass_s(c: Coefficients, num_decodes: int, decode_context_tokens: int) -> float:
    """Seconds of a decode-only pass."""
    return chunk_price(c, num_decodes, decode_context_tokens, 0)


def _quadratic_root(a: float, b: float, c: float) -> float:
    """The non-negative root of a*x^2 + b*x + c = 0 with a, b >= 0: 0 when c >= 0 (already
    reached at 0), inf when the left side never grows (a = b = 0: no bound)."""
    if c >= 0:
        return 0.0
    if a <= 0:
        return -c / b if b > 0 else math.inf
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def chunk_within(c: Coefficients, num_decodes: int, decode_context_tokens: int, seconds: float,
                 prefix_tokens: int = 0, cap: int = 1 << 20) -> int:
    """The largest chunk (at most ``cap`` tokens) after a ``prefix_tokens`` prefix whose pass,
    with these decodes, is priced within ``seconds``; 0 when not even one token fits.

    The total is the larger of ``m + exposed * c`` and ``c + exposed * m`` (they swap where
    memory and compute cross), each a quadratic in the chunk size, so each root is closed
    form; the integer boundary is then settled against :func:`chunk_price` itself.
    """
    n, ctx, q = num_decodes, decode_context_tokens, prefix_tokens
    if cap <= 0 or chunk_price(c, n, ctx, 1, q) > seconds:
        return 0
    if chunk_price(c, n, ctx, cap, q) <= seconds:
        return cap
    kv, tok, pair, e = c.kv_s_per_token, c.token_s, c.pair_s, c.exposed
    serial = c.serial_s_per_token  # per token, outside the max
    t = seconds - c.fixed_s - serial * n
    # memory m(x) = m0 + kv*x, compute c(x) = c0 + (tok + pair*(q + 1/2))*x + pair/2*x^2
    m0 = c.weights_s + kv * (ctx + q + n)
    c0 = tok * n + pair * (ctx + n)
    c1, c2 = tok + pair * (q + 0.5), pair / 2
    best = float(cap)
    for qa, qb, qc in ((e * c2, kv + e * c1 + serial, m0 + e * c0 - t),
                       (c2, c1 + e * kv + serial, c0 + e * m0 - t)):
        best = min(best, _quadratic_root(qa, qb, qc))
    x = max(1, min(int(best), cap))
    while x > 1 and chunk_price(c, n, ctx, x, q) > seconds:
        x -= 1
    while x < cap and chunk_price(c, n, ctx, x + 1, q) <= seconds:
        x += 1
    return x


def time_budget(c: Coefficients, num_decodes: int, decode_context_tokens: int, prefix_tokens: int,
                seconds: float, cap: int) -> int:
    """Tokens for a pass priced within ``seconds``: the running decodes plus the largest
    chunk after the head request's ``prefix_tokens`` that fits (:func:`chunk_within`),
    within ``cap`` in all unless the decodes alone exceed it (they all run: then just
    them). With nothing decoding no one's ITL is at stake and chunking only delays the
    prompt: the cap."""
    n = num_decodes
    if n == 0:
        return cap
    return n + chunk_within(c, n, decode_context_tokens, seconds, prefix_tokens, max(cap - n, 0))


def state_budget(c: Coefficients, state, seconds: float, cap: int) -> int:
    """:func:`time_budget` for an engine state read by ``envs.state``'s names (``state[name]``
    and ``state.get(name)``: the simulator's ``SchedulerState`` or a mapping), with prefix
    caching priced in full: where the chunk that fits takes all the head's remaining tokens
    and ``next_prefills`` lists the requests the pass admits next, each one it reaches reads
    its own cached prefix (:func:`chunks_within`; ``head_remaining_tokens`` is read then).
    Without ``next_prefills``, or with it empty (no prefix caching), exactly
    :func:`time_budget`. Like it, this prices the head's remaining tokens as one chunk:
    a ``long_prefill_token_threshold`` that caps each request's chunk is not priced."""
    n = int(state["running_decodes"])
    if n == 0:
        return cap
    ctx, q = int(state["decode_context_tokens"]), int(state["head_prefilled_tokens"])
    budget = time_budget(c, n, ctx, q, seconds, cap)
    later = state.get("next_prefills")
    if later:
        remaining = int(state["head_remaining_tokens"])
        if budget - n > remaining:
            budget = n + chunks_within(c, n, ctx, seconds, q, budget - n, remaining, later)
    return budget


def chunks_price(c: Coefficients, num_decodes: int, decode_context_tokens: int, chunk_tokens: int,
                 prefix_tokens: int, head_remaining_tokens: int,
                 later: Sequence[tuple[int, int]]) -> float:
    """Seconds of a pass carrying these decodes and ``chunk_tokens`` of prefill: the head's
    ``head_remaining_tokens`` after its ``prefix_tokens`` first, then each request of
    ``later`` ((cached prefix, tokens to prefill) pairs) in turn. Every token is first
    priced as :func:`chunk_price` prices one chunk after the head's prefix: each token
    attends to that prefix and to every token before it in the pass, more than a later
    request's token does (it attends to its own request's tokens only), so that with
    nothing cached the price is exactly :func:`chunk_price` and :func:`chunk_within`'s
    chunk bounds the search from above. To that it adds, for each later request the pass
    reaches, its cached prefix read once and attended by each of its tokens in the pass.
    Past ``later`` nothing more is added."""
    x, q = chunk_tokens, prefix_tokens
    read = pairs = 0
    left = x - head_remaining_tokens
    for cached, tokens in later:
        if left <= 0:
            break
        taken = min(left, tokens)
        read += cached
        pairs += taken * cached
        left -= taken
    return pass_price(c, num_decodes, decode_context_tokens, x, q + read,
                      chunk_attention_pairs(x, q) + pairs)


def chunks_within(c: Coefficients, num_decodes: int, decode_context_tokens: int, seconds: float,
                  prefix_tokens: int, most: int, head_remaining_tokens: int,
                  later: Sequence[tuple[int, int]]) -> int:
    """The largest chunk, at least the head's ``head_remaining_tokens`` and at most ``most``
    (the chunk :func:`chunk_within` allows the head alone: the later requests' prefixes only
    add), whose pass :func:`chunks_price` prices within ``seconds``. The price grows with
    the chunk, so a bisection finds it."""
    def fits(x: int) -> bool:
        return chunks_price(c, num_decodes, decode_context_tokens, x, prefix_tokens,
                            head_remaining_tokens, later) <= seconds

    if fits(most):
        return most
    lo, hi = head_remaining_tokens, most  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


_ROOTS: dict[Coefficients, tuple[float, ...]] = {}


def _root_constants(c: Coefficients) -> tuple[float, ...]:
    """Per cost model, the constants of :func:`free_ride_root`'s quadratic, computed once."""
    k = _ROOTS.get(c)
    if k is None:
        token, pair, kv = c.token_s, c.pair_s, c.kv_s_per_token
        k = _ROOTS[c] = (pair / 2,            # a: causal pairs inside the chunk
                         token + pair / 2 - kv,  # b: per chunk token, without the prefix
                         pair,                # b: per chunk token per prefix token
                         token,               # c: per decode
                         pair - kv,           # c: per decode (query, key) pair, its KV read
                         c.weights_s,         # c: the weights read once
                         kv)                  # c: the prefix's KV read
    return k


def free_ride_root(c: Coefficients, num_decodes: int, decode_context_tokens: int,
                   prefix_tokens: int = 0) -> float:
    """The real root in the chunk size (>= 0) of compute time = memory time, in closed form:
    cheap enough for every pass (the observation and the free-ride rule use it)."""
    # compute - memory = a x^2 + b x + k for a chunk of x >= 1 tokens after a q-token prefix
    a, b0, b_q, k_dec, k_pair, k_weights, k_q = _root_constants(c)
    b = b0 + b_q * prefix_tokens
    k = (k_dec * num_decodes + k_pair * (decode_context_tokens + num_decodes) - k_weights
         - k_q * prefix_tokens)
    if k >= 0:
        return 0.0
    return (-b + math.sqrt(b * b - 4 * a * k)) / (2 * a)


def free_ride_chunk(c: Coefficients, num_decodes: int, decode_context_tokens: int,
                    prefix_tokens: int = 0) -> int:
    """The largest chunk that keeps the pass memory-bound (compute <= memory), exactly: the
    decodes' arithmetic, the chunk's attention over its prefix and itself, and the
    prefix's KV reads all charged; 0 when the decodes alone are compute-bound."""

    def excess(x: int) -> float:  # compute time minus memory time with a chunk of x
        q = prefix_tokens if x else 0
        memory, compute, _ = pass_times(c, num_decodes, decode_context_tokens, x, q,
                                        chunk_attention_pairs(x, prefix_tokens))
        return compute - memory

    if excess(0) > 0:
        return 0
    x = int(free_ride_root(c, num_decodes, decode_context_tokens, prefix_tokens))
    while x > 0 and excess(x) > 0:  # the root is exact up to rounding
        x -= 1
    while excess(x + 1) <= 0:
        x += 1
    return x


def queue_done_s(oldest_wait_s: float, prefill_tokens: int, seconds: float, chunk: int) -> float:
    """:func:`prefill_due_s` once the chunk that fits in ``seconds`` is known."""
    if prefill_tokens <= 0:
        return oldest_wait_s
    return oldest_wait_s + prefill_tokens * seconds / chunk if chunk > 0 else math.inf


PREFILL_DUE_CAP = 1 << 14
"""The largest chunk :func:`prefill_due_s` prices (the time budgets' cap)."""


def prefill_due_s(c: Coefficients, num_decodes: int, decode_context_tokens: int, prefix_tokens: int,
                  prefill_tokens: int, oldest_wait_s: float, seconds: float,
                  cap: int = PREFILL_DUE_CAP) -> float:
    """When the prefill queue would be done, counted from the arrival of its oldest request
    still without a first token (``oldest_wait_s``: ``envs.state``): that wait plus
    ``prefill_tokens`` (every prompt token still to prefill) at the rate of passes priced
    at ``seconds`` with these decodes, each carrying the head's chunk within it. Infinite
    when not one token fits; the wait alone with nothing to prefill."""
    if prefill_tokens <= 0:
        return oldest_wait_s
    chunk = chunk_within(c, num_decodes, decode_context_tokens, seconds, prefix_tokens, cap)
    return queue_done_s(oldest_wait_s, prefill_tokens, seconds, chunk)
