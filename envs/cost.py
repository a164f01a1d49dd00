"""The price of one forward pass on a roofline (DESIGN.md, section 2).

    bytes = weights + KV read (each decode's context, each chunk's prefix) + KV written
    flops = 2 * params * tokens + attention_flops_per_pair * (query, key) pairs
    time  = max(bytes / bandwidth, flops / peak) + per-pass overhead

Refinements fitted by ``envs.calibrate`` to real devices, all off on the
datasheet presets (DESIGN.md's plain roofline): attention's KV traffic and
(query, key) arithmetic may run at their own rates (``attention_*_ratio``:
attention kernels rarely stream like a weight product does); memory and compute
may overlap only in part, ``max(m, c) + (1 - overlap) * min(m, c)``; each layer
may cost a fixed time (``per_layer_overhead_s``) and its small memory-bound
kernels (norms, rotary embedding, activation, residual add) their own traffic
per token (``elementwise_bytes_per_s``). Those kernels run apart from the weight
products, so their time adds outside the max.

A tensor-parallel group of tp devices: each device moves and computes 1/tp of
the pass, and with ``interconnect_bytes_per_s`` each layer adds two all-reduces
of the pass's hidden states (after attention's output projection and after the
MLP), priced as a ring: ``2 (tp - 1) / tp x tokens x hidden x bytes / bus
bandwidth + latency`` each (NCCL's busBw is defined by the same factor).

A decode with context c (tokens already in its KV cache) reads c tokens of KV,
writes one, and its query attends to c + 1 keys. A prefill chunk of x tokens
whose prompt already has q tokens prefilled reads the q-token prefix once,
writes x tokens, and its queries attend to x*q + x(x+1)/2 keys (full against the
prefix, causal inside the chunk). Re-reading the prefix once per chunk is why
chunking costs cache traffic (Sarathi-Serve, section 4.3).

Everything here is a pure function of the pass's shape, the hardware and the
model; the simulator's hot loop uses the same :class:`Roofline` coefficients,
and a test checks every simulated pass against :func:`price_pass`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from envs.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True)
class Roofline:
    """Per-pass cost coefficients for one (hardware, model) pair, in seconds/bytes/FLOP.

    Rates are a tensor-parallel group's: each of its ``tp`` devices carries 1/tp of the
    bytes and FLOPs, so the group runs at ``tp`` times one device's rates; the
    all-reduces between them are priced apart.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    """2 x params: one multiply-add per weight per token."""
    attention_flops_per_pair: float
    seconds_per_byte: float
    """Per weight byte."""
    seconds_per_flop: float
    """Per FLOP of the weight products."""
    overhead_s: float
    seconds_per_kv_byte: float
    seconds_per_attention_flop: float
    exposed: float = 0.0
    """1 - overlap: the share of the shorter of memory and compute time that adds."""
    elementwise_s_per_token: float = 0.0
    """The small memory-bound kernels of every layer, seconds per token in the pass."""
    allreduce_s_per_token: float = 0.0
    """The all-reduces of every layer, seconds per token in the pass (0 at tp 1)."""
    allreduce_fixed_s: float = 0.0
    """The all-reduces' latency, seconds per pass (0 at tp 1)."""

    def coefficients(self) -> dict[str, float]:
        """The pass price multiplied out, in seconds (what a lookup table stores to turn a
        time budget into tokens; ``policies.table.COST_FIELDS`` documents the formula)."""
        return {"weights_s": self.weight_bytes * self.seconds_per_byte,
                "kv_s_per_token": self.kv_bytes_per_token * self.seconds_per_kv_byte,
                "token_s": self.flops_per_token * self.seconds_per_flop,
                "pair_s": self.attention_flops_per_pair * self.seconds_per_attention_flop,
                "exposed": self.exposed, "fixed_s": self.overhead_s + self.allreduce_fixed_s,
                "serial_s_per_token": self.elementwise_s_per_token + self.allreduce_s_per_token}

    @classmethod
    def of(cls, hardware: HardwareProfile, model: ModelProfile) -> "Roofline":
        tp = model.tensor_parallel
        spb = 1.0 / (hardware.effective_bytes_per_s * tp)
        spf = 1.0 / (hardware.effective_flops_per_s * tp)
        elementwise = 0.0
        if hardware.elementwise_bytes_per_s is not None:
            elementwise = model.layers * model.elementwise_bytes_per_token / hardware.elementwise_bytes_per_s
        allreduce_tok = allreduce_fixed = 0.0
        if tp > 1 and hardware.interconnect_bytes_per_s is not None:
            calls = 2 * model.layers  # after attention's output projection and after the MLP
            allreduce_tok = (calls * 2 * (tp - 1) / tp * model.allreduce_bytes_per_token
                             / hardware.interconnect_bytes_per_s)
            allreduce_fixed = calls * hardware.allreduce_latency_s
        return cls(
            weight_bytes=model.weight_bytes,
            kv_bytes_per_token=model.kv_bytes_per_token,
            flops_per_token=2.0 * model.params,
            attention_flops_per_pair=model.attention_flops_per_pair,
            seconds_per_byte=spb,
            seconds_per_flop=spf,
            overhead_s=hardware.per_pass_overhead_s + model.layers * hardware.per_layer_overhead_s,
            seconds_per_kv_byte=spb / hardware.attention_bandwidth_ratio,
            seconds_per_attention_flop=spf / hardware.attention_flops_ratio,
            exposed=1.0 - hardware.overlap,
            elementwise_s_per_token=elementwise,
            allreduce_s_per_token=allreduce_tok,
            allreduce_fixed_s=allreduce_fixed,
        )


