"""End to end: vLLM's in-process LLM generates with the table scheduler, token for token
the same greedy output as with its default scheduler, each step's budget from the table."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

import json
import subprocess
import sys
from pathlib import Path

from policies.table import BudgetTable

ROOT = Path(__file__).resolve().parents[2]
TABLE = {"schema_version": 1, "kind": "chunkpilot-budget-table",
         "features": [{"name": "running_decodes", "edges": [1, 4]},
                      {"name": "waiting_prefill_tokens", "edges": [1]}],
         "budgets": [64, 512, 64, 128, 64, 96], "default_budget": 128}


def generate(model: Path, table: Path | None = None, async_scheduling: bool = False) -> dict:
    cmd = [sys.executable, str(ROOT / "tests/engine_vllm/run_llm.py"), str(model)]
    if table:
        cmd += ["--table", str(table)]
    if async_scheduling:
        cmd += ["--async-scheduling"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
