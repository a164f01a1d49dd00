"""Calibration to measured GPU operator times (Vidur's data): layer bytes and FLOPs by hand,
the fit recovers known figures, the presets are what the command fits, check mode, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from envs.calibrate.fit import fit_of
from envs.calibrate.vidur import (LAYER_COLUMNS, VidurTable, fit_layers, fitted_profile, flat_end,
                                  layer_parts, price_rows, read_vidur)
from envs.errors import ConfigError
from envs.profiles import get_hardware

DATA = Path(__file__).resolve().parent.parent / "envs" / "data" / "vidur"
LLAMA2_7B = ("# n_head=32, n_kv_head=32, n_embd=4096, n_expanded_embd=11008, vocab_size=32768, "
             "use_gated_mlp=True")
PHI2 = ("# n_head=32, n_kv_head=32, n_embd=2560, n_expanded_embd=10240, vocab_size=51200, "
        "use_gated_mlp=False")
HEADER = "num_tokens,tp," + ",".join(LAYER_COLUMNS) + ",emb_ms"


def write_rows(path: Path, shape_line: str, rows) -> Path:
    """A Vidur file whose layer time (ms) sits in the QKV column, every other operator 0."""
    lines = [shape_line, HEADER]
    for tokens, tp, ms in rows:
        cells = ["0"] * len(LAYER_COLUMNS)
        cells[LAYER_COLUMNS.index("attn_pre_proj_ms")] = repr(ms)
        lines.append(f"{tokens},{tp}," + ",".join(cells) + ",0.003")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_layer_bytes_and_flops_by_hand(tmp_path):
    # Llama-2-7B's projections: QKV 4096 x (32 + 2 x 32) x 128 = 50,331,648, output
    # 16,777,216, gate+up 2 x 4096 x 11,008 = 90,177,536, down 45,088,768: 202,375,168
    # weights, half of them on each of 2 devices.
    t = read_vidur(str(write_rows(tmp_path / "h100__x.csv", LLAMA2_7B, [(256, 2, 0.1), (1, 1, 0.1)])))
    assert t.shape.projection_params == 202_375_168
    parts = layer_parts(t)
    assert parts[0, 0] == 202_375_168  # bytes on one device: 101,187,584 fp16 weights
    assert parts[0, 2] == 2 * 256 * 101_187_584  # product FLOPs: 51,808,043,008
    # Small kernels per token on one of 2 devices (fp16): two norms 2 x 2 x 4096, rotary
    # 2 x (16 + 16) x 128, gated activation 3 x 11,008 / 2, residual add 3 x 4096 =
    # 53,376 elements = 106,752 bytes.
    assert parts[0, 4] == 256 * 106_752
    assert parts[1, 4] == 2 * (16384 + 2 * 64 * 128 + 3 * 11008 + 12288)  # tp 1, one token
    assert list(parts[:, 7]) == [1, 1] and not parts[:, [1, 3, 5, 6]].any()  # one layer, no KV


def test_one_norm_and_no_gate(tmp_path):
    # phi-2: ungated MLP (up and down only), one norm a layer (empty second-norm cells).
    cells = ["0.01"] * len(LAYER_COLUMNS)
    cells[LAYER_COLUMNS.index("post_attention_layernorm_ms")] = ""
    path = tmp_path / "a100__phi.csv"
    path.write_text(f"{PHI2}\n{HEADER}\n8,1,{','.join(cells)},0.003\n")
    t = read_vidur(str(path))
    assert t.seconds[0] == pytest.approx(8 * 0.01e-3)
    assert t.shape.projection_params == 2560 * 96 * 80 + 2560 * 2560 + 2 * 2560 * 10240
    assert list(t.norms) == [1]
    # one norm 2 x 2560, rotary 2 x 64 x 80, activation 2 x 10,240, add 3 x 2560
    assert layer_parts(t)[0, 4] == 8 * 2 * (5120 + 10240 + 20480 + 7680)


def synthetic(shape_line: str, hardware, tmp_path: Path, name: str) -> VidurTable:
    """Rows at tp 1-8 whose times are the cost model's own price on ``hardware``."""
    grid = [(t, tp, 1.0) for tp in (1, 2, 4, 8) for t in (1, 8, 32, 64, 128, 192, 256, 384, 512,
                                                         1024, 2048, 4096)]
    table = read_vidur(str(write_rows(tmp_path / name, shape_line, grid)))
    return replace(table, seconds=price_rows(hardware, table))


def test_fit_recovers_known_figures(tmp_path):
    peak = get_hardware("h100-sxm-datasheet")
    truth = replace(peak, name="truth", bandwidth_fraction=0.9, flops_fraction=0.8, overlap=0.3,
                    per_layer_overhead_s=30e-6, elementwise_bytes_per_s=1.2e12)
    tables = [synthetic(LLAMA2_7B, truth, tmp_path, "h100__a.csv"),
              synthetic(PHI2, truth, tmp_path, "h100__b.csv")]
    got = fitted_profile(fit_layers(tables, peak), peak, "got")
    assert got.bandwidth_fraction == pytest.approx(0.9, rel=1e-3)
    assert got.flops_fraction == pytest.approx(0.8, rel=1e-3)
    assert got.overlap == pytest.approx(0.3, abs=1e-3)
    assert got.per_layer_overhead_s == pytest.approx(30e-6, rel=1e-3)
    assert got.elementwise_bytes_per_s == pytest.approx(1.2e12, rel=1e-3)
    assert (got.hbm_bytes_per_s, got.peak_flops_per_s, got.memory_bytes) == \
        (peak.hbm_bytes_per_s, peak.peak_flops_per_s, peak.memory_bytes)


