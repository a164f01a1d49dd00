"""Budget policies, specs, the lookup-table runtime and its export."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.errors import ConfigError
from envs.profiles import get_hardware
from envs.scenario import Scenario
from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                SarathiSLOPolicy, StaticPolicy, vllm_default_budget)
from policies.specs import make_policies, make_policy
from policies.table import BudgetTable, TableError
from tests.conftest import make_sim

ROOT = Path(__file__).resolve().parent.parent
SMALL = Scenario(num_requests=150, rate=6.0)


class FakeState:
    def __init__(self, num_decodes=0, num_waiting=0, waiting_prefill_tokens=0, kv_usage=0.0):
        self.running_decodes = num_decodes
        self.waiting_requests = num_waiting
        self.waiting_prefill_tokens = waiting_prefill_tokens
        self.kv_usage = kv_usage


def test_vllm_default_follows_memory_and_part():
    assert vllm_default_budget(get_hardware("h100-sxm")) == 8192
    assert vllm_default_budget(get_hardware("h200")) == 8192
    assert vllm_default_budget(get_hardware("h100-sxm"), "offline") == 16384
    assert vllm_default_budget(get_hardware("a100-80g")) == 2048
    assert vllm_default_budget(get_hardware("l40s")) == 2048
    assert vllm_default_budget(get_hardware("l40s"), "offline") == 8192


@pytest.mark.parametrize("decodes, expected", [(0, 2048), (5, 5 + 1024), (20, 20 + 512),
                                               (80, 80 + 256)])
def test_queue_depth_heuristic(decodes, expected):
    assert QueueDepthPolicy(512)(FakeState(num_decodes=decodes)) == expected


def test_no_decode_boost_and_floor_at_running_decodes():
    p = NoDecodeBoostPolicy(256, 8192)
    assert p(FakeState(num_decodes=0)) == 8192
    assert p(FakeState(num_decodes=3)) == 256
    assert p(FakeState(num_decodes=300)) == 300  # never below the decodes that must run


def test_free_ride_policy_uses_the_exact_free_ride():
    from envs.pricing import free_ride_root

    # The first request decodes while the later prompts arrive: their passes have decodes
    # running, so the free ride is computed for them.
    sim = make_sim([(0.0, 100, 400), (0.02, 4000, 50), (0.03, 300, 200), (0.2, 20000, 5)],
                   hardware=get_hardware("h100-sxm"), model="llama-3-8b")
    seen = []
    policy = FreeRidePolicy()

    def spy(state):
        b = policy(state)
        seen.append((state.running_decodes, state.decode_context_tokens, state.head_prefilled_tokens, b))
        return b

    sim.run(spy)
    assert seen[0][3] == 16384  # nothing decoding: no free ride to protect, go big
    with_decodes = [s for s in seen if s[0]]
    assert len(with_decodes) >= 3 and any(p > 0 for _, _, p, _ in with_decodes)
    for n, ctx, prefix, b in with_decodes:
        exact = n + int(free_ride_root(sim.cost, n, ctx, prefix))
        assert b == min(max(exact, 256), 16384)
    assert len({b for *_, b in with_decodes}) > 1  # the ride moves with the batch


def test_sarathi_slo_meets_the_itl_target_at_the_typical_batch():
    p = SarathiSLOPolicy.fit(SMALL)
    assert p.typical["pass_s"] <= SMALL.slo_itl_s
    tighter = SarathiSLOPolicy.fit(SMALL.with_fields(slo_itl_s=0.05))
    assert tighter.tokens < p.tokens


def test_specs_build_every_kind_and_reject_unknown():
    names = [p.name for p in make_policies(
        "static:2048,vllm-default,vllm-default:offline,queue-depth,queue-depth:256,"
        "no-decode-boost,no-decode-boost:512:8192,free-ride,sarathi-slo", SMALL)]
    # Every name is the spec a user types for it, its parameters where they differ from
    # the defaults (the budgets the defaults come to are their detail, not their name).
    assert names == ["static:2048", "vllm-default", "vllm-default:offline", "queue-depth",
                     "queue-depth:256", "no-decode-boost", "no-decode-boost:512:8192", "free-ride",
                     "sarathi-slo"]
    for name in names:
        assert make_policy(name, SMALL).name == name
    assert make_policies("vllm-default,vllm-default:offline", SMALL)[1].tokens == 16384
    with pytest.raises(ConfigError, match=r"unknown spec 'best'; known: static:N"):
        make_policy("best", SMALL)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        make_policy("static:64", SMALL)
    with pytest.raises(ConfigError, match="named twice"):
        make_policies("static:512,static:512", SMALL)
    with pytest.raises(ConfigError, match="not a train.py run directory"):
        make_policy("model:/nonexistent", SMALL)


def test_static_predict_follows_the_sb3_protocol():
    p = StaticPolicy(2048)
    action, state = p.predict(np.zeros(12, dtype=np.float32))
    assert int(action) == 5 and state is None  # 2048 is rung 5 of the default ladder
    batch, _ = p.predict(np.zeros((3, 12), dtype=np.float32))
    assert batch.tolist() == [5, 5, 5]


# --- tables ----------------------------------------------------------------------------

H100_LLAMA = {"hardware": {"name": "h100-sxm", "hbm_bytes_per_s": 3.35e12,
                           "peak_flops_per_s": 989.4e12, "memory_bytes": 80 * 2**30},
              "model": {"name": "llama-3-8b", "layers": 32, "hidden_size": 4096, "heads": 32,
                        "kv_heads": 8, "head_dim": 128, "bytes_per_weight": 2.0,
                        "tensor_parallel": 1},
              "slo": {"ttft_s": 2.0, "itl_s": 0.1}}


def table_dict(**over):
    d = {"schema_version": 2, "kind": "chunkpilot-budget-table", "action": {"kind": "tokens"},
         "features": [{"name": "running_decodes", "edges": [10, 50]},
                      {"name": "kv_usage", "edges": [0.5]}],
         "budgets": [4096, 2048, 2048, 1024, 1024, 512], "visited": [1, 1, 1, 1, 0, 1],
         "default_budget": 2048, "provenance": H100_LLAMA}
    d.update(over)
    return d


def test_lookup_by_hand():
    t = BudgetTable(table_dict())
    # running_decodes buckets: (<10), [10, 50), (>=50); kv_usage: (<0.5), (>=0.5)
    assert t.lookup(running_decodes=0, kv_usage=0.1) == 4096
    assert t.lookup(running_decodes=0, kv_usage=0.5) == 2048  # an edge belongs to the bucket above
    assert t.lookup(running_decodes=10, kv_usage=0.0) == 2048
    assert t.lookup(running_decodes=49, kv_usage=0.9) == 1024
    assert t.lookup(running_decodes=500, kv_usage=0.9) == 512
    assert t.max_budget == 4096
    assert t.needs == {"running_decodes", "kv_usage"}
    # budget() takes the engine's state mapping; quantities the table does not read are ignored
    assert t.budget({"running_decodes": 49, "kv_usage": 0.9, "waiting_requests": 3}) == 1024
    with pytest.raises(TableError, match="lookup needs 'kv_usage'"):
        t.lookup(running_decodes=3)
    with pytest.raises(KeyError):
        t.budget({"running_decodes": 3})


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 3}, "schema_version: got 3"),
    ({"schema_version": 1}, "re-export it"),
    ({"kind": "other"}, "kind: got 'other'"),
    ({"action": {"kind": "itl-fraction"}}, "action.kind: got 'itl-fraction'"),
    ({"budgets": [1, 2, 3]}, "budgets: must list 6 cells"),
    ({"budgets": [1, 2, 3, 4, 5, -6]}, "every cell must be a positive integer"),
    ({"features": [{"name": "running_decodes", "edges": [50, 10]}]}, "must increase strictly"),
    ({"features": [{"name": "gpu_temperature", "edges": [1]}]}, "an engine can provide"),
    ({"default_budget": 0}, "default_budget: got 0"),
    ({"provenance": {}}, "provenance.hardware: must be an object"),
    ({"provenance": {**H100_LLAMA, "model": {**H100_LLAMA["model"], "layers": 3.5}}},
     "provenance.model.layers: got 3.5"),
    ({"provenance": {**H100_LLAMA, "model": {**H100_LLAMA["model"], "params": -8e9}}},
     "provenance.model.params: got -8000000000.0, must be a number > 0"),
    ({"provenance": {**H100_LLAMA, "slo": {"ttft_s": 2.0}}}, "provenance.slo.itl_s"),
    ({"provenance": {**H100_LLAMA, "hardware": {**H100_LLAMA["hardware"], "per_pass_overhead_s": -1}}},
     r"provenance.hardware.per_pass_overhead_s: got -1, must be a number of seconds in \[0, 60\]"),
    ({"provenance": {**H100_LLAMA, "hardware": {**H100_LLAMA["hardware"], "per_pass_overhead_s": 1e300}}},
     r"per_pass_overhead_s: got 1e\+300, must be a number of seconds in"),
])
def test_corrupt_tables_are_one_line_errors(change, message):
    with pytest.raises(TableError, match=message) as err:
        BudgetTable(table_dict(**change))
    assert "\n" not in str(err.value)


def test_save_load_round_trip_and_csv(tmp_path):
    t = BudgetTable(table_dict())
    path = tmp_path / "sub" / "t.json"
    t.save(str(path))
    again = BudgetTable.load(str(path))
    assert again.budgets == t.budgets and again.edges == t.edges and again.visited == t.visited
    assert again.provenance == t.provenance and len(again.digest) == 12
    csv = t.to_csv().splitlines()
    assert csv[0] == "running_decodes_from,running_decodes_to,kv_usage_from,kv_usage_to,budget,visited"
    assert csv[1] == "-inf,10,-inf,0.5,4096,1"
    assert csv[5] == "50,inf,-inf,0.5,1024,0"
    path.write_text("{not json")
    with pytest.raises(TableError, match="not valid JSON"):
        BudgetTable.load(str(path))
    # Python's own text on a huge integer is 150 characters of advice, cut mid-word.
    path.write_text('{"default_budget": ' + "9" * 5000 + "}")
    with pytest.raises(TableError) as err:
        BudgetTable.load(str(path))
    assert str(err.value).endswith("t.json: not valid JSON (an integer of over 4,300 digits)")


def test_huge_integers_in_json_and_toml_files_are_named_in_one_short_line(tmp_path):
    from envs.errors import ConfigError
    from envs.files import load_json, load_toml

    for name, text in (("h.json", '{"x": ' + "9" * 5000 + "}"), ("h.toml", "x = " + "9" * 5000)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as err:
            (load_json if name.endswith("json") else load_toml)("profile", tmp_path / name)
        assert str(err.value).endswith("(an integer of over 4,300 digits)"), str(err.value)


def test_provenance_mismatch_names_both_sides():
    from envs.profiles import get_model
    from policies.table import hardware_provenance, model_provenance

    t = BudgetTable(table_dict(), path="t.json")
    hw, model = H100_LLAMA["hardware"], H100_LLAMA["model"]
    assert t.mismatch(hw, model, {"ttft_s": 2.0, "itl_s": 0.1}) is None
    # A table made before the parameter count was recorded compares the shape alone.
    assert t.mismatch(hardware_provenance(get_hardware("h100-sxm")),
                      model_provenance(get_model("mistral-7b"))) is None
    # An engine knows the device's name and memory, not its bandwidth: only those compared.
    assert t.mismatch({"name": "h100-sxm", "memory_bytes": 79.1 * 2**30}) is None
    assert t.mismatch({"name": "H100-SXM"}) is None
    assert t.mismatch({"name": "a100-80g"}) == "t.json: hardware: table h100-sxm, serving a100-80g"
    assert "memory_bytes" in t.mismatch({"name": "h100-sxm", "memory_bytes": 40e9})  # a MIG slice
    reason = t.mismatch(model={"name": "tiny", "layers": 2, "hidden_size": 4096, "heads": 32,
                               "kv_heads": 8, "head_dim": 128, "bytes_per_weight": 4,
                               "tensor_parallel": 2})
    assert reason == ("t.json: model: table llama-3-8b (layers 32, tensor_parallel 1, "
                      "bytes_per_weight 2), serving tiny (layers 2, tensor_parallel 2, "
                      "bytes_per_weight 4)")
    assert t.mismatch(model={**model, "bytes_per_weight": 2.1}) is None  # within tolerance
    # Mistral-7B has Llama-3-8B's shape and 10% fewer weights (a smaller vocabulary), so
    # each pass costs less: refused once the table records its parameter count.
    counted = BudgetTable(table_dict(provenance={**H100_LLAMA, "model": {**model, "params": 8.03e9}}),
                          path="t.json")
    assert counted.mismatch(model=model_provenance(get_model("mistral-7b"))) == (
        "t.json: model: table llama-3-8b (params 8.03e09), serving mistral-7b (params 7.24e09)")
    assert counted.mismatch(model=model_provenance(get_model("llama-3-8b"))) is None
    assert counted.mismatch(model={**model, "params": 8.2e9}) is None  # within 5%
    assert counted.mismatch(model=model) is None  # an engine that does not know it
    assert t.mismatch(slo={"ttft_s": 2.0, "itl_s": 0.05}) == (
        "t.json: slo: table itl_s 0.1, serving itl_s 0.05")
    both = t.mismatch({"name": "l40s"}, slo={"ttft_s": 1.0, "itl_s": None})
    assert both.count(";") == 1 and "hardware" in both and "ttft_s 1" in both


@pytest.mark.parametrize("device, name", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100 80GB PCIe", "a100-80g-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA L40S", "l40s"), ("cpu", "cpu"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
])
def test_device_names_map_to_hardware_presets(device, name):
    from policies.table import device_hardware_name
    assert device_hardware_name(device) == name


def table_cli(*args):
    return subprocess.run([sys.executable, "-m", "policies.table", *args], capture_output=True,
                          text=True)


def test_check_command_on_matching_and_mismatching_tables(tmp_path):
    ok = table_cli("check", "tables/h100-sxm__llama-3-8b.json", "--hardware", "h100-sxm",
                   "--model", "llama-3-8b", "--slo-ttft-s", "2", "--slo-itl-s", "0.1")
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stderr
    for args, needle in ((["--hardware", "a100-80g"], "hardware: table h100-sxm"),
                         (["--model", "llama-3-70b"], "model: table llama-3-8b (layers 32"),
                         (["--model", "mistral-7b"], "model: table llama-3-8b (params 8.03e09)"),
                         (["--slo-itl-s", "0.05"], "slo: table itl_s 0.1")):
        bad = table_cli("check", "tables/h100-sxm__llama-3-8b.json", *args)
        assert bad.returncode == 2 and needle in bad.stderr, bad.stderr
        assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    # A profile file is compared by its figures: an H100 with half the bandwidth is not one.
    slow = tmp_path / "slow.toml"
    slow.write_text('[hardware]\nname = "h100-sxm"\nhbm_bytes_per_s = 1.6e12\n'
                    'peak_flops_per_s = 989.4e12\nmemory_bytes = 85899345920\n')
    bad = table_cli("check", "tables/h100-sxm__llama-3-8b.json", "--hardware", str(slow))
    assert bad.returncode == 2 and "hbm_bytes_per_s" in bad.stderr
    show = table_cli("show", "tables/a100-80g__llama-3-8b.json")
    assert show.returncode == 0 and "a100-80g + llama-3-8b" in show.stdout
    assert "budgets up to 16384 (the ceiling to serve it with)" in show.stdout
    # The shipped A100 table is the time-budget-slack:7 rule's, kept over the model's tables.
    assert ("what it is: the time-budget-slack:7 rule's exact table: a rule, not a learned policy; "
            "measured against the ppo model of runs/presets/a100-80g__llama-3-8b; kept among 8 "
            "candidates (3 from the model's decisions, 5 rules' tables)") in show.stdout
    assert re.search(r"capacity against its model: serving [+-]\d+\.\d% ± \d+\.\d% \((ties|beats|falls short)\)",
                     show.stdout)
    # The L40S table is built from its model's decisions.
    show = table_cli("show", "tables/l40s__llama-3-8b.json")
    assert "what it is: built from the model's decisions alone; its model: the ppo model of" in show.stdout


@pytest.mark.parametrize("args, needle", [
    (["check", "/nonexistent.json"], "cannot read"),
    (["check", "tables/h100-sxm__llama-3-8b.json", "--hardware", "tpu-v9"], "unknown preset"),
    (["check", "tables/h100-sxm__llama-3-8b.json", "--slo-itl-s", "-1"], "--slo-itl-s"),
    (["check"], "required"),
    (["frobnicate"], "invalid choice"),
])
def test_check_command_bad_input_is_one_line(args, needle):
    out = table_cli(*args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_shipped_tables_load_with_their_provenance():
    from envs.profiles import get_model
    from policies.table import model_provenance

    for hw in ("h100-sxm", "a100-80g"):
        t = BudgetTable.load(f"tables/{hw}__llama-3-8b.json")
        assert t.provenance["hardware"]["name"] == hw
        assert t.mismatch(model=H100_LLAMA["model"], slo=H100_LLAMA["slo"]) is None
    for path in sorted(Path("tables").glob("*.json")):
        model = BudgetTable.load(str(path)).provenance["model"]
        assert model["params"] == model_provenance(get_model(model["name"]))["params"], path


def test_served_parameter_count_from_a_hugging_face_config():
    """Counted by hand: Llama-3-8B's embeddings 2 x 128,256 x 4,096 = 1,050,673,152, each
    of its 32 layers 2 x 4,096^2 + 2 x 4,096 x 1,024 (attention) + 3 x 4,096 x 14,336
    (MLP) = 218,103,808; Mistral-7B the same with a 32,000-token vocabulary."""
    from types import SimpleNamespace

    from policies.vllm_startup import dense_params

    llama = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    assert dense_params(SimpleNamespace(**llama)) == 1_050_673_152 + 32 * 218_103_808
    mistral = {**llama, "vocab_size": 32000}
    del mistral["head_dim"]  # hidden / heads when the config leaves it out
    assert dense_params(SimpleNamespace(**mistral)) == 2 * 32000 * 4096 + 32 * 218_103_808
    tied = {**llama, "tie_word_embeddings": True}  # one embedding matrix fewer
    assert dense_params(SimpleNamespace(**tied)) == 525_336_576 + 32 * 218_103_808
    assert dense_params(SimpleNamespace(**llama, num_local_experts=8)) is None  # mixture of experts
    assert dense_params(SimpleNamespace(hidden_size=4096)) is None


def test_the_served_deployment_is_read_from_the_environment_before_serving(monkeypatch):
    """CHUNKPILOT_HARDWARE and CHUNKPILOT_MODEL: both name the deployment a table that
    carries is re-priced for, with the simulator's cost model of it; one alone, or a value
    no preset or profile reads, stops the start with one line naming the variable."""
    from envs.scenario import Scenario
    from policies.table import TableError
    from policies.vllm_startup import Settings

    monkeypatch.setenv("CHUNKPILOT_TABLE", "t.json")
    monkeypatch.delenv("CHUNKPILOT_HARDWARE", raising=False)
    monkeypatch.delenv("CHUNKPILOT_MODEL", raising=False)
    assert Settings.from_env().served is None
    monkeypatch.setenv("CHUNKPILOT_HARDWARE", "l40s")
    monkeypatch.setenv("CHUNKPILOT_MODEL", "llama-3-70b-tp4")
    served = Settings.from_env().served
    assert served.cost == Scenario(hardware="l40s", model="llama-3-70b-tp4").simulator_cost()
    assert (served.hardware["name"], served.model["tensor_parallel"]) == ("l40s", 4)
    monkeypatch.setenv("CHUNKPILOT_HARDWARE", "l40s@peak_flops_per_s=2e14")  # still an L40S
    served = Settings.from_env().served
    assert (served.hardware["name"], served.hardware["peak_flops_per_s"]) == ("l40s", 2e14)
    for env, value, match in (("CHUNKPILOT_MODEL", "", "^CHUNKPILOT_MODEL: unset while CHUNKPILOT_HARDWARE is set"),
                              ("CHUNKPILOT_MODEL", "llama-9", "^CHUNKPILOT_MODEL: unknown .*llama-9"),
                              ("CHUNKPILOT_HARDWARE", "h100-sxm@peak_flops_per_s=0", "^CHUNKPILOT_HARDWARE: .*peak_flops_per_s")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            with pytest.raises(TableError, match=match) as err:
                Settings.from_env()
            assert "\n" not in str(err.value)


def test_a_named_deployment_is_what_a_carrying_table_is_checked_against(monkeypatch):
    """With CHUNKPILOT_HARDWARE/MODEL set, a table that carries is compared with the named
    deployment, which must be what the engine runs; unset, its own part is, and the reason
    says how to re-price it; a table made for one deployment cannot be re-priced."""
    import json

    from envs.profiles import get_hardware, get_model
    from policies.table import BudgetTable, TableError, hardware_provenance, model_provenance
    from policies.vllm_startup import Settings, provenance_reason

    path = "tables/h100-sxm__llama-3-8b.json"
    shipped = BudgetTable.load(path)
    data = json.loads(Path(path).read_text())
    data["provenance"]["deployments"] = {"range": {}}
    carrying = BudgetTable(data, path)
    l40s = {"name": "l40s", "memory_bytes": hardware_provenance(get_hardware("l40s"))["memory_bytes"]}
    h100 = {"name": "h100-sxm", "memory_bytes": hardware_provenance(get_hardware("h100-sxm"))["memory_bytes"]}
    llama = model_provenance(get_model("llama-3-8b"))
    monkeypatch.setenv("CHUNKPILOT_TABLE", path)
    monkeypatch.delenv("CHUNKPILOT_HARDWARE", raising=False)
    monkeypatch.delenv("CHUNKPILOT_MODEL", raising=False)
    unnamed = Settings.from_env()
    assert provenance_reason(carrying, unnamed, h100, llama) is None
    assert provenance_reason(carrying, unnamed, l40s, llama).endswith(
        "(a table that carries: set CHUNKPILOT_HARDWARE and CHUNKPILOT_MODEL to the deployment "
        "served to re-price it for it)")
    monkeypatch.setenv("CHUNKPILOT_HARDWARE", "l40s")
    monkeypatch.setenv("CHUNKPILOT_MODEL", "llama-3-8b")
    named = Settings.from_env()
    assert provenance_reason(carrying, named, l40s, llama) is None
    assert provenance_reason(carrying, named, h100, llama).startswith(
        "CHUNKPILOT_HARDWARE/CHUNKPILOT_MODEL describe another deployment than this engine runs: "
        "hardware")
    with pytest.raises(TableError, match="re-price only a table that carries"):
        provenance_reason(shipped, named, l40s, llama)


def test_eval_refuses_a_table_for_another_scenario_unless_allowed(capsys):
    path = "tables/h100-sxm__llama-3-8b.json"
    assert make_policy(f"table:{path}", SMALL).name == f"table:{path}"
    a100 = SMALL.with_fields(hardware="a100-80g")
    with pytest.raises(ConfigError, match=r"hardware: table h100-sxm \(hbm_bytes_per_s 3.35e12, "
                                          r".*\), serving a100-80g .*; pass --allow-table-mismatch"):
        make_policy(f"table:{path}", a100)
    with pytest.raises(ConfigError, match="slo: table"):
        make_policy(f"table:{path}", SMALL.with_fields(slo_ttft_s=1.0))
    make_policies(f"table:{path}", a100, allow_table_mismatch=True)
    assert "warning: tables/h100-sxm__llama-3-8b.json: hardware" in capsys.readouterr().err


def test_runtime_imports_nothing_beyond_the_standard_library():
    # A fresh interpreter without site-packages: every module loaded is the standard
    # library's, the table's own, or one of the standard-library modules of envs it rests
    # on (the pass price, the state vocabulary, the slack count, the deployment's features).
    code = ("import sys; import policies.table as t; "
            "t.BudgetTable.load('tables/h100-sxm__llama-3-8b.json').budget("
            "dict.fromkeys(t.STATE, 1)); "
            "ours = {'policies', 'policies.table', 'envs', 'envs.pricing', 'envs.state', "
            "'envs.slack', 'envs.deployment'}; "
            "bad = sorted(m for m in sys.modules if m not in ours and "
            "m.split('.')[0] not in set(sys.stdlib_module_names) | {'__main__'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-S", "-c", code], check=True, cwd=ROOT)


def test_table_policy_reads_the_scheduler_state():
    from policies.table_policy import TablePolicy
    p = TablePolicy(BudgetTable(table_dict()))
    assert p(FakeState(num_decodes=20, kv_usage=0.7)) == 1024


def test_build_table_from_states_fills_unvisited_cells_from_neighbours():
    from eval.export.cells import build_table, scenario_provenance
    rng = np.random.default_rng(0)
    feats = np.column_stack([rng.integers(0, 100, 500), rng.integers(0, 20, 500),
                             rng.integers(0, 50000, 500), rng.random(500) * 0.5])
    budgets = np.where(feats[:, 0] < 30, 4096, 1024)  # a rule on running decodes only
    names = ("running_decodes", "waiting_requests", "waiting_prefill_tokens", "kv_usage")
    t = build_table({n: feats[:, j] for j, n in enumerate(names)}, budgets, buckets=4,
                    provenance=scenario_provenance(SMALL))
    # The export records the scenario's profiles as the runtime compares them.
    assert t.provenance == {"hardware": {**H100_LLAMA["hardware"], "per_pass_overhead_s": 0.0},
                            "model": {**H100_LLAMA["model"], "params": 8.03e9}, "slo": H100_LLAMA["slo"]}
    agree = np.mean([t.lookup_values(f) == b for f, b in zip(feats, budgets)])
    assert agree > 0.9
    # A cell is visited exactly when some decision falls into it; there are cells no
    # decision reached (four features, 4 buckets each, 500 decisions), and each of those
    # holds the budget of a visited cell nearest it (fewest bucket steps away).
    hit = np.bincount([t.cell(f) for f in feats], minlength=len(t.visited))
    assert [bool(v) for v in t.visited] == [bool(h) for h in hit]
    shape = [len(e) + 1 for e in t.edges]
    coords = np.array(np.unravel_index(np.arange(len(t.visited)), shape)).T
    seen = np.flatnonzero(hit)
    empty = np.flatnonzero(hit == 0)
    assert len(empty) > 0
    for c in empty:
        dist = np.abs(coords[seen] - coords[c]).sum(axis=1)
        assert t.budgets[c] in {t.budgets[s] for s in seen[dist == dist.min()]}
    assert set(t.budgets) <= {1024, 4096}


def test_every_rule_answers_sb3_predict_on_env_observations():
    from stable_baselines3.common.evaluation import evaluate_policy

    from envs.chunk_budget_env import ChunkBudgetEnv, EpisodeSampler
    from envs.observation import ObservedState, observe
    from policies.table_policy import TablePolicy

    # Rules that read the scheduler's counts answer over the token-ladder actions.
    env = ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=30), actions="tokens",
                         decision_interval_s=0)
    obs, _ = env.reset(seed=0)
    for _ in range(15):
        obs, *_ = env.step(5)
    state = env.sim.state()
    seen = ObservedState(observe(env.sim.state(), env._slo), 256)
    assert seen.running_decodes == state.running_decodes
    assert seen.waiting_requests == state.waiting_requests
    assert abs(seen.waiting_prefill_tokens - state.waiting_prefill_tokens) <= 1 + 1e-5 * state.waiting_prefill_tokens
    assert seen.kv_usage == pytest.approx(state.kv_usage, abs=1e-6)
    policies = [StaticPolicy(2048), QueueDepthPolicy(), NoDecodeBoostPolicy(),
                TablePolicy(BudgetTable(table_dict()))]
    for p in policies:
        action, _ = p.predict(obs)
        assert env.budgets[int(action)] == env.budgets[p.action_for_budget(p(state))]
        batch, _ = p.predict(np.stack([obs, obs]))
        assert batch.shape == (2,)
    from stable_baselines3.common.monitor import Monitor
    mean, _ = evaluate_policy(QueueDepthPolicy(),
                              Monitor(ChunkBudgetEnv(sampler=EpisodeSampler(episode_requests=20),
                                                     actions="tokens")),
                              n_eval_episodes=1)
    assert np.isfinite(mean)


def test_a_table_for_other_hardware_is_evaluated_with_its_own_cost_model(tmp_path):
    """An A100 time-budget table made for that one deployment (no ``deployments`` range)
    evaluated on an H100 (--allow-table-mismatch) turns its fractions into tokens with the
    A100 coefficients it stores, as a serving engine would, not with the simulated H100's
    (which would ask about three times as many). A rule's table as exported carries: it is
    re-priced for the H100."""
    import json

    from envs.scenario import Scenario
    from policies.specs import make_policy
    from tests.conftest import cli

    path = tmp_path / "a100.json"
    assert cli("eval", "export", "--rule", "time-budget", "--hardware", "a100-80g", "--out", str(path),
               "--num-requests", "60").returncode == 0
    sc = Scenario(num_requests=60)
    carried = make_policy(f"table:{path}", sc)  # no mismatch to allow: it carries
    assert carried.table.action.cost == sc.simulator_cost()
    data = json.loads(path.read_text())
    del data["provenance"]["deployments"]
    path.write_text(json.dumps(data))
    policy = make_policy(f"table:{path}", sc, allow_table_mismatch=True)
    h100 = sc.simulator().cost
    asked = []

    def spy(state):
        b = policy(state)
        if state.running_decodes:
            values = policy.values(state)
            asked.append((b, policy.table.action.budget(values), policy.table.action.budget(values, cost=h100)))
        return b

    sc.simulator(sc.arrivals()).run(spy)
    assert asked and all(b == stored for b, stored, _ in asked)
    assert all(2 * b < h for b, _, h in asked if h < 16384)  # the H100 would ask about three times more
    # What the capacity report says the table does is what was evaluated.
    from eval.table_use import _trace_task

    assert _trace_task(sc, policy, sc.arrivals())[1] == [b for b, _, _ in asked]
