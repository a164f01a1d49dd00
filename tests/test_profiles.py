"""Profiles: presets, files, and errors that list what is known."""

from __future__ import annotations

import json

import pytest

from envs.errors import ConfigError
from envs.profiles import (HARDWARE_PRESETS, MODEL_PRESETS, get_hardware, get_model,
                           profile_to_toml)


def test_presets_cover_the_required_parts_and_models():
    assert {"h100-sxm", "h200", "a100-80g", "l40s", "m5-max"} <= set(HARDWARE_PRESETS)
    assert {"llama-3-8b", "llama-3-70b-tp4", "llama-3-70b-tp8", "mistral-7b", "qwen2.5-32b",
            "llama-3-8b-q4"} <= set(MODEL_PRESETS)
    assert get_model("llama-3-70b").tensor_parallel == 8


def test_kv_bytes_per_token():
    # 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes
    assert get_model("llama-3-8b").kv_bytes_per_token == 131072
    assert get_model("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'h900'; did you mean h200\? known: "
                                          r"a100-80g, a100-80g-datasheet, h100-sxm"):
        get_hardware("h900")
    with pytest.raises(ConfigError, match="llama-3-8b"):
        get_model("gpt-5")


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_profile_files_round_trip(tmp_path, suffix):
    hw = get_hardware("a100-80g", per_pass_overhead_s=0.003)
    path = tmp_path / f"mine{suffix}"
    if suffix == ".toml":
        path.write_text(profile_to_toml(hw))
    else:
        path.write_text(json.dumps({"hardware": hw.__dict__}))
    assert get_hardware(str(path)) == hw
    model = get_model("mistral-7b")
    mpath = tmp_path / "m.toml"
    mpath.write_text(profile_to_toml(model))
    assert get_model(str(mpath)) == model


def test_bad_profile_files(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[hardware]\nhbm_bytes_per_s = 1e12\n")
    with pytest.raises(ConfigError, match="missing field"):
        get_hardware(str(p))
    p.write_text("[hardware]\nhbm_bytes_per_s = -1\npeak_flops_per_s = 1e14\nmemory_bytes = 1e9\n")
    with pytest.raises(ConfigError, match=r"hardware.hbm_bytes_per_s: got -1"):
        get_hardware(str(p))
    p.write_text("[hardware]\nbogus = 1\n")
    with pytest.raises(ConfigError, match="unknown field"):
        get_hardware(str(p))
    p.write_text("not toml [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        get_hardware(str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        get_hardware(str(tmp_path / "none.toml"))


def test_negative_overhead_is_refused():
    with pytest.raises(ConfigError, match="per_pass_overhead_s"):
        get_hardware("h100-sxm", per_pass_overhead_s=-1)


@pytest.mark.parametrize("field, value, allowed", [
    ("overlap", 1.5, r"must lie in \[0, 1\]"), ("overlap", -0.1, r"must lie in \[0, 1\]"),
    ("attention_bandwidth_ratio", 0.0, "must be a finite number > 0"),
    ("attention_flops_ratio", float("inf"), "must be a finite number > 0"),
    ("per_layer_overhead_s", -1e-6, "must be a finite number >= 0"),
    ("elementwise_bytes_per_s", 0.0, "must be a finite number > 0"),
    ("interconnect_bytes_per_s", -1.0, "must be a finite number > 0"),
    ("allreduce_latency_s", -1.0, "must be a finite number >= 0")])
def test_attention_and_overlap_fields_are_checked(tmp_path, field, value, allowed):
    p = tmp_path / "cpu.toml"
    p.write_text("[hardware]\nname = \"cpu\"\nhbm_bytes_per_s = 1e10\npeak_flops_per_s = 1e11\n"
                 f"memory_bytes = 1e9\n{field} = {value!r}\n")
    with pytest.raises(ConfigError, match=rf"hardware.{field}: got {value!r}, {allowed}"):
        get_hardware(str(p))
