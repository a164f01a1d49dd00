"""A profile's step jitter: measured from an engine's steps (envs.calibrate.steps.step_jitter),
carried in the profile, and drawn by the simulator for every pass with prefill work, the
same draws for every fork and every policy on a stream."""

from __future__ import annotations

import json
import pickle
import types
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import pricing
from envs.calibrate.steps import JITTER_MIN_STEPS, jitter_line, step_jitter
from envs.engine import JITTER_DRAWS, EngineConfig, Simulator, jitter_draws
from envs.errors import ConfigError
from envs.profiles import get_hardware, profile_to_toml
from envs.workload import Workload
from tests.conftest import TOY_HW, TOY_MODEL, slack_run

Z = (-2.0, -0.5, 0.0, 1.0, 4.0)
JITTERY = replace(TOY_HW, step_jitter=Z, step_jitter_s=1e-3, step_jitter_share=0.2)


def workload(n=30, seed=3):
    rng = np.random.default_rng(seed)
    return Workload.from_arrays(np.cumsum(rng.exponential(0.05, n)), rng.integers(50, 3000, n),
                                rng.integers(2, 60, n))


def run(hw, policy=lambda s: 512, **kw):
    sim = Simulator(hw, TOY_MODEL, workload(), EngineConfig(num_kv_blocks=4000), **kw)
    sim.run(policy)
    return sim


def test_a_profile_keeps_its_jitter_through_toml(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(profile_to_toml(JITTERY))
    back = get_hardware(str(path))
    assert back == JITTERY and back.step_jitter == Z
    assert get_hardware("h100-sxm").step_jitter == ()  # presets take their price


@pytest.mark.parametrize("fields, needle", [
    (dict(step_jitter=(1.0, 0.0)), "non-decreasing"),
    (dict(step_jitter=(0.0,)), "2 to 1001"),
    (dict(step_jitter=(0.0, float("nan"))), "hardware.step_jitter"),
    (dict(step_jitter_s=-1e-3), "hardware.step_jitter_s"),
    (dict(step_jitter_share=-0.1), "hardware.step_jitter_share"),
])
def test_a_bad_jitter_is_refused_naming_its_field(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        replace(TOY_HW, **fields)


def test_a_pass_with_prefill_takes_its_price_plus_its_scaled_draw_and_decodes_their_price():
    """Hand-checked against the formula: a pass priced t with prefill takes
    t + (a + b t) z[pass], never under t / 2; a decode-only pass takes t."""
    sim = run(JITTERY, record_shapes=True)
    z = jitter_draws(Z)
    durations = sim.pass_durations()
    seen = set()
    for p, (shape, took) in enumerate(zip(sim.shapes, durations)):
        t = pricing.pass_price(sim.cost, *shape)
        if shape.prefill_tokens:
            want = max(t + (1e-3 + 0.2 * t) * z[p % JITTER_DRAWS], t / 2)
            seen.add("up" if want > t else "down")
        else:
            want = t
        assert took == pytest.approx(want, rel=1e-12)
    assert seen == {"up", "down"}
    assert sim.finished == run(TOY_HW).finished == 30  # the same requests served, at other times


def test_the_draws_are_a_fixed_sequence_that_forks_and_copies_share():
    """Common random numbers: two runs, two forks of one state and a pickled copy all meet
    the same draws, so the same policy gives the same passes."""
    a, b = run(JITTERY), run(JITTERY)
    np.testing.assert_array_equal(a.pass_durations(), b.pass_durations())
    sim = Simulator(JITTERY, TOY_MODEL, workload(), EngineConfig(num_kv_blocks=4000))
    while sim.now < 0.5 and sim.advance():
        sim.step(256)
    forks = [sim.fork(), sim.fork(), pickle.loads(pickle.dumps(sim))]
    for f in forks:
        f.run(lambda s: 1024)
    assert forks[0].now == forks[1].now == forks[2].now
    ahead = forks[0].pass_durations()  # a fork's log starts at the fork; a copy's does not
    np.testing.assert_array_equal(ahead, forks[1].pass_durations())
    np.testing.assert_array_equal(ahead, forks[2].pass_durations()[-len(ahead):])
    assert forks[0].now != run(TOY_HW, lambda s: 1024).now  # the jitter moved something


def test_the_measured_jitter_recovers_a_known_engine():
    """Steps priced 5-200 ms, run 10% slow on average (the fit's misfit, removed) with a
    jitter of (2 ms + 0.1 x price) x Laplace: the fitted quantiles at 10 ms and 100 ms
    match the truth's within a fifth, whatever scale the fit splits between z and (a, b)."""
    rng = np.random.default_rng(5)
    priced = np.exp(rng.uniform(np.log(5e-3), np.log(0.2), 4000))
    truth = (2e-3 + 0.1 * priced) * rng.laplace(0, 1, len(priced))
    z, a, b = step_jitter(priced, 1.1 * priced + truth)
    grid = np.linspace(0, 1, len(z))
    for t in (0.01, 0.1):
        for q in (0.1, 0.9, 0.99):
            want = 1.1 * 0 + (2e-3 + 0.1 * t) * (np.log(2 * q) if q < 0.5 else -np.log(2 * (1 - q)))
            got = (a + b * t) * np.interp(q, grid, z)
            assert got == pytest.approx(want, rel=0.2), (t, q)
    assert "at 90 ms p90" in jitter_line((z, a, b), 4000)


def test_no_jitter_from_too_few_steps_or_steps_on_their_trend():
    priced = np.linspace(0.01, 0.1, 100)
    assert step_jitter(priced[:JITTER_MIN_STEPS - 1], priced[:JITTER_MIN_STEPS - 1] * 1.3) == ((), 0.0, 0.0)
    assert step_jitter(priced, priced * (1.3 + 0.2 * (priced > 0.05))) == ((), 0.0, 0.0)
    assert jitter_line(((), 0.0, 0.0), 12).startswith("no step jitter: 12 steps")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-3, 1.0), st.floats(0.2, 5.0)), min_size=JITTER_MIN_STEPS, max_size=200))
