"""Calibration: the roofline fit recovers known parameters; the CLI writes a usable profile."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from envs.calibrate import fit_roofline
from envs.profiles import get_hardware


def test_fit_recovers_a_known_roofline():
    rng = np.random.default_rng(0)
    # Decode-like shapes (few FLOPs per byte) and prefill-like ones (many), as the grid has.
    nbytes = rng.uniform(1e8, 5e9, 30)
    flops = np.concatenate([nbytes[:15] * rng.uniform(1, 20, 15), nbytes[15:] * rng.uniform(100, 2000, 15)])
    B, F, o = 50e9, 2e12, 0.004
    t = np.maximum(nbytes / B, flops / F) + o
    fb, ff, fo = fit_roofline(nbytes, flops, t * (1 + rng.normal(0, 0.01, 30)))
    assert fb == pytest.approx(B, rel=0.1)
    assert ff == pytest.approx(F, rel=0.1)
    assert fo == pytest.approx(o, abs=0.002)


def test_cli_writes_a_profile_the_simulator_accepts(tmp_path):
    model = tmp_path / "tiny.toml"
    model.write_text('[model]\nname = "tiny"\nlayers = 4\nhidden_size = 256\nheads = 4\n'
                     'kv_heads = 2\nhead_dim = 64\nparams = 4e6\n')
    out = tmp_path / "cpu.toml"
    res = subprocess.run([sys.executable, "-m", "envs.calibrate", "--model", str(model), "--layers", "1",
                          "--scale", "0.1", "--repeats", "1", "--out", str(out), "--csv",
                          str(tmp_path / "m.csv")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    hw = get_hardware(str(out))
    assert hw.hbm_bytes_per_s > 0 and hw.peak_flops_per_s > 0 and hw.per_pass_overhead_s >= 0
    assert "held-out shapes" in res.stdout
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 16


def test_bad_device_is_one_line():
    res = subprocess.run([sys.executable, "-m", "envs.calibrate", "--device", "tpu"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "device: got 'tpu'" in res.stderr and "Traceback" not in res.stderr


def test_fit_from_measured_engine_steps(tmp_path):
    from envs.cost import PassShape, Roofline, pass_bytes, pass_flops
    from envs.profiles import HardwareProfile, get_model

    # Steps priced by a known roofline; the fit must recover it.
    truth = HardwareProfile("t", 40e9, 300e9, 1e9, bandwidth_fraction=1.0, flops_fraction=1.0,
                            per_pass_overhead_s=0.01)
    model = get_model("mistral-7b")
    rf = Roofline.of(truth, model)
    rng = np.random.default_rng(1)
    lines = ["decode_contexts,chunks,seconds"]
    for i in range(60):
        dec = [int(c) for c in rng.integers(10, 2000, rng.integers(0, 16))]
        chunks = [(int(rng.integers(16, 2048)), int(rng.integers(0, 4000)))] if i % 2 else []
        if not dec and not chunks:
            dec = [100]
        shape = PassShape.of(dec, chunks)
        t = max(pass_bytes(rf, shape) * rf.seconds_per_byte, pass_flops(rf, shape) * rf.seconds_per_flop) + 0.01
        lines.append(f"{';'.join(map(str, dec))},{';'.join(f'{x}@{q}' for x, q in chunks)},{t}")
    steps = tmp_path / "steps.csv"
    steps.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.toml"
    res = subprocess.run([sys.executable, "-m", "envs.calibrate", "--steps", str(steps), "--model",
                          "mistral-7b", "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    hw = get_hardware(str(out))
    assert hw.hbm_bytes_per_s == pytest.approx(40e9, rel=0.1)
    assert hw.peak_flops_per_s == pytest.approx(300e9, rel=0.1)
    assert hw.per_pass_overhead_s == pytest.approx(0.01, abs=0.003)
    steps.write_text("decode_contexts,chunks,seconds\n1,,0.1\n")
    bad = subprocess.run([sys.executable, "-m", "envs.calibrate", "--steps", str(steps), "--out",
                          str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "need at least 6" in bad.stderr
