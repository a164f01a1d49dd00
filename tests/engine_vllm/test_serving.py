"""What an operator relies on: start-up checks, hot reload, the fallback, logs, metrics,
and the async scheduler with outputs that arrive a step late (vLLM's real schedulers,
no model: fake runner outputs, as vLLM's own scheduler tests do)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler",
    reason="vLLM is not installed here; this tier runs in .venv-vllm (see .ci/run)")

import json
import logging
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from prometheus_client import REGISTRY

from policies.table import BudgetTable, TableError, write_atomic
from tests.engine_vllm.fixtures import (TINY_CPU_PROVENANCE, create_scheduler, fake_output,
                                        make_request, model_dir, table_dict)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = str(ROOT / "tables/h100-sxm__llama-3-8b.json")  # h100-sxm + llama-3-8b
# 512 with nothing decoding, 256 with 1-3 decodes, 128 with 4 or more.
BY_DECODES = table_dict([("running_decodes", [1, 4])], [512, 256, 128], default_budget=96)


def constant(budget: int, **provenance) -> dict:
    return table_dict([("running_decodes", [1])], [budget, budget], default_budget=budget,
                      **provenance)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture
def env(monkeypatch):
    """A clean chunkpilot environment: no variable left over from the caller."""
    for name in list(os.environ):
        if name.startswith("CHUNKPILOT_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def log():
    """The lines the schedulers log. A filter, not a handler: vLLM re-applies its logging
    config when it builds an engine config, which drops handlers of loggers below "vllm"
    (and "vllm" does not propagate to pytest's)."""
    records: list[logging.LogRecord] = []

    class Record(logging.Filter):
        def filter(self, record):
            records.append(record)
            return True

    target = logging.getLogger("vllm.chunkpilot")
    recorder = Record()
    target.addFilter(recorder)
    yield lambda level=logging.DEBUG: [r.getMessage() for r in records if r.levelno >= level]
    target.removeFilter(recorder)


def served_from_file(env, model, tmp_path, data: dict, cls_name="TableScheduler",
                     reload_s: str = "0", **kwargs):
    """A scheduler reading ``data`` from a file (looked at before every step by default)."""
    import policies.vllm_scheduler as vs

    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    env.setenv("CHUNKPILOT_TABLE", str(path))
    env.setenv("CHUNKPILOT_RELOAD_INTERVAL_S", reload_s)
    sched = create_scheduler(getattr(vs, cls_name), model, max_num_batched_tokens=1024, **kwargs)
    return sched, path


def step(sched, n: int = 1) -> list[int]:
    """Run ``n`` synchronous steps; the budgets they took."""
    budgets = []
    for _ in range(n):
        out = sched.schedule()
        budgets.append(sched.chunkpilot_history[-1][1])
        sched.update_from_output(out, fake_output(sched, out))
    return budgets


def with_decoders(sched, n: int = 5, prompt: int = 20, output: int = 200) -> None:
    """``n`` requests that prefill in the first step and decode for ``output`` tokens."""
    for i in range(n):
        sched.add_request(make_request(f"r{i}", prompt, output))


# --- start-up ------------------------------------------------------------------------

def test_provenance_mismatch_refused_naming_both_sides_and_override_accepts(env, model, log):
    from policies.vllm_scheduler import TableScheduler

    env.setenv("CHUNKPILOT_TABLE", SHIPPED)
    # A ceiling the table's fallback budget fits under: only the provenance is wrong.
    ceiling = max(1024, json.loads(Path(SHIPPED).read_text())["default_budget"])
    with pytest.raises(TableError) as err:
        create_scheduler(TableScheduler, model, max_num_batched_tokens=ceiling)
    msg = str(err.value)
    assert "\n" not in msg
    assert "hardware: table h100-sxm, serving cpu" in msg
    assert ("model: table llama-3-8b (layers 32, hidden_size 4096, heads 32, kv_heads 8, "
            "head_dim 128, bytes_per_weight 2, params 8.03e09), serving " in msg)
    # The served side counts the tiny model's weights from its config.json.
    assert "(layers 2, hidden_size 128, heads 4, kv_heads 2, head_dim 32, bytes_per_weight 4, params " in msg
    assert msg.endswith("set CHUNKPILOT_ALLOW_MISMATCH=1 to serve it anyway")
    env.setenv("CHUNKPILOT_ALLOW_MISMATCH", "1")
    sched = create_scheduler(TableScheduler, model, max_num_batched_tokens=ceiling)
    assert sched.chunkpilot_table.path == SHIPPED
    assert any("provenance does not match" in m for m in log(logging.WARNING))


def test_tensor_parallel_and_slo_are_compared(env, model, tmp_path):
    tp2 = {**TINY_CPU_PROVENANCE["model"], "tensor_parallel": 2}
    with pytest.raises(TableError, match="tensor_parallel 2\\), serving .*tensor_parallel 1"):
        served_from_file(env, model, tmp_path, constant(256, model=tp2))
    env.setenv("CHUNKPILOT_SLO_ITL_S", "0.05")
    with pytest.raises(TableError, match="slo: table itl_s 0.1, serving itl_s 0.05"):
        served_from_file(env, model, tmp_path, constant(256))
    env.setenv("CHUNKPILOT_SLO_ITL_S", "0.1")
    served_from_file(env, model, tmp_path, constant(256))
    env.setenv("CHUNKPILOT_SLO_ITL_S", "fast")
    with pytest.raises(TableError, match="CHUNKPILOT_SLO_ITL_S: got 'fast'"):
        served_from_file(env, model, tmp_path, constant(256))
    env.setenv("CHUNKPILOT_SLO_ITL_S", "100")  # milliseconds meant: refused, the unit named
    with pytest.raises(TableError, match=r"CHUNKPILOT_SLO_ITL_S: got '100', must be at most 10 "
                                         r"seconds; targets are in seconds \(100 ms is 0.1\)"):
        served_from_file(env, model, tmp_path, constant(256))


def test_synchronous_scheduler_refused_when_async_scheduling_is_on(env, model, tmp_path):
    with pytest.raises(TableError, match="AsyncTableScheduler, or start vLLM with "
                                         "--no-async-scheduling"):
        served_from_file(env, model, tmp_path, constant(256), async_scheduling=True)
    sched, _ = served_from_file(env, model, tmp_path, constant(256), "AsyncTableScheduler",
                                async_scheduling=True)
    assert type(sched).__name__ == "AsyncTableScheduler"


def test_plugin_checks_the_table_before_any_engine_starts(env, model, tmp_path, log):
    """The general plug-in's check runs on the front end's config: no scheduler, no model."""
    import policies.vllm_startup as startup
    from vllm.engine.arg_utils import EngineArgs

    env.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)
    env.setattr(startup, "_registered", False)
    startup.register()
    args = dict(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
                max_num_batched_tokens=1024, enforce_eager=True,
                scheduler_cls="policies.vllm_scheduler.TableScheduler")
    env.setenv("CHUNKPILOT_TABLE", SHIPPED)
    with pytest.raises(TableError, match="hardware: table h100-sxm, serving cpu"):
        EngineArgs(**args).create_engine_config()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(constant(256)))
    env.setenv("CHUNKPILOT_TABLE", str(good))
    config = EngineArgs(**args).create_engine_config()
    assert config.scheduler_config.scheduler_cls == args["scheduler_cls"]
    assert any("before loading the model: it fits" in m for m in log(logging.INFO))
    # Another scheduler: the plug-in stays out of the way, whatever the table variable says.
    env.setenv("CHUNKPILOT_TABLE", SHIPPED)
    EngineArgs(**{**args, "scheduler_cls": None}).create_engine_config()