def test_a_measured_jitter_is_a_valid_profile_field(pairs):
    """Whatever the steps, the quantiles rise, their median is 0, and a profile takes them."""
    priced = np.array([p for p, _ in pairs])
    z, a, b = step_jitter(priced, priced * np.array([r for _, r in pairs]))
    if z:
        assert all(x <= y for x, y in zip(z, z[1:])) and z[len(z) // 2] == pytest.approx(0, abs=1e-12)
        replace(TOY_HW, step_jitter=z, step_jitter_s=a, step_jitter_share=b)


def test_calibrate_writes_the_jitter_it_measures(tmp_path):
    from tests.test_calibrate import cli

    rng = np.random.default_rng(2)
    lines = ["decode_contexts,chunks,seconds"]
    for i in range(300):
        dec = [int(c) for c in rng.integers(10, 2000, rng.integers(1, 16))]
        chunks = [(int(rng.integers(16, 2048)), int(rng.integers(0, 4000)))] if i % 2 else []
        from envs.cost import PassShape, Roofline, price
        t = price(Roofline.of(TOY_HW, TOY_MODEL), PassShape.of(dec, chunks)).total_s
        lines.append(f"{';'.join(map(str, dec))},{';'.join(f'{x}@{q}' for x, q in chunks)},"
                     f"{t * (1 + 0.1 * rng.laplace()) if chunks else t}")
    (tmp_path / "steps.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "m.toml").write_text(profile_to_toml(TOY_MODEL))
    out = tmp_path / "fit.toml"
    res = cli("envs.calibrate", "--steps", str(tmp_path / "steps.csv"), "--model", str(tmp_path / "m.toml"),
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "step jitter (150 steps with prefill" in res.stdout
    hw = get_hardware(str(out))
    assert len(hw.step_jitter) == 101 and hw.step_jitter_s + hw.step_jitter_share > 0
    assert "step jitter" in out.read_text().splitlines()[0]  # the header says where it came from


def _p99_run(policy, jitter: bool):
    """:func:`slack_run` priced exactly or with a jitter of (1 ms + 0.2 x price) x z (z up to
    +4: a pass priced at the target may take 1.8 times it)."""
    hw = get_hardware("a100-80g")
    if jitter:
        hw = replace(hw, step_jitter=Z, step_jitter_s=1e-3, step_jitter_share=0.2)
    return slack_run(policy, hw)


def test_the_p99_rule_keeps_to_the_target_once_it_has_slack_when_priced_exactly():
    """A fresh engine has decoded nothing, so the rule starts at its base; priced exactly no
    pass at the target runs over it, the slack only grows, and from the first pass it
    covers on, every budget is `time-budget:1`'s."""
    from policies.baselines import TimeBudgetP99Policy, TimeBudgetPolicy

    rule, target, base = TimeBudgetP99Policy(0.1, 0.5), TimeBudgetPolicy(0.1, 1.0), TimeBudgetPolicy(0.1, 0.5)
    sim = Simulator(get_hardware("a100-80g"), "llama-3-8b",
                    Workload.from_arrays([0.0] * 4 + [0.001, 30.0], [60] * 4 + [9000, 9000], [6000] * 4 + [10, 10]),
                    EngineConfig())
    decisions = []
    while sim.advance():
        state = sim.state()
        if state.running_decodes and state.waiting_prefill_tokens + state.head_prefilled_tokens:
            decisions.append((rule(state), target(state), base(state)))
        sim.step(rule(state))
    assert decisions[0][0] == decisions[0][2] < decisions[0][1]
    first = next(i for i, (r, t, _) in enumerate(decisions) if r == t)
    assert all(r == t for r, t, _ in decisions[first:]) and decisions[-1][0] > decisions[-1][2]
    assert sim.log.tokens_over_since(0, 0.1)[0] == 0


def test_the_p99_rule_holds_p99_itl_under_a_jitter():
    """Under a jitter, passes at the target run over it often enough to break p99 ITL; the
    p99 rule falls back to its base while the slow tokens use up the 0.8% allowance, meets
    the ITL target, and still spends more of each pass than its base alone."""
    from envs.slack import SLACK_SHARE
    from policies.baselines import TimeBudgetP99Policy, TimeBudgetPolicy

    rule, target, base = TimeBudgetP99Policy(0.1, 0.5), TimeBudgetPolicy(0.1, 1.0), TimeBudgetPolicy(0.1, 0.5)
    (at_target, target_share), (held, held_share) = _p99_run(target, True), _p99_run(rule, True)
    (at_base, _) = _p99_run(base, True)
    assert target_share > 0.01 and at_target["itl_p99_s"] > 0.1
    assert 0 < held_share <= SLACK_SHARE + 0.001 and held["itl_p99_s"] <= 0.1
    assert held["budget_mean"] > at_base["budget_mean"]
