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

This module holds the physics: what a pass moves and computes (:class:`Roofline`, in
bytes, FLOPs and rates). Multiplied out, it is a cost model of seven coefficients in
seconds (:meth:`Roofline.coefficients`), and the price of a pass from those is
:mod:`envs.pricing`'s alone: :func:`price` here keeps the breakdown (bytes, FLOPs, the
named parts) and takes its times from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from envs.pricing import Coefficients, chunk_attention_pairs, combine, pass_times
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

    def coefficients(self) -> Coefficients:
        """The roofline multiplied out: the cost model :mod:`envs.pricing` prices a pass
        with (and a time-fraction table stores)."""
        return Coefficients(
            weights_s=self.weight_bytes * self.seconds_per_byte,
            kv_s_per_token=self.kv_bytes_per_token * self.seconds_per_kv_byte,
            token_s=self.flops_per_token * self.seconds_per_flop,
            pair_s=self.attention_flops_per_pair * self.seconds_per_attention_flop,
            exposed=self.exposed, fixed_s=self.overhead_s + self.allreduce_fixed_s,
            serial_s_per_token=self.elementwise_s_per_token + self.allreduce_s_per_token)

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
    a dataclass: the simulator builds one for every pass that carries prefill. Its
    fields are :func:`envs.pricing.pass_price`'s arguments, in order.
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


@dataclass(frozen=True)
class PassCost:
    """A pass's price and its parts; the total is derived (:func:`envs.pricing.combine`),
    never stored.

    ``memory_s``, ``compute_s`` and ``outside_s`` are :func:`envs.pricing.pass_times`';
    ``bytes_moved`` and ``flops`` the roofline's (weights, KV cache, products and
    attention); ``outside_s`` is the sum of the named parts after it.
    """

    memory_s: float
    compute_s: float
    outside_s: float
    """Everything outside the max: the parts below."""
    exposed: float
    """1 - overlap (see the module docstring)."""
    bytes_moved: float
    flops: float
    overhead_s: float
    """Fixed per pass: the engine's per-pass overhead plus the layers' fixed cost."""
    elementwise_s: float
    """Norms, rotary embedding, activation and residual adds of every layer."""
    allreduce_s: float
    """The tensor-parallel group's all-reduces."""

    @property
    def total_s(self) -> float:
        return combine(self.memory_s, self.compute_s, self.exposed, self.outside_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


def pass_parts(r: Roofline, shape: PassShape) -> tuple[float, float, float, float]:
    """(weight bytes, KV bytes, weight-product FLOPs, attention FLOPs) of a pass."""
    kv_tokens = (shape.decode_context_tokens + shape.prefill_prefix_tokens  # read
                 + shape.num_decodes + shape.prefill_tokens)  # written
    # A decode's query attends to its context plus itself.
    pairs = shape.decode_context_tokens + shape.num_decodes + shape.prefill_attention_pairs
    return (r.weight_bytes, r.kv_bytes_per_token * kv_tokens, r.flops_per_token * shape.tokens,
            r.attention_flops_per_pair * pairs)


def price(r: Roofline, shape: PassShape) -> PassCost:
    """Price a pass, with its breakdown."""
    wb, kvb, lf, af = pass_parts(r, shape)
    tokens = shape.tokens
    memory, compute, outside = pass_times(r.coefficients(), *shape)
    return PassCost(memory_s=memory, compute_s=compute, outside_s=outside, exposed=r.exposed,
                    bytes_moved=wb + kvb, flops=lf + af, overhead_s=r.overhead_s,
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

    It ignores the decodes' own arithmetic, the chunk's attention and its KV traffic
    (``envs.pricing.free_ride_chunk`` charges them all).
    """
    c = r.coefficients()
    return pass_times(c, num_decodes, decode_context_tokens)[0] / c.token_s