def test_start_line_names_the_table_its_provenance_and_budgets(env, model, tmp_path, log):
    served_from_file(env, model, tmp_path, BY_DECODES)
    (line,) = [m for m in log(logging.INFO) if m.startswith("chunkpilot: TableScheduler reads")]
    assert "cpu + tiny-llama (TP 1), SLO TTFT 2 s / ITL 0.1 s" in line
    assert "budgets 128-512, default 96" in line and "ceiling 1024 tokens" in line
    assert "provenance matches" in line


def test_a_table_s_needs_decide_what_the_adapter_counts(env, model, tmp_path):
    """A table that reads every queue quantity gets each of them; one that reads only the
    running decodes gets them alone (each step walks no queue it need not). What each
    value means is tested step by step in test_state.py."""
    from envs.state import SLACK_COUNTS, TABLE_INPUTS

    names = [n for n in TABLE_INPUTS if n not in SLACK_COUNTS]
    data = table_dict([(n, [1]) for n in names], [256] * 2 ** len(names), default_budget=256)
    sched, _ = served_from_file(env, model, tmp_path, data)
    assert sched.chunkpilot_table.needs == set(names)
    with_decoders(sched, n=3)
    step(sched, 2)
    assert set(sched.chunkpilot_history[-1][0]) == set(names)
    lean, _ = served_from_file(env, model, tmp_path, BY_DECODES)
    with_decoders(lean, n=3)
    step(lean, 2)
    assert set(lean.chunkpilot_history[-1][0]) == {"running_decodes"}
    # With no partial prefill, the head is the next waiting request.
    idle, _ = served_from_file(env, model, tmp_path, data)
    idle.add_request(make_request("first", 40, 2))
    state = idle.chunkpilot_state()
    assert (state["head_prefilled_tokens"], state["head_remaining_tokens"]) == (0, 40)
    assert state["running_decodes"] == 0 and state["waiting_requests"] == 1


