"""The room beyond the best rule, recorded in a shipped table: the record read from an
``eval capacity`` report (eval/room.py), how ``policies.table show`` words it, and
``python -m agents.presets --room`` measuring it and writing it into the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envs.errors import ConfigError
from eval.room import room_record
from policies.table import BudgetTable

ROOT = Path(__file__).resolve().parents[1]
RULE = "time-budget-deadline-kv:16"
REF = f"rollout:10:{RULE}"


def report(rule, ref, table, spec="table:t.json") -> dict:
    """An ``eval capacity`` report's JSON with these per-stream capacities."""
    out = {}
    for name, per, kind in ((RULE, rule, "rule"), (REF, ref, "reference"), (spec, table, "table"),
                            ("time-budget-slack:7", [0.5 * x for x in rule], "rule")):
        out[name] = {"capacity_rps": sum(per) / len(per), "per_stream": per, "kind": kind}
    out["_hindsight_static"] = {"budget": 2048, "capacity": 1.0, "ci95": 0.1}
    return out


def test_the_record_pairs_the_reference_and_the_table_with_the_rule_stream_by_stream():
    """Hand-computed: on streams of 1, 2 and 4 req/s the reference serves 10% more on every
    one (a ratio, whatever the stream's scale: beats with no spread) and the table the
    same as the rule on two and 3% less on one."""
    rec = room_record(report([1.0, 2.0, 4.0], [1.1, 2.2, 4.4], [1.0, 2.0, 3.88]), "table:t.json",
                      ["-m", "eval", "capacity"])
    assert rec["rule"] == RULE and rec["reference"] == REF and rec["streams"] == 3
    ref, tab = rec["reference_vs_rule"], rec["table_vs_rule"]
    assert ref["kind"] == "beats" and ref["mean"] == pytest.approx(0.1) and ref["ci95"] == pytest.approx(0.0)
    assert ref["per_stream"] == pytest.approx([0.1, 0.1, 0.1])
    assert tab["mean"] == pytest.approx(-0.01) and tab["kind"] == "ties"
    assert rec["capacity_rps"] == pytest.approx({"rule": 7 / 3, "reference": 7.7 / 3, "table": 6.88 / 3})
    assert rec["command"] == "python -m eval capacity"


