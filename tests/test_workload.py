"""Workloads: trace parsing and its errors, replay controls, seeded synthetic streams."""

from __future__ import annotations

import numpy as np
import pytest

from envs.errors import ConfigError
from envs.workload import (Empirical, Fixed, LogNormal, Mixture, SyntheticSpec, Uniform,
                           arrival_times, load_trace, parse_lengths)

AZURE = "azure_conv_2023"


def write(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return path


def test_load_trace_and_replay_controls(tmp_path):
    p = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,10,5\n1.5,20,6\n3,30,7\n4,40,8\n")
    w = load_trace(p)
    assert w.arrival_s.tolist() == [0, 1.5, 3, 4]
    assert w.prompt_tokens.tolist() == [10, 20, 30, 40]
    assert load_trace(p, rate_scale=2).arrival_s.tolist() == [0, 0.75, 1.5, 2]
    win = load_trace(p, start_s=1.0, end_s=3.5)
    assert win.arrival_s.tolist() == [0.5, 2.0] and win.prompt_tokens.tolist() == [20, 30]
    assert len(load_trace(p, max_requests=3)) == 3


@pytest.mark.parametrize("rows, message", [
    ("0,10,5\n1,x,5\n", r"line 3: prompt_tokens: got 'x', must be an integer >= 1"),
    ("0,10,5\nnan,10,5\n", r"line 3: arrival_s: got 'nan', must be a finite number >= 0"),
    ("0,10,5\n-1,10,5\n", r"line 3: arrival_s: got '-1'"),
    ("2,10,5\n1,10,5\n", r"line 3: arrival_s: got 1.0, must be >= the previous row's 2.0"),
    ("0,10,0\n", r"line 2: output_tokens: got '0'"),
    ("0,10\n", r"line 2: expected 3 fields, got 2"),
])
def test_malformed_rows_name_the_line_and_field(tmp_path, rows, message):
    p = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n" + rows)
    with pytest.raises(ConfigError, match=message):
        load_trace(p)


def test_bad_header_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="line 1: header"):
        load_trace(write(tmp_path, "time,in,out\n0,1,1\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(ConfigError, match="holds no request"):
        load_trace(write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,1,1\n"), start_s=5)


def test_real_trace_matches_its_published_statistics():
    w = load_trace(AZURE)
    assert len(w) == 19366
    assert w.duration_s == pytest.approx(3501.7, abs=0.1)
    assert int(np.percentile(w.prompt_tokens, 50, method="inverted_cdf")) == 1020


def test_synthetic_is_seeded():
    spec = SyntheticSpec(rate=5, num_requests=200, arrival="gamma", burstiness=0.3)
    a, b, c = spec.build(1), spec.build(1), spec.build(2)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.arrival_s, c.arrival_s)


@pytest.mark.parametrize("process, cv_range", [("poisson", (0.9, 1.1)), ("gamma", (1.6, 2.4))])
def test_arrival_rate_and_burstiness(process, cv_range):
    rng = np.random.default_rng(0)
    t = arrival_times(rng, process, rate=10.0, n=20000, burstiness=0.25)
    gaps = np.diff(t)
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    cv = gaps.std() / gaps.mean()  # gamma shape k has CV 1/sqrt(k): 2 for k = 0.25
    assert cv_range[0] < cv < cv_range[1]


def test_onoff_keeps_the_mean_rate_and_leaves_silences():
    rng = np.random.default_rng(0)
    t = arrival_times(rng, "onoff", rate=4.0, n=8000, on_s=5, off_s=15)
    assert len(t) / t[-1] == pytest.approx(4.0, rel=0.05)
    assert np.diff(t).max() > 14  # the off periods


def test_length_specs():
    rng = np.random.default_rng(0)
    assert parse_lengths("fixed:7") == Fixed(7)
    assert parse_lengths("uniform:1:9") == Uniform(1, 9)
    assert parse_lengths("lognormal:1000:0.5") == LogNormal(1000, 0.5)
    mix = parse_lengths("short-long")
    assert isinstance(mix, Mixture)
    x = mix.sample(rng, 20000)
    long = x >= 4096
    assert long.mean() == pytest.approx(0.3, abs=0.02)
    assert x[~long].max() <= 512 and x[long].max() <= 16384
    ln = LogNormal(1000, 0.5).sample(rng, 20000)
    assert np.median(ln) == pytest.approx(1000, rel=0.05)
    emp = parse_lengths("empirical:azure_conv_2023")
    assert isinstance(emp, Empirical)
    assert set(emp.sample(rng, 100)) <= set(emp.values)


@pytest.mark.parametrize("spec", ["fixed:0", "uniform:5:1", "gauss:3", "mix:0.5*fixed:x", "lognormal:1"])
def test_bad_length_specs(spec):
    with pytest.raises(ConfigError, match="prompt"):
        parse_lengths(spec, "prompt")