# --- reload and fallback -------------------------------------------------------------

def test_reloaded_table_takes_effect_at_the_next_step(env, model, tmp_path, log):
    sched, path = served_from_file(env, model, tmp_path, BY_DECODES)
    with_decoders(sched)
    assert step(sched, 3) == [512, 128, 128]
    BudgetTable(constant(64)).save(str(path))  # atomic replace, as the export writes
    assert step(sched, 2) == [64, 64]
    assert sched.chunkpilot_reloads == 1
    assert any(m.startswith("chunkpilot: reloaded") for m in log(logging.INFO))
    # Rewritten in place (same inode): noticed too.
    with open(path, "w") as fh:
        json.dump(constant(200), fh)
    assert step(sched, 1) == [200]


def test_corrupt_or_refused_replacement_keeps_the_old_table_and_says_why_once(env, model,
                                                                              tmp_path, log):
    sched, path = served_from_file(env, model, tmp_path, BY_DECODES)
    with_decoders(sched)
    assert step(sched, 2) == [512, 128]
    write_atomic(str(path), "{not json")
    assert step(sched, 4) == [128] * 4
    refusals = [m for m in log(logging.WARNING) if "the replaced file is refused" in m]
    assert len(refusals) == 1 and "not valid JSON" in refusals[0]
    for bad, why in ((constant(2048), "exceeds the engine's max_num_batched_tokens"),
                     ({**constant(64), "schema_version": 1}, "re-export it"),
                     (constant(64, hardware={**TINY_CPU_PROVENANCE["hardware"], "name": "h200"}),
                      "hardware: table h200, serving cpu")):
        write_atomic(str(path), json.dumps(bad))
        assert step(sched, 2) == [128, 128]
        assert why in log(logging.WARNING)[-1]
    os.unlink(path)
    assert step(sched, 2) == [128, 128]
    assert "cannot be read" in log(logging.WARNING)[-1]
    assert len(log(logging.WARNING)) == 5  # one line per replacement, none per step
    BudgetTable(constant(64)).save(str(path))
    assert step(sched, 1) == [64]
    assert sched.chunkpilot_fallbacks == 0


def test_reload_check_is_throttled(env, model, tmp_path):
    sched, path = served_from_file(env, model, tmp_path, BY_DECODES, reload_s="3600")
    with_decoders(sched)
    step(sched, 2)
    BudgetTable(constant(64)).save(str(path))
    assert step(sched, 3) == [128] * 3  # not looked at within the hour


def test_failed_lookup_takes_the_default_budget_and_serving_goes_on(env, model, tmp_path, log):
    sched, _ = served_from_file(env, model, tmp_path, BY_DECODES)
    with_decoders(sched)
    assert step(sched, 2) == [512, 128]

    def broken(state):
        raise ZeroDivisionError("division by zero")

    sched._cp_budget = broken
    assert step(sched, 3) == [96, 96, 96]  # the table's default_budget
    assert sched.chunkpilot_fallbacks == 3
    warnings = [m for m in log(logging.WARNING) if "lookup in" in m]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]
    sched._cp_budget = lambda state: float("nan")
    assert step(sched, 1) == [96]


# --- observability -------------------------------------------------------------------

