"""Calibration: the roofline fit recovers known parameters; the CLI writes a usable profile."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from envs.calibrate.fit import Fit, fit_passes
from envs.calibrate.torch_passes import GRID
from envs.errors import ConfigError
from envs.profiles import get_hardware, profile_to_toml
from tests.conftest import cli


def synthetic_parts(rng, n=40):
    """Pass parts (weight bytes, KV bytes, product FLOPs, attention FLOPs) from
    decode-like passes (few FLOPs per byte) and prefill-like ones (many)."""
    wb = rng.uniform(1e8, 5e9, n)
    kvb = wb * rng.uniform(0.01, 2.0, n)
    lf = np.concatenate([wb[: n // 2] * rng.uniform(1, 20, n // 2), wb[n // 2:] * rng.uniform(100, 2000, n - n // 2)])
    af = lf * rng.uniform(0.01, 1.0, n)
    return np.column_stack([wb, kvb, lf, af])


def test_fit_recovers_a_known_roofline():
    rng = np.random.default_rng(0)
    parts = synthetic_parts(rng)
    truth = Fit(50e9, 2e12, overhead_s=0.004)
    t = truth.predict(parts) * (1 + rng.normal(0, 0.01, len(parts)))
    fit = fit_passes(parts, t, refined=False)
    assert fit.bytes_per_s == pytest.approx(50e9, rel=0.1)
    assert fit.flops_per_s == pytest.approx(2e12, rel=0.1)
    assert fit.overhead_s == pytest.approx(0.004, abs=0.002)
    assert (fit.attention_bandwidth_ratio, fit.attention_flops_ratio, fit.overlap) == (1, 1, 1)


def test_refined_fit_recovers_attention_rates_and_overlap():
    rng = np.random.default_rng(3)
    parts = synthetic_parts(rng, 60)
    truth = Fit(20e9, 5e11, attention_bandwidth_ratio=0.3, attention_flops_ratio=0.6, overlap=0.2,
                overhead_s=0.002)
    t = truth.predict(parts) * (1 + rng.normal(0, 0.01, len(parts)))
    fit = fit_passes(parts, t, overhead_s=0.002)
    assert fit.bytes_per_s == pytest.approx(20e9, rel=0.1)
    assert fit.flops_per_s == pytest.approx(5e11, rel=0.1)
    assert fit.attention_bandwidth_ratio == pytest.approx(0.3, rel=0.15)
    assert fit.attention_flops_ratio == pytest.approx(0.6, rel=0.15)
    assert fit.overlap == pytest.approx(0.2, abs=0.1)
    # The plain roofline cannot express this device: its fit is clearly worse.
    plain = fit_passes(parts, t, refined=False)
    err = lambda f: np.median(np.abs(f.predict(parts) - t) / t)  # noqa: E731
    assert err(fit) < 0.02 < err(plain)


def test_fit_refuses_too_few_passes():
    with pytest.raises(ConfigError, match="too few"):
        fit_passes(np.ones((4, 4)), np.ones(4))


def test_cli_writes_a_profile_the_simulator_accepts(tmp_path):
    model = tmp_path / "tiny.toml"
    model.write_text('[model]\nname = "tiny"\nlayers = 4\nhidden_size = 256\nheads = 4\n'
                     'kv_heads = 2\nhead_dim = 64\nparams = 4e6\n')
    out = tmp_path / "cpu.toml"
    res = cli("envs.calibrate", "--model", str(model), "--layers", "1",
                          "--scale", "0.1", "--repeats", "1", "--out", str(out), "--csv",
                          str(tmp_path / "m.csv"))
    assert res.returncode == 0, res.stderr[-2000:]
    hw = get_hardware(str(out))
    assert hw.hbm_bytes_per_s > 0 and hw.peak_flops_per_s > 0 and hw.per_pass_overhead_s >= 0
    assert "held-out shapes" in res.stdout and "plain roofline" in res.stdout
    assert 0 <= hw.overlap <= 1 and hw.attention_bandwidth_ratio > 0
    assert len((tmp_path / "m.csv").read_text().splitlines()) == len(GRID) + 1


def test_bad_device_is_one_line():
    # The one real subprocess of this command: python -m envs.calibrate works end to end.
    res = subprocess.run([sys.executable, "-m", "envs.calibrate", "--device", "tpu"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "device: got 'tpu'" in res.stderr and "Traceback" not in res.stderr


def test_fit_from_measured_engine_steps(tmp_path):
    from envs.profiles import HardwareProfile, get_model

    # Steps priced by a known roofline; the plain fit must recover it, and the refined
    # fit must predict held-out steps as well.
    truth = HardwareProfile("t", 40e9, 300e9, 1e9, bandwidth_fraction=1.0, flops_fraction=1.0,
                            per_pass_overhead_s=0.01)
    steps = tmp_path / "steps.csv"
    write_steps(steps, truth, get_model("mistral-7b"))
    out = tmp_path / "fit.toml"
    res = cli("envs.calibrate", "--steps", str(steps), "--model",
                          "mistral-7b", "--out", str(out))
    assert res.returncode == 0, res.stderr
    held = re.search(r"held-out steps \(20\): median APE ([0-9.]+)%", res.stdout)
    assert held and float(held.group(1)) < 1.0, res.stdout
    res = cli("envs.calibrate", "--steps", str(steps), "--model",
                          "mistral-7b", "--form", "roofline", "--out", str(out))
    assert res.returncode == 0, res.stderr
    hw = get_hardware(str(out))
    assert hw.hbm_bytes_per_s == pytest.approx(40e9, rel=0.1)
    assert hw.peak_flops_per_s == pytest.approx(300e9, rel=0.1)
    assert hw.per_pass_overhead_s == pytest.approx(0.01, abs=0.003)
    steps.write_text("decode_contexts,chunks,seconds\n1,,0.1\n")
    bad = cli("envs.calibrate", "--steps", str(steps), "--out",
                          str(out))
    assert bad.returncode == 2 and "need at least 6" in bad.stderr


def write_steps(path, hardware, model, n=60, seed=1):
    """Steps of random shapes priced by ``hardware`` on ``model`` (the simulator's price)."""
    from envs.cost import PassShape, Roofline, price

    rf = Roofline.of(hardware, model)
    rng = np.random.default_rng(seed)
    lines = ["decode_contexts,chunks,seconds"]
    for i in range(n):
        dec = [int(c) for c in rng.integers(10, 2000, rng.integers(1, 16))]
        chunks = [(int(rng.integers(16, 2048)), int(rng.integers(0, 4000)))] if i % 2 else []
        t = price(rf, PassShape.of(dec, chunks)).total_s
        lines.append(f"{';'.join(map(str, dec))},{';'.join(f'{x}@{q}' for x, q in chunks)},{t}")
    path.write_text("\n".join(lines) + "\n")


def test_engine_overhead_on_top_of_a_device_profile(tmp_path):
    # Device figures from elsewhere (say torch passes), the engine's own cost per step
    # from its steps; a tensor-parallel model's steps give one device's figures back.
    from dataclasses import replace as dc_replace

    from envs.profiles import HardwareProfile, get_model

    device = HardwareProfile("dev", 40e9, 300e9, 1e9, bandwidth_fraction=1.0, flops_fraction=1.0,
                             attention_bandwidth_ratio=0.5, overlap=0.3)
    model = dc_replace(get_model("mistral-7b"), tensor_parallel=2)
    steps = tmp_path / "steps.csv"
    write_steps(steps, dc_replace(device, per_pass_overhead_s=0.012), model)
    (tmp_path / "dev.toml").write_text(profile_to_toml(device))
    (tmp_path / "m.toml").write_text(profile_to_toml(model))
    out = tmp_path / "fit.toml"
    res = cli("envs.calibrate", "--steps", str(steps), "--model",
                          str(tmp_path / "m.toml"), "--hardware", str(tmp_path / "dev.toml"),
                          "--out", str(out))
    assert res.returncode == 0, res.stderr
    hw = get_hardware(str(out))
    assert hw.per_pass_overhead_s == pytest.approx(0.012, rel=1e-6)
    assert (hw.hbm_bytes_per_s, hw.overlap, hw.attention_bandwidth_ratio) == (40e9, 0.3, 0.5)
    assert hw.name == "dev"  # the same device, with this engine: a table for it serves there
    res = cli("envs.calibrate", "--steps", str(steps), "--model",
                          str(tmp_path / "m.toml"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    hw = get_hardware(str(out))
    assert hw.hbm_bytes_per_s == pytest.approx(40e9, rel=0.1)
    assert hw.peak_flops_per_s == pytest.approx(300e9, rel=0.1)


def test_fit_prices_passes_as_the_simulator_does():
    # The fit's vectorised formula and envs.cost's price must be one cost model.
    from dataclasses import replace as dc_replace

    from envs.calibrate.fit import fit_of, shape_parts, unit_roofline
    from envs.cost import PassShape, Roofline, price
    from envs.profiles import get_model

    hw = dc_replace(get_hardware("a100-80g"), attention_bandwidth_ratio=0.3, attention_flops_ratio=0.7,
                    overlap=0.4, per_pass_overhead_s=0.002)
    rng = np.random.default_rng(5)
    shapes = [PassShape.of([int(c) for c in rng.integers(1, 3000, rng.integers(0, 40))],
                           [(int(rng.integers(1, 4096)), int(rng.integers(0, 8000)))] if i % 2 else [])
              for i in range(1, 50)]
    # One device, and a group of 4 (per-device parts plus the all-reduces).
    for model in (get_model("mistral-7b"), dc_replace(get_model("mistral-7b"), tensor_parallel=4)):
        expected = [price(Roofline.of(hw, model), s).total_s for s in shapes]
        np.testing.assert_allclose(fit_of(hw).predict(shape_parts(unit_roofline(model), shapes)),
                                   expected, rtol=1e-12)


def test_a_grid_too_big_for_the_device_is_a_one_line_error(monkeypatch, tmp_path):
    import torch

    import envs.calibrate.torch_passes as passes

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.05 GiB.")

    monkeypatch.setattr(passes, "measure_grid", out_of_memory)
    out = cli("envs.calibrate", "--layers", "32", "--scale", "4", "--out", str(tmp_path / "p.toml"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "layers: 32 layers with the grid at scale 4 do not fit in cpu memory" in out.stderr
    assert not (tmp_path / "p.toml").exists()