def test_a_report_without_the_reference_or_its_rule_is_refused_naming_what_it_lacks():
    full = report([1.0, 2.0], [1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no rollout reference"):
        room_record({k: v for k, v in full.items() if k != REF}, "table:t.json", [])
    with pytest.raises(ValueError, match=f"no {RULE}, the rule"):
        room_record({k: v for k, v in full.items() if k != RULE}, "table:t.json", [])
    with pytest.raises(ValueError, match="no table:other.json"):
        room_record(full, "table:other.json", [])
    full[REF]["per_stream"] = [1.0]
    with pytest.raises(ValueError, match="different streams"):
        room_record(full, "table:t.json", [])


def shipped(tmp_path, name="h100-sxm__llama-3-8b") -> Path:
    """A copy of a shipped table without the room its preset recorded."""
    path = tmp_path / f"{name}.json"
    table = BudgetTable.load(str(ROOT / "tables" / f"{name}.json"))
    table.provenance.pop("room", None)
    table.save(str(path))
    return path


def with_room(path: Path, rec: dict | None) -> BudgetTable:
    table = BudgetTable.load(str(path))
    table.provenance["room"] = rec
    table.save(str(path))
    return BudgetTable.load(str(path))


def test_a_rule_table_says_it_ships_as_a_rule_because_the_reference_finds_no_room(tmp_path):
    path = shipped(tmp_path)
    table = BudgetTable.load(str(path))
    assert table.room_text() is None and table.room_found() is None
    assert "rollout reference" not in table.origin()
    # No room: the reference ties the rule (+1.4% ± 4.3%, ahead on one stream of three).
    table = with_room(path, room_record(report([6.0, 7.0, 6.5], [6.2, 7.0, 6.55], [6.0, 7.0, 6.5]),
                                        "table:t.json", []))
    assert table.room_found() is False
    assert ("a rule, not a learned policy" in table.origin()
            and f"the rollout reference over {RULE} finds no room beyond it on this deployment: a "
            "learned table is unlikely to beat the rule here" in table.origin())
    assert table.room_text() == (
        f"room beyond the best rule, {RULE} (6.5 req/s on 3 streams of the serving scenario): the "
        "rollout reference, which sees the future, +1.4% ± 4.3% (ties); this table +0.0% ± 0.0% "
        "(ties): no room found beyond the interval")
    # Room: a rule table says no table built from the model took it.
    table = with_room(path, room_record(report([1.0, 2.0, 4.0], [1.1, 2.2, 4.4], [1.0, 2.0, 4.0]),
                                        "table:t.json", []))
    assert table.room_found() is True and "that no table built from the model took" in table.origin()
    assert table.room_text().endswith("(ties): the table takes none of it beyond its interval")
    show = subprocess.run([sys.executable, "-m", "policies.table", "show", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert show.returncode == 0 and show.stdout.splitlines()[-1] == table.room_text()


def test_a_learned_table_shows_the_share_of_the_room_it_takes(tmp_path):
    table = with_room(shipped(tmp_path, "l40s__llama-3-8b"), room_record(
        report([1.0, 2.0, 4.0], [1.1, 2.2, 4.4], [1.05, 2.1, 4.2]), "table:t.json", []))
    assert "rollout reference" not in table.origin()
    assert table.room_text().endswith("(beats): the table takes 50% of the room")
    # A table ahead of the reference takes all of it, not more.
    table = with_room(shipped(tmp_path, "l40s__llama-3-8b"), room_record(
        report([1.0, 2.0, 4.0], [1.1, 2.2, 4.4], [1.2, 2.4, 4.8]), "table:t.json", []))
    assert table.room_text().endswith("the table takes 100% of the room")


def test_a_record_where_the_rule_serves_nothing_stays_a_table_that_loads(tmp_path):
    """The rule serving nothing on every stream makes the reference's lead infinite: the
    record holds None there (JSON has no infinity), and the table still loads and shows."""
    rec = room_record(report([0.0, 0.0], [1.0, 2.0], [0.5, 1.0]), "table:t.json", [])
    assert rec["reference_vs_rule"]["mean"] is None and rec["reference_vs_rule"]["kind"] == "beats"
    table = with_room(shipped(tmp_path), rec)
    assert table.room_found() is True
    assert "(0 req/s on 2 streams" in table.room_text() or "no capacity" in table.room_text()
    assert table.room_text().endswith("the table takes none of it beyond its interval")


@pytest.mark.parametrize("rec", [{"rule": RULE}, "corrupt", {"reference_vs_rule": {"kind": "beats"}}])
def test_an_unreadable_room_record_is_said_so_and_show_still_works(tmp_path, rec):
    path = shipped(tmp_path)
    table = with_room(path, rec)
    assert table.room_text().startswith("room beyond the best rule: the record is unreadable")
    assert table.room_found() is None and "rollout reference" not in table.origin()
    show = subprocess.run([sys.executable, "-m", "policies.table", "show", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert show.returncode == 0 and "the record is unreadable" in show.stdout


def test_scenario_flags_spell_out_the_named_workload_and_take_the_tables_slo():
    from agents.presets import PRESETS, scenario_flags
    laptop = scenario_flags(PRESETS[("m5-max", "llama-3-8b-q4")], {"ttft_s": 10.0, "itl_s": 0.2})
    assert dict(zip(laptop[::2], laptop[1::2])) == {
        "--rate": "0.05", "--arrival": "poisson", "--prompt": "mix:0.7*uniform:32:512+0.3*uniform:4000:8000",
        "--output": "lognormal:200:0.5:800", "--slo-ttft-s": "10", "--slo-itl-s": "0.2"}
    l40s = dict(zip(*[iter(scenario_flags(PRESETS[("l40s", "llama-3-8b")], {"ttft_s": 2, "itl_s": 0.1}))] * 2))
    assert l40s["--rate"] == "1.5" and l40s["--arrival"] == "gamma" and "--teacher" not in l40s
    trace = scenario_flags(["--workload", "mooncake", "--slo-ttft-s", "30"], {"ttft_s": 30, "itl_s": 0.1})
    assert trace == ["--trace", "mooncake_synthetic", "--slo-ttft-s", "30", "--slo-itl-s", "0.1"]


def test_presets_room_measures_each_table_and_records_it(monkeypatch, tmp_path):
    """`--room` runs `eval capacity` on the preset's serving scenario with the export's rules,
    the table and the reference, and writes the record into the table; every other table
    is left as it was."""
    from agents import presets
    tables = tmp_path / "tables"
    tables.mkdir()
    path = shipped(tables)
    before = shipped(tables, "h200__llama-3-8b").read_bytes()
    calls = []

    def run_step(argv):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        spec = f"table:{path}"
        (out / "capacity.json").write_text(json.dumps(report([6.0, 7.0], [6.1, 7.2], [6.0, 7.0], spec)))
        return 0

    monkeypatch.setattr(presets, "run_step", run_step)
    flags = ["--only", "h100-sxm__llama-3-8b", "--tables", str(tables), "--room",
             "--room-out", str(tmp_path / "room"), "--room-seeds", "2", "--workers", "2"]
    assert presets.main(flags) == 0
    argv = calls[0]
    assert argv[:3] == ["-m", "eval", "capacity"] and argv[-2:] == ["--workers", "2"]
    policies = argv[argv.index("--policies") + 1].split(",")
    # The export's rules, the table's own first (the first of tied rules is the best), then the table.
    assert policies[0] == RULE and policies[-1] == f"table:{path}" and len(policies) == len(set(policies))
    assert "time-budget-slack:7" in policies and "--reference" in argv
    assert argv[argv.index("--rate") + 1] == "8.0" and argv[argv.index("--seeds") + 1] == "2"
    room = BudgetTable.load(str(path)).provenance["room"]
    assert room["reference_vs_rule"]["mean"] == pytest.approx((0.1 / 6 + 0.2 / 7) / 2)
    assert "--workers" not in room["command"] and room["command"].startswith("python -m eval capacity")
    assert (tables / "h200__llama-3-8b.json").read_bytes() == before
    # A failed measurement writes nothing.
    monkeypatch.setattr(presets, "run_step", lambda argv: 3)
    shipped(tables)
    assert presets.main(flags[:-2] + ["--room-out", str(tmp_path / "room2")]) == 3
    assert "room" not in BudgetTable.load(str(path)).provenance


def test_presets_room_refuses_what_it_cannot_measure_before_any_measurement(monkeypatch, tmp_path):
    from agents import presets
    calls = []
    monkeypatch.setattr(presets, "run_step", lambda argv: calls.append(argv) or 0)
    both = "h100-sxm__llama-3-8b,h200__llama-3-8b"
    shipped(tmp_path)
    with pytest.raises(ConfigError, match="^room: got 'h200__llama-3-8b', needs its table"):
        presets.main(["--only", both, "--tables", str(tmp_path), "--room"])
    (tmp_path / "h200__llama-3-8b.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^room: .*h200__llama-3-8b.json"):
        presets.main(["--only", both, "--tables", str(tmp_path), "--room"])
    shipped(tmp_path).rename(tmp_path / "h200__llama-3-8b.json")  # the H100's table under the H200's name
    shipped(tmp_path)
    with pytest.raises(ConfigError, match="needs its own table; .* is h100-sxm__llama-3-8b's"):
        presets.main(["--only", both, "--tables", str(tmp_path), "--room"])
    assert calls == []  # the first preset's table was fine: nothing was measured
    for extra in (["--export-only"], ["--search-iterations", "3"], ["--total-timesteps", "5"]):
        with pytest.raises(ConfigError, match="given with --room"):
            presets.main(["--room", *extra])
    with pytest.raises(ConfigError, match="^room_out: given without --room"):
        presets.main(["--room-out", "x", "--export-only"])
    with pytest.raises(ConfigError, match="^room_seeds: "):
        presets.main(["--room", "--room-seeds", "1"])


def test_presets_room_says_in_one_line_where_its_report_cannot_be_read(monkeypatch, tmp_path, capsys):
    """A report without the reference (no time-budget rule measured) or none at all: exit 1,
    one line naming the preset and the report, the table untouched."""
    from agents import presets
    path = shipped(tmp_path)
    before = path.read_bytes()

    def run_step(argv):
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "capacity.json").write_text(json.dumps({k: v for k, v in report([1.0, 2.0], [1.0, 2.0], [1.0, 2.0], f"table:{path}").items() if k != REF}))
        return 0

    flags = ["--only", "h100-sxm__llama-3-8b", "--tables", str(tmp_path), "--room", "--room-out",
             str(tmp_path / "room")]
    monkeypatch.setattr(presets, "run_step", run_step)
    assert presets.main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: room: h100-sxm__llama-3-8b: the report has "
                                                   "no rollout reference") and "room" in err
    monkeypatch.setattr(presets, "run_step", lambda argv: 0)  # wrote nothing
    assert presets.main(flags[:-1] + [str(tmp_path / "none")]) == 1
    assert "capacity.json" in capsys.readouterr().err and path.read_bytes() == before
