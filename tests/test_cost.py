"""The roofline: hand-computed cases, DESIGN.md's worked example, the free ride."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.cost import (PassShape, Roofline, chunk_attention_pairs, free_ride_formula_tokens,
                       price, price_pass)
from envs.pricing import free_ride_chunk
from envs.profiles import H100_SXM_DATASHEET as H100_SXM, LLAMA_3_8B
from tests.conftest import TOY_HW, TOY_MODEL


def test_memory_bound_mixed_pass_by_hand():
    # Decodes with contexts 100 and 300, plus a 50-token chunk with no prefix.
    # bytes = 2e9 weights + 256 * (400 read + 2 + 50 written) = 2,000,115,712
    # flops = 2e9 * 52 tokens + 512 * (400 + 2 + 50*51/2) = 104e9 + 858,624
    cost = price_pass(TOY_HW, TOY_MODEL, [100, 300], [(50, 0)])
    assert cost.bytes_moved == 2_000_115_712
    assert cost.flops == 104_000_858_624
    assert cost.memory_s == pytest.approx(2.000115712e-3)
    assert cost.compute_s == pytest.approx(1.04000858624e-3)
    assert cost.overhead_s == 0.001
    assert cost.total_s == pytest.approx(3.000115712e-3)
    assert cost.bound == "memory"


def test_compute_bound_chunk_with_prefix_by_hand():
    # A 1,000-token chunk after 500 prefilled tokens: reads the 500-token prefix once,
    # writes 1,000; pairs = 1000*500 + 1000*1001/2 = 1,000,500.
    cost = price_pass(TOY_HW, TOY_MODEL, [], [(1000, 500)])
    assert cost.bytes_moved == 2e9 + 256 * 1500
    assert cost.flops == 2e9 * 1000 + 512 * 1_000_500
    assert cost.compute_s == pytest.approx(2.000512256e-2)
    assert cost.total_s == pytest.approx(2.000512256e-2 + 0.001)
    assert cost.bound == "compute"


def test_attention_rates_and_partial_overlap_by_hand():
    # The mixed pass above with attention at a quarter of the bandwidth and half the
    # FLOP/s, and 40% overlap:
    #   memory  = 2e9 / 1e12 + 256 * 452 / 0.25e12 = 2e-3 + 462,848e-12
    #   compute = 104e9 / 1e14 + 512 * 1677 / 0.5e14 = 1.04e-3 + 17,172.48e-12
    #   total   = memory + (1 - 0.4) * compute + 1 ms
    from dataclasses import replace
    hw = replace(TOY_HW, attention_bandwidth_ratio=0.25, attention_flops_ratio=0.5, overlap=0.4)
    cost = price_pass(hw, TOY_MODEL, [100, 300], [(50, 0)])
    memory, compute = 2e-3 + 462_848e-12, 1.04e-3 + 17_172.48e-12
    assert cost.memory_s == pytest.approx(memory, rel=1e-12)
    assert cost.compute_s == pytest.approx(compute, rel=1e-12)
    assert cost.total_s == pytest.approx(memory + 0.6 * compute + 1e-3, rel=1e-12)
    # Bytes and FLOPs are the pass's, whatever the rates.
    assert cost.bytes_moved == 2_000_115_712 and cost.flops == 104_000_858_624
    # No overlap adds the two; full overlap is the plain roofline.
    assert price_pass(replace(hw, overlap=0.0), TOY_MODEL, [100, 300], [(50, 0)]).total_s == \
        pytest.approx(memory + compute + 1e-3, rel=1e-12)
    assert price_pass(replace(hw, overlap=1.0), TOY_MODEL, [100, 300], [(50, 0)]).total_s == \
        pytest.approx(memory + 1e-3, rel=1e-12)


def test_free_ride_uses_the_attention_rates():
    # Slower KV traffic lengthens the memory side, so more prompt fits under it; the
    # root stays the exact crossing of compute and memory time.
    from dataclasses import replace
    slow_kv = replace(H100_SXM, attention_bandwidth_ratio=0.5)
    base = free_ride_chunk(Roofline.of(H100_SXM, LLAMA_3_8B).coefficients(), 32, 32 * 2304)
    slow = free_ride_chunk(Roofline.of(slow_kv, LLAMA_3_8B).coefficients(), 32, 32 * 2304)
    assert slow > base
    r = Roofline.of(slow_kv, LLAMA_3_8B)
    at = price(r, PassShape(32, 32 * 2304, slow, 0, chunk_attention_pairs(slow, 0)))
    over = price(r, PassShape(32, 32 * 2304, slow + 1, 0, chunk_attention_pairs(slow + 1, 0)))
    assert at.compute_s <= at.memory_s and over.compute_s > over.memory_s


def test_chunk_attention_pairs():
    assert chunk_attention_pairs(1, 0) == 1
    assert chunk_attention_pairs(4, 0) == 10  # 1 + 2 + 3 + 4
    assert chunk_attention_pairs(4, 6) == 34  # 4 * 6 + 10


def test_shape_aggregates_match_lists():
    shape = PassShape.of([10, 20, 30], [(5, 0), (7, 3)])
    assert shape == PassShape(num_decodes=3, decode_context_tokens=60, prefill_tokens=12,
                              prefill_prefix_tokens=3, prefill_attention_pairs=15 + 49)
    assert shape.tokens == 15


def test_tensor_parallel_divides_time():
    from dataclasses import replace
    tp2 = replace(TOY_MODEL, tensor_parallel=2)
    one = price_pass(TOY_HW, TOY_MODEL, [100] * 8, [(256, 0)])
    two = price_pass(TOY_HW, tp2, [100] * 8, [(256, 0)])
    assert two.memory_s == pytest.approx(one.memory_s / 2)
    assert two.compute_s == pytest.approx(one.compute_s / 2)


def test_layers_small_kernels_and_allreduce_by_hand():
    # The mixed pass above (52 tokens) on a device with a fixed cost per layer and its
    # small kernels' own bandwidth. With an MLP 128 wide, one layer's small kernels move
    # per token (2-byte elements): norms 2 x 2 x 64, rotary 2 x (4 + 2) x 16, gated
    # activation 3 x 128, residual add 3 x 64 = 1,024 elements = 2,048 bytes.
    from dataclasses import replace
    hw = replace(TOY_HW, per_layer_overhead_s=1e-4, elementwise_bytes_per_s=0.5e12,
                 interconnect_bytes_per_s=1e11, allreduce_latency_s=5e-6)
    model = replace(TOY_MODEL, intermediate_size=128)
    assert model.elementwise_bytes_per_token == 2048
    cost = price_pass(hw, model, [100, 300], [(50, 0)])
    assert cost.overhead_s == pytest.approx(1e-3 + 2 * 1e-4)
    assert cost.elementwise_s == pytest.approx(52 * 2 * 2048 / 0.5e12)
    assert cost.allreduce_s == 0  # one device: nothing to reduce
    assert cost.total_s == pytest.approx(2.000115712e-3 + 1.2e-3 + 52 * 4096 / 0.5e12)
    # Two devices: each moves and computes half; the rotary and activation shares halve
    # (1,472 bytes a layer); 2 all-reduces a layer of 52 x 64 x 2 bytes, ring factor
    # 2 (2 - 1) / 2 = 1, at 100 GB/s plus 5 us each.
    tp2 = replace(model, tensor_parallel=2)
    assert tp2.elementwise_bytes_per_token == 2 * (256 + 96 + 192 + 192)
    two = price_pass(hw, tp2, [100, 300], [(50, 0)])
    assert two.memory_s == pytest.approx(cost.memory_s / 2)
    assert two.compute_s == pytest.approx(cost.compute_s / 2)
    assert two.elementwise_s == pytest.approx(52 * 2 * 1472 / 0.5e12)
    assert two.allreduce_s == pytest.approx(4 * 5e-6 + 4 * 52 * 128 / 1e11)
    assert two.total_s == pytest.approx(two.memory_s + two.overhead_s + two.elementwise_s
                                        + two.allreduce_s)
    # Without an interconnect figure a group is one device with twice the rates, as before.
    plain = price_pass(replace(hw, interconnect_bytes_per_s=None), tp2, [100, 300], [(50, 0)])
    assert plain.allreduce_s == 0


def test_datasheet_profile_has_none_of_the_fitted_parts():
    from envs.profiles import H100_SXM_DATASHEET, get_model
    cost = price_pass(H100_SXM_DATASHEET, get_model("llama-3-70b-tp8"), [1000] * 8, [(512, 0)])
    assert (cost.elementwise_s, cost.allreduce_s, cost.overhead_s) == (0, 0, 0)


class TestWorkedExample:
    """DESIGN.md section 2: 32 users at ~2,300 tokens each on H100 + Llama-3-8B, on the
    datasheet roofline the example is written for."""

    decode = price_pass(H100_SXM, LLAMA_3_8B, [2304] * 32)

    def test_decode_pass_moves_24_gib_in_9_8_ms(self):
        assert self.decode.bytes_moved / 2**30 == pytest.approx(24.3, rel=0.03)
        assert self.decode.total_s * 1e3 == pytest.approx(9.8, rel=0.05)
        assert self.decode.bound == "memory"

    def test_decode_pass_arithmetic_and_idle_tensor_cores(self):
        assert self.decode.flops / 1e9 == pytest.approx(563, rel=0.03)
        assert self.decode.compute_s * 1e3 == pytest.approx(0.8, rel=0.1)
        assert 1 - self.decode.compute_s / self.decode.memory_s == pytest.approx(0.92, abs=0.01)

    def test_kv_cache_is_about_9_gib(self):
        assert 32 * 2304 * LLAMA_3_8B.kv_bytes_per_token / 2**30 == pytest.approx(9.0, rel=0.01)

    def test_unchunked_prompt_takes_one_208_ms_pass(self):
        cost = price_pass(H100_SXM, LLAMA_3_8B, [2304] * 32, [(8192, 0)])
        assert cost.total_s * 1e3 == pytest.approx(208, rel=0.05)
        assert cost.total_s / self.decode.total_s == pytest.approx(22, rel=0.1)

    def test_free_ride(self):
        r = Roofline.of(H100_SXM, LLAMA_3_8B)
        formula = free_ride_formula_tokens(r, 32, 32 * 2304)
        exact = free_ride_chunk(r.coefficients(), 32, 32 * 2304)
        assert formula == pytest.approx(444, rel=0.05)
        # Charging the decodes' own arithmetic and the chunk's attention brings it lower.
        assert exact < formula
        assert exact > 0.8 * formula


@pytest.mark.parametrize("hardware", ["h100-sxm-datasheet", "h100-sxm"])
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 256), ctx=st.integers(1, 8192), prefix=st.integers(0, 30000))
def test_free_ride_is_the_memory_bound_boundary(hardware, n, ctx, prefix):
    # On the fitted preset too: its overlap, per-layer and small-kernel costs do not move
    # the boundary between memory- and compute-bound.
    from envs.profiles import get_hardware
    r = Roofline.of(get_hardware(hardware), LLAMA_3_8B)
    x = free_ride_chunk(r.coefficients(), n, n * ctx, prefix)

    def pass_cost(chunk):
        if chunk == 0:
            return price(r, PassShape(n, n * ctx))
        return price(r, PassShape(n, n * ctx, chunk, prefix, chunk_attention_pairs(chunk, prefix)))

    if x > 0:
        assert pass_cost(x).bound == "memory"
    assert pass_cost(x + 1).bound == "compute"


def test_free_ride_is_zero_when_decodes_alone_are_compute_bound():
    r = Roofline.of(TOY_HW, TOY_MODEL)  # ridge ~100 FLOP/byte: 2,000 decodes are compute-bound
    assert free_ride_chunk(r.coefficients(), 2000, 2000 * 10) == 0


def test_longer_prefix_leaves_less_free_ride():
    r = Roofline.of(H100_SXM, LLAMA_3_8B)
    early = free_ride_chunk(r.coefficients(), 32, 32 * 2304, prefix_tokens=0)
    late = free_ride_chunk(r.coefficients(), 32, 32 * 2304, prefix_tokens=7000)
    assert late < early