class PassShape(NamedTuple):
    """What one pass carries, summed over its requests (all counts in tokens).

    Invariants: every field >= 0; ``prefill_attention_pairs`` >= ``prefill_tokens``
    when there is prefill (each query sees at least itself). A named tuple rather than
    a dataclass: the simulator builds one for every pass that carries prefill.
    """

    num_decodes: int = 0
    decode_context_tokens: int = 0
    """Sum over decodes of the tokens already in each one's KV cache."""
    prefill_tokens: int = 0
    prefill_prefix_tokens: int = 0
    """Sum over chunks of the tokens of that prompt already prefilled."""
    prefill_attention_pairs: int = 0

    @classmethod
    def of(cls, decode_contexts: Iterable[int] = (),
           chunks: Iterable[tuple[int, int]] = ()) -> "PassShape":
        """From each decode's context and each chunk's (size, already-prefilled prefix)."""
        contexts = list(decode_contexts)
        chunk_list = list(chunks)
        return cls(
            num_decodes=len(contexts),
            decode_context_tokens=sum(contexts),
            prefill_tokens=sum(x for x, _ in chunk_list),
            prefill_prefix_tokens=sum(q for _, q in chunk_list),
            prefill_attention_pairs=sum(chunk_attention_pairs(x, q) for x, q in chunk_list),
        )

    @property
    def tokens(self) -> int:
        return self.num_decodes + self.prefill_tokens


def chunk_attention_pairs(chunk_tokens: int, prefix_tokens: int) -> int:
    """(query, key) pairs of a chunk: full against its prefix, causal inside itself."""
    return chunk_tokens * prefix_tokens + chunk_tokens * (chunk_tokens + 1) // 2


