"""The time-budget benchmark's profile scaling, step selection and flags
(benchmarks/time_budget_hold.py; its real runs need vLLM)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import benchmarks.time_budget_hold as bench
from envs.cost import PassShape, Roofline, price
from envs.profiles import get_hardware, get_model

PROFILE = """# a fitted profile
[hardware]
name = "cpu"
hbm_bytes_per_s = 4.0e10
peak_flops_per_s = 2.4e11
memory_bytes = 2.5e10
bandwidth_fraction = 1.0
flops_fraction = 1.0
per_pass_overhead_s = 0.004
attention_bandwidth_ratio = 0.26
attention_flops_ratio = 0.86
overlap = 0.45
per_layer_overhead_s = 0.0001
allreduce_latency_s = 0.0
"""


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([0.5, 2.0, 3.0]),
       st.lists(st.integers(16, 4000), max_size=8),
       st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 4000)), max_size=3))
def test_a_scaled_profile_prices_every_step_by_its_factor(tmp_path_factory, factor, decodes, chunks):
    """Bandwidth and FLOP/s divided by the factor and every fixed cost multiplied by it:
    each pass, whatever its shape, costs the factor times what it did."""
    tmp = tmp_path_factory.mktemp("profiles")
    src, dst = tmp / "cpu.toml", tmp / "slow.toml"
    src.write_text(PROFILE)
    bench.scaled_profile(src, dst, factor)
    mp = get_model("llama-3-8b")
    shape = PassShape.of(decodes, chunks)
    base = price(Roofline.of(get_hardware(str(src)), mp), shape).total_s
    scaled = price(Roofline.of(get_hardware(str(dst)), mp), shape).total_s
    assert scaled == pytest.approx(factor * base, rel=1e-9)
    assert get_hardware(str(dst)).name == "cpu"  # a table exported with it passes the check


def test_only_steps_whose_size_the_budget_set_are_judged():
    """A step counts when decodes ran, a chunk was prefilled and the step carried exactly
    its budget, below the ceiling; its gap runs from the previous step's end to its own;
    the first ``skip`` of those are left out."""
    table = type("T", (), {"itl_s": 0.1, "action": type("A", (), {
        "fraction": staticmethod(lambda state: state["f"])})()})()
    served = [
        ({"f": 0.5}, 101, ([10], [(100, 0)]), 0.040, 1.000),  # the first: no gap to judge
        ({"f": 0.5}, 101, ([10], [(100, 0)]), 0.040, 1.045),  # 1 + 100 = 101: 45 / 50 ms
        ({"f": 0.5}, 200, ([10], [(100, 0)]), 0.040, 1.090),  # the prompt ran out first
        ({"f": 0.5}, 4, ([10, 11, 12, 13], []), 0.010, 1.100),  # decodes alone
        ({"f": 1.0}, 2048, ([], [(2048, 0)]), 0.300, 1.400),  # nobody decoding: the ceiling
        ({"f": 1.0}, 2048, ([5], [(2047, 0)]), 0.300, 1.700),  # at the ceiling: not the time budget's
        ({"f": 1.0}, 52, ([5, 6], [(30, 0), (20, 30)]), 0.100, 1.810),  # 110 / 100 ms
    ]
    assert bench.judged(served, table, 2048, 0) == pytest.approx([0.9, 1.1])
    assert bench.judged(served, table, 2048, 1) == pytest.approx([1.1])


@pytest.mark.parametrize("argv, field", [
    (["--factors", "1,5"], "--factors"),
    (["--factors", "1,x"], "--factors"),
    (["--requests", "5"], "--requests"),
    (["--load", "0"], "--load"),
    (["--out", "/nonexistent-folder"], "--out"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit) as err:
        bench.parse(argv)
    assert err.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if field in line]
    assert lines and ("must" in lines[-1] or "holds no" in lines[-1])