def test_metrics_appear_on_the_registry(env, model, tmp_path):
    sched, path = served_from_file(env, model, tmp_path, BY_DECODES)
    labels = {"model_name": model, "engine": "0"}

    def value(name, **extra):
        return REGISTRY.get_sample_value(name, {**labels, **extra}) or 0.0

    before = {n: value(n) for n in ("chunkpilot:budget_tokens_count",
                                    "chunkpilot:budget_tokens_sum")}
    with_decoders(sched)
    budgets = step(sched, 4)
    assert value("chunkpilot:budget_tokens_count") - before["chunkpilot:budget_tokens_count"] == 4
    assert value("chunkpilot:budget_tokens_sum") - before["chunkpilot:budget_tokens_sum"] == sum(
        budgets)
    info = {"table": str(path), "digest": sched.chunkpilot_table.digest, "hardware": "cpu",
            "model": "tiny-llama", "tp": "1", "slo_ttft_s": "2.0", "slo_itl_s": "0.1",
            "exported": ""}
    assert value("chunkpilot:table_info", **info) == 1
    applied = value("chunkpilot:table_reloads_total", outcome="applied")
    BudgetTable(constant(64)).save(str(path))
    step(sched)
    assert value("chunkpilot:table_reloads_total", outcome="applied") == applied + 1
    assert value("chunkpilot:table_info", **info) == 0  # the replaced table
    assert value("chunkpilot:table_info", **{**info, "digest": sched.chunkpilot_table.digest}) == 1


MULTIPROCESS_ENGINE = """
import json, os, sys
import prometheus_client  # imported before the folder is set, as a forking front end does
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
sys.path.insert(0, {root!r})
from tests.engine_vllm.fixtures import create_scheduler, fake_output, make_request
from policies.vllm_scheduler import TableScheduler
sched = create_scheduler(TableScheduler, sys.argv[1], max_num_batched_tokens=1024)
for i in range(5):
    sched.add_request(make_request(f"r{{i}}", 20, 50))
for _ in range(7):
    out = sched.schedule()
    sched.update_from_output(out, fake_output(sched, out))
"""


def test_metrics_reach_the_api_server_in_prometheus_multiprocess_mode(env, model, tmp_path):
    """An engine process writes its samples to PROMETHEUS_MULTIPROC_DIR; the API server
    process reads them with the registry vLLM's /metrics uses."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    folder = tmp_path / "prom"
    folder.mkdir()
    table = tmp_path / "table.json"
    table.write_text(json.dumps(BY_DECODES))
    env.setenv("CHUNKPILOT_TABLE", str(table))
    script = tmp_path / "engine.py"
    script.write_text(MULTIPROCESS_ENGINE.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script), model, str(folder)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    registry = CollectorRegistry()  # what vLLM's get_prometheus_registry builds
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    labels = {"model_name": model, "engine": "0"}
    assert registry.get_sample_value("chunkpilot:budget_tokens_count", labels) == 7
    assert registry.get_sample_value("chunkpilot:budget_tokens_bucket", {**labels, "le": "128.0"}) == 6
    text = generate_latest(registry).decode()
    assert 'chunkpilot:table_info{' in text and 'hardware="cpu"' in text


def test_summary_line_reports_budgets_clamps_and_rate(env, model, tmp_path, log):
    env.setenv("CHUNKPILOT_SUMMARY_INTERVAL_S", "1e-9")  # a line after every step
    sched, _ = served_from_file(env, model, tmp_path, BY_DECODES)
    with_decoders(sched)
    step(sched, 3)
    lines = [m for m in log(logging.INFO) if m.startswith("chunkpilot: last")]
    assert len(lines) == 3
    assert "1 steps" in lines[-1] and "budgets 128:1" in lines[-1] and "lookups/s" in lines[-1]
    # A table that asks for less than the running decodes is raised to them, and counted.
    many = table_dict([("running_decodes", [1])], [512, 2], default_budget=2)
    sched, _ = served_from_file(env, model, tmp_path, many)
    with_decoders(sched)
    step(sched, 2)
    assert "raised to the running decodes 1x" in log(logging.INFO)[-1]
    assert "budgets 5:1" in log(logging.INFO)[-1]


def test_summary_histogram_bins_many_budgets():
    from collections import Counter

    from policies.vllm_metrics import histogram

    assert histogram(Counter({256: 2, 1024: 5})) == "256:2 1024:5"
    many = Counter({b: 1 for b in range(100, 1100, 100)})
    assert histogram(many) == "<=128:1 <=256:1 <=512:3 <=1024:5"


# --- async scheduling ----------------------------------------------------------------

def expected_budget(sched, table: BudgetTable) -> int:
    """The budget the table gives for the scheduler's state, computed here independently."""
    decodes = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
    partial = sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.running
                  if r.num_computed_tokens < r.num_prompt_tokens)
    waiting = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    state = {"running_decodes": decodes, "waiting_prefill_tokens": partial + waiting,
             "waiting_requests": len(sched.waiting)}
    return max(table.lookup(**{n: state[n] for n in table.needs}), decodes)


