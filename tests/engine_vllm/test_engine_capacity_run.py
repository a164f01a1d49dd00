"""The real-engine capacity benchmark, reduced (slow tier, in the vLLM environment):
one workload, three policies, one stream, one probe of bisection."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")


@pytest.mark.slow
def test_a_reduced_capacity_run_serves_every_arm_and_reports_both_sides(tmp_path):
    """Calibration on the engine's own steps, a table exported for the deployment and
    served without the mismatch override (it learns the engine's speed), vLLM's default
    and the simulator's best static: each gets a measured capacity and three predicted
    ones (the calibration's jitter, the replays' jitter, exact prices), and the report
    pairs them. (About five minutes on 2 cores.)"""
    import benchmarks.engine_capacity as bench

    out = tmp_path / "out"
    rc = bench.main(["--out", str(out), "--work", str(tmp_path / "work"), "--requests", "24",
                     "--calibration-requests", "12", "--streams", "1", "--rules", "time-budget",
                     "--neighbours", "0", "--max-probes", "1", "--step", "1.5",
                     "--fractions", "0.9"])  # the pick is time-budget itself: no fourth arm
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    names = {k.split("|")[0] for k in data["predicted"]}
    assert {"vllm-default", "table:time-budget"} <= names
    # the simulator's best static, unless it is vLLM's default (served once, as itself)
    assert names - {"vllm-default", "table:time-budget"} <= {f"static:{data['meta']['best_static_predicted']}"}
    assert set(data["measured"]) == set(data["predicted"]) == set(data["predicted_exact"])
    assert set(data["predicted_replays"]) == set(data["predicted"])  # with the replays' own jitter
    assert (out / "cpu-replays.toml").exists() and data["meta"]["fraction_predicted"] == "time-budget:0.9"
    served = {p["policy"] for p in data["probes"]}
    assert served == names
    assert all("speed_scale" in p for p in data["probes"] if p["policy"].startswith("table:"))
    text = (out / "README.md").read_text()
    assert "| table:time-budget |" in text and "table:time-budget / best static" in text