@dataclass(frozen=True)
class PassCost:
    """A pass's price and its parts; the total is derived, never stored.

    ``bytes_moved`` and ``flops`` are the roofline's (weights, KV cache, products and
    attention); the small kernels' traffic is priced in ``elementwise_s``.
    """

    memory_s: float
    compute_s: float
    overhead_s: float
    """Fixed per pass: the engine's per-pass overhead plus the layers' fixed cost."""
    bytes_moved: float
    flops: float
    exposed: float = 0.0
    """1 - overlap (see the module docstring)."""
    elementwise_s: float = 0.0
    """Norms, rotary embedding, activation and residual adds of every layer."""
    allreduce_s: float = 0.0
    """The tensor-parallel group's all-reduces."""

    @property
    def total_s(self) -> float:
        return pass_seconds(self.memory_s, self.compute_s, self.exposed,
                            self.overhead_s + self.elementwise_s + self.allreduce_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


def pass_seconds(memory_s: float, compute_s: float, exposed: float, overhead_s: float) -> float:
    """A pass's total: ``max(m, c) + exposed * min(m, c) + overhead``, the one formula that
    :class:`PassCost`, the simulator and the calibration fit all use."""
    if memory_s > compute_s:
        return memory_s + exposed * compute_s + overhead_s
    return compute_s + exposed * memory_s + overhead_s


def pass_parts(r: Roofline, shape: PassShape) -> tuple[float, float, float, float]:
    """(weight bytes, KV bytes, weight-product FLOPs, attention FLOPs) of a pass."""
    kv_tokens = (shape.decode_context_tokens + shape.prefill_prefix_tokens  # read
                 + shape.num_decodes + shape.prefill_tokens)  # written
    # A decode's query attends to its context plus itself.
    pairs = shape.decode_context_tokens + shape.num_decodes + shape.prefill_attention_pairs
    return (r.weight_bytes, r.kv_bytes_per_token * kv_tokens, r.flops_per_token * shape.tokens,
            r.attention_flops_per_pair * pairs)


def price(r: Roofline, shape: PassShape) -> PassCost:
    """Price a pass from precomputed coefficients."""
    wb, kvb, lf, af = pass_parts(r, shape)
    tokens = shape.tokens
    return PassCost(memory_s=wb * r.seconds_per_byte + kvb * r.seconds_per_kv_byte,
                    compute_s=lf * r.seconds_per_flop + af * r.seconds_per_attention_flop,
                    overhead_s=r.overhead_s, bytes_moved=wb + kvb, flops=lf + af, exposed=r.exposed,
                    elementwise_s=r.elementwise_s_per_token * tokens,
                    allreduce_s=r.allreduce_fixed_s + r.allreduce_s_per_token * tokens)


def price_pass(hardware: HardwareProfile, model: ModelProfile,
               decode_contexts: Sequence[int] = (),
               chunks: Sequence[tuple[int, int]] = ()) -> PassCost:
    """Price one pass: each decode's context length, each chunk's (size, prefix).

    >>> from envs.profiles import H100_SXM_DATASHEET, LLAMA_3_8B
    >>> round(price_pass(H100_SXM_DATASHEET, LLAMA_3_8B, [2304] * 32).total_s * 1e3, 1)
    9.8
    """
    return price(Roofline.of(hardware, model), PassShape.of(decode_contexts, chunks))


def free_ride_formula_tokens(r: Roofline, num_decodes: int, decode_context_tokens: int) -> float:
    """DESIGN.md's back-of-envelope free ride: prompt tokens whose arithmetic fits in the
    time the decode pass waits on memory, ``memory time * FLOP/s / (2 * params)``.

    It ignores the decodes' own arithmetic, the chunk's attention and its KV traffic.
    """
    shape = PassShape(num_decodes=num_decodes, decode_context_tokens=decode_context_tokens)
    return price(r, shape).memory_s / (r.flops_per_token * r.seconds_per_flop)


def free_ride_tokens(r: Roofline, num_decodes: int, decode_context_tokens: int,
                     prefix_tokens: int = 0) -> int:
    """The largest prefill chunk that keeps the pass memory-bound (compute <= memory).

    Exact on this roofline: the decodes' own arithmetic, the chunk's attention over
    its ``prefix_tokens`` and itself, and the prefix's KV reads are all charged.
    0 when the decode batch alone is already compute-bound. With ``overlap`` < 1 the
    ride is cheap rather than free: the chunk's arithmetic still adds ``1 - overlap``
    of its time; and the small kernels and all-reduces add their cost per token
    whatever the bound (they run apart from the products).
    """

    def excess(x: int) -> float:  # compute time minus memory time with a chunk of x
        cost = price(r, PassShape(num_decodes, decode_context_tokens, x, prefix_tokens if x else 0,
                                  chunk_attention_pairs(x, prefix_tokens)))
        return cost.compute_s - cost.memory_s

    if excess(0) > 0:
        return 0
    x = int(free_ride_root(r, num_decodes, decode_context_tokens, prefix_tokens))
    # The root is exact up to rounding; settle the integer boundary.
    while x > 0 and excess(x) > 0:
        x -= 1
    while excess(x + 1) <= 0:
        x += 1
    return x


def free_ride_root(r: Roofline, num_decodes: int, decode_context_tokens: int,
                   prefix_tokens: int = 0) -> float:
    """The real root of compute time = memory time in the chunk size (>= 0), in closed
    form: cheap enough to compute every pass (the Gymnasium observation uses it)."""
    # compute - memory = a x^2 + b x + c for a chunk of x >= 1 tokens after a q-token prefix
    a, b0, b_q, c_dec, c_pair, c_weights, c_q = _root_coefficients(r)
    b = b0 + b_q * prefix_tokens
    c = (c_dec * num_decodes + c_pair * (decode_context_tokens + num_decodes) - c_weights
         - c_q * prefix_tokens)
    if c >= 0:
        return 0.0
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def chunk_price(r: Roofline, num_decodes: int, decode_context_tokens: int, chunk_tokens: int,
                prefix_tokens: int = 0) -> float:
    """Seconds of a pass carrying these decodes and one prefill chunk of ``chunk_tokens``
    after a ``prefix_tokens`` prefix: :func:`price`'s total, without building objects
    (policies call it several times a pass)."""
    n, ctx, x = num_decodes, decode_context_tokens, chunk_tokens
    q = prefix_tokens if x else 0
    pairs = x * q + x * (x + 1) // 2
    mem = (r.weight_bytes * r.seconds_per_byte
           + r.kv_bytes_per_token * r.seconds_per_kv_byte * (ctx + q + n + x))
    cmp = (r.flops_per_token * r.seconds_per_flop * (n + x)
           + r.attention_flops_per_pair * r.seconds_per_attention_flop * (ctx + n + pairs))
    serial = (r.elementwise_s_per_token + r.allreduce_s_per_token) * (n + x)
    return pass_seconds(mem, cmp, r.exposed, r.overhead_s + r.allreduce_fixed_s + serial)


def chunk_within(r: Roofline, num_decodes: int, decode_context_tokens: int, seconds: float,
                 prefix_tokens: int = 0, cap: int = 1 << 20) -> int:
    """The largest prefill chunk (at most ``cap`` tokens) after a ``prefix_tokens`` prefix
    whose pass, with these decodes, is priced within ``seconds``; 0 when not even one
    token fits (the decodes alone may already exceed it).

    The total is the larger of ``m + exposed * c`` and ``c + exposed * m`` (they swap
    where memory and compute cross), each a quadratic in the chunk size, so the root
    of each is closed form; the integer boundary is then settled against
    :func:`chunk_price` itself.
    """
    n, ctx, q = num_decodes, decode_context_tokens, prefix_tokens
    if chunk_price(r, n, ctx, 1, q) > seconds:
        return 0
    if chunk_price(r, n, ctx, cap, q) <= seconds:
        return cap
    kv = r.kv_bytes_per_token * r.seconds_per_kv_byte
    tok = r.flops_per_token * r.seconds_per_flop
    pair = r.attention_flops_per_pair * r.seconds_per_attention_flop
    serial = r.elementwise_s_per_token + r.allreduce_s_per_token  # per token, outside the max
    e, t = r.exposed, seconds - r.overhead_s - r.allreduce_fixed_s - serial * n
    # memory m(x) = m0 + kv*x, compute c(x) = c0 + (tok + pair*(q + 1/2))*x + pair/2*x^2
    m0 = r.weight_bytes * r.seconds_per_byte + kv * (ctx + q + n)
    c0 = tok * n + pair * (ctx + n)
    c1, c2 = tok + pair * (q + 0.5), pair / 2
    best = cap
    for a, b, c in ((e * c2, kv + e * c1 + serial, m0 + e * c0 - t),
                    (c2, c1 + e * kv + serial, c0 + e * m0 - t)):
        best = min(best, _quadratic_root(a, b, c))
    x = max(1, min(int(best), cap))
    while x > 1 and chunk_price(r, n, ctx, x, q) > seconds:
        x -= 1
    while x < cap and chunk_price(r, n, ctx, x + 1, q) <= seconds:
        x += 1
    return x


def _quadratic_root(a: float, b: float, c: float) -> float:
    """The non-negative root of a*x^2 + b*x + c = 0 with a, b >= 0 (inf when none)."""
    if c >= 0:
        return 0.0
    if a <= 0:
        return -c / b if b > 0 else math.inf
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


_ROOT_CACHE: dict[Roofline, tuple[float, ...]] = {}


def _root_coefficients(r: Roofline) -> tuple[float, ...]:
    """Per-roofline constants of free_ride_root's quadratic, computed once."""
    coef = _ROOT_CACHE.get(r)
    if coef is None:
        token = r.flops_per_token * r.seconds_per_flop  # arithmetic of one token's weights
        pair = r.attention_flops_per_pair * r.seconds_per_attention_flop  # one (query, key) pair
        kv = r.kv_bytes_per_token * r.seconds_per_kv_byte  # moving one token's KV
        coef = (pair / 2,                     # a: causal pairs inside the chunk
                token + pair / 2 - kv,        # b: per chunk token, without the prefix
                pair,                         # b: per chunk token per prefix token
                token,                        # c: per decode
                pair - kv,                    # c: per decode (query, key) pair, its KV read
                r.weight_bytes * r.seconds_per_byte,  # c: the weights read once
                kv)                           # c: the prefix's KV read
        _ROOT_CACHE[r] = coef
    return coef


def prefill_due_s(r: Roofline, num_decodes: int, decode_context_tokens: int, prefix_tokens: int,
                  prefill_tokens: int, oldest_wait_s: float, seconds: float) -> float:
    """When the prefill queue would be done, counted from its oldest request's arrival:
    that request's wait plus ``prefill_tokens`` (every waiting prompt token) at the rate
    of passes priced at ``seconds`` with these decodes (the head's chunk within it per
    ``seconds``). Infinite when not one token fits; the wait alone with nothing to prefill."""
    if prefill_tokens <= 0:
        return oldest_wait_s
    chunk = chunk_within(r, num_decodes, decode_context_tokens, seconds, prefix_tokens,
                         cap=1 << 14)
    return queue_done_s(oldest_wait_s, prefill_tokens, seconds, chunk)


def queue_done_s(oldest_wait_s: float, prefill_tokens: int, seconds: float, chunk: int) -> float:
    """:func:`prefill_due_s` once the chunk that fits in ``seconds`` is known."""
    if prefill_tokens <= 0:
        return oldest_wait_s
    return oldest_wait_s + prefill_tokens * seconds / chunk if chunk > 0 else math.inf