def run_with_delayed_outputs(sched, arrivals: dict[int, list], check=None, max_steps=500):
    """Drive an async scheduler as vLLM's engine does with async scheduling: each step's
    output is applied only after the next step is scheduled (two batches in flight).
    ``arrivals`` maps a step index to the requests added before it. Returns every
    ``schedule()`` call's ``num_scheduled_tokens`` and the most output placeholders seen
    (tokens scheduled but not yet returned: only the async path has them)."""
    plans, in_flight, placeholders = [], deque(), 0
    for i in range(max_steps):
        for req in arrivals.get(i, []):
            sched.add_request(req)
        if check:
            check(sched)
        out = sched.schedule()
        placeholders = max([placeholders] + [r.num_output_placeholders for r in sched.running])
        plans.append(dict(out.num_scheduled_tokens))
        if out.num_scheduled_tokens:
            in_flight.append((out, fake_output(sched, out)))
        if len(in_flight) == 2 or (in_flight and not out.num_scheduled_tokens):
            sched.update_from_output(*in_flight.popleft())
        if not in_flight and not sched.has_unfinished_requests() and i > max(arrivals):
            return plans, placeholders
    raise AssertionError("requests did not finish")


def arrivals() -> dict[int, list]:
    """Five chatty requests, a 3,000-token prompt among them at step 3, two more later."""
    return {0: [make_request(f"short{i}", 20, 40) for i in range(5)],
            3: [make_request("long", 3000, 8)],
            9: [make_request("late0", 300, 10), make_request("late1", 50, 30)]}


def test_async_scheduler_follows_the_table_with_delayed_outputs(env, model, tmp_path):
    data = table_dict([("running_decodes", [1, 4]), ("waiting_prefill_tokens", [1])],
                      [64, 1024, 64, 256, 64, 160], default_budget=256)
    table = BudgetTable(data)
    sched, _ = served_from_file(env, model, tmp_path, data, "AsyncTableScheduler",
                                async_scheduling=True)
    wants = []
    requests = arrivals()
    plans, placeholders = run_with_delayed_outputs(
        sched, requests, check=lambda s: wants.append(expected_budget(s, table)))
    assert placeholders > 0  # steps were scheduled ahead of their outputs
    budgets = [b for _, b in sched.chunkpilot_history]
    assert budgets == wants
    assert all(sum(p.values()) <= b for p, b in zip(plans, budgets))
    assert {160, 1024} <= set(budgets)  # the budget moved with the state
    long_steps = [p["long"] for p in plans if p.get("long", 0) > 1]  # its prefill chunks
    assert max(long_steps) <= 160 and len(long_steps) >= 3000 // 160
    for req in [r for batch in requests.values() for r in batch]:
        assert req.num_output_tokens == req.sampling_params.max_tokens, req.request_id
    assert sched.get_num_unfinished_requests() == 0
    assert sched.chunkpilot_fallbacks == 0


def test_async_table_scheduler_with_a_constant_table_is_vllms_async_scheduler(env, model,
                                                                             tmp_path):
    """Same arrivals, same delayed outputs: a table that always says 160 schedules exactly
    what vLLM's AsyncScheduler does with max_num_batched_tokens=160."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    ours, _ = served_from_file(env, model, tmp_path, constant(160), "AsyncTableScheduler",
                               async_scheduling=True)
    theirs = create_scheduler(AsyncScheduler, model, max_num_batched_tokens=160,
                              async_scheduling=True)
    plans_ours, _ = run_with_delayed_outputs(ours, arrivals())
    plans_theirs, _ = run_with_delayed_outputs(theirs, arrivals())
    assert len(plans_ours) > 3000 // 160
    assert plans_ours == plans_theirs