def test_fit_prices_layers_as_the_simulator_does():
    # The fit's vectorised formula and envs.cost's price must be one cost model.
    hw = get_hardware("a100-80g")
    t = read_vidur(str(DATA / "a100__Llama-2-70b-hf.csv"))
    np.testing.assert_allclose(fit_of(hw).predict(layer_parts(t)), price_rows(hw, t), rtol=1e-12)


@pytest.mark.parametrize("preset, fit_files, peak", [
    ("h100-sxm", ["h100__Llama-2-7b-hf.csv", "h100__phi-2.csv"], "h100-sxm-datasheet"),
    ("a100-80g", ["a100__Meta-Llama-3-8B.csv", "a100__Llama-2-7b-hf.csv", "a100__phi-2.csv"],
     "a100-80g-datasheet")])
def test_presets_are_what_the_bundled_data_fits(preset, fit_files, peak):
    base = get_hardware(peak)
    got = fitted_profile(fit_layers([read_vidur(str(DATA / f)) for f in fit_files], base), base, preset)
    hw = get_hardware(preset)
    for field in ("bandwidth_fraction", "flops_fraction", "overlap", "per_layer_overhead_s",
                  "elementwise_bytes_per_s"):
        assert getattr(hw, field) == pytest.approx(getattr(got, field), rel=5e-3), field


def test_measured_layer_is_flat_then_grows():
    # H100, Llama-2-7B shapes, tp 1: within 10% of the 1-token time up to 64 tokens, and
    # about 1.6x of it at 256.
    t = read_vidur(str(DATA / "h100__Llama-2-7b-hf.csv")).with_tp(1)
    assert flat_end(t) == 64
    assert t.seconds[t.tokens == 256][0] / t.seconds[t.tokens == 1][0] == pytest.approx(1.63, abs=0.05)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "envs.calibrate", *args], capture_output=True, text=True)


def test_check_mode_on_a_tiny_file(tmp_path):
    # Rows measured at the datasheet roofline's price divided by 1, 1.1, 1.25, 1 and 1.2;
    # for this layer at tp 1 that price is max(404,750,336 B / (0.78 x 3.35 TB/s),
    # 2 x tokens x 202,375,168 / (0.73 x 989.4 TFLOP/s)). The errors are 0, 10%, 25%, 0
    # and 20%: median 10%, p90 (interpolated) 20% + 0.6 x 5% = 23%.
    def price_ms(tokens):
        return max(404_750_336 / (0.78 * 3.35e12), 2 * tokens * 202_375_168 / (0.73 * 989.4e12)) * 1e3

    rows = [(1, 1, price_ms(1)), (64, 1, price_ms(64) / 1.1), (512, 1, price_ms(512) / 1.25),
            (2048, 1, price_ms(2048)), (4096, 1, price_ms(4096) / 1.2), (64, 2, 1.0)]
    a = write_rows(tmp_path / "h100__a.csv", LLAMA2_7B, rows[:3] + rows[5:])
    b = write_rows(tmp_path / "h100__b.csv", LLAMA2_7B, rows[3:5])
    out = cli("--vidur", str(a), "--vidur", str(b), "--tp", "1", "--hardware", "h100-sxm-datasheet",
              "--check", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["rows"] == 5
    assert r["median_abs_pct"] == pytest.approx(10.0, abs=1e-3)
    assert r["p90_abs_pct"] == pytest.approx(23.0, abs=1e-3)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace(",mlp_act_ms", ",mlp_act"), "line 2: missing column(s) mlp_act_ms"),
    (lambda s: s.replace("\n64,2,0.5,", "\n64,2,fast,"),
     "line 4: input_layernorm_ms: got 'fast', must be a number"),
    (lambda s: s.replace("n_embd=4096, ", ""), "line 1: missing n_embd"),
    (lambda s: s.replace("n_embd=4096", "n_embd=4100"),
     "line 1: n_embd: got 4100, must be a multiple of n_head (32)"),
    (lambda s: s.replace("\n64,2,", "\n64,0,"), "line 4: tp: got '0', must be an integer > 0"),
])
def test_bad_files_name_file_line_and_field(tmp_path, edit, message):
    path = tmp_path / "h100__bad.csv"
    lines = [LLAMA2_7B, HEADER, "1,1," + ",".join(["0.01"] * len(LAYER_COLUMNS)) + ",0.003",
             "64,2,0.5," + ",".join(["0.01"] * (len(LAYER_COLUMNS) - 1)) + ",0.003"]
    path.write_text(edit("\n".join(lines) + "\n"))
    with pytest.raises(ConfigError) as err:
        read_vidur(str(path))
    assert message in str(err.value) and str(path) in str(err.value)


def test_bad_input_is_one_line_on_the_command_line(tmp_path):
    path = write_rows(tmp_path / "h100__x.csv", LLAMA2_7B, [(1, 1, 0.2), (8, 2, 0.2)])
    out = cli("--vidur", str(path), "--tp", "4", "--hardware", "h100-sxm", "--check")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr
    assert f"vidur: '{path}' has no rows with tp 4 (it has tp 1, 2)" in lines[0]
    with pytest.raises(ConfigError, match="cannot read"):
        read_vidur(str(tmp_path / "none.csv"))
