"""The engine's step record (policies.step_record): rows the calibration reads back, a
file appended to across restarts, a path refused before serving, a bounded record."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.calibrate.steps import read_steps
from policies import step_record
from policies.step_record import HEADER, StepRecordError, StepRecorder, check_record_path, step_row


def test_a_row_is_the_decodes_contexts_and_the_chunks_with_their_prefixes():
    shape = [(1, 100, True), (1, 37, True), (64, 0, False), (16, 128, False)]
    assert step_row(shape, 0.0123) == "100;37,64@0;16@128,0.0123\n"
    assert step_row([(1, 9, True)], 0.5) == "9,,0.5\n"
    assert step_row([(512, 0, False)], 2.0) == ",512@0,2\n"
    assert step_row([], 1.0) is None


shapes = st.lists(st.one_of(
    st.tuples(st.just(1), st.integers(1, 100_000), st.just(True)),
    st.tuples(st.integers(1, 8192), st.integers(0, 100_000), st.just(False))), min_size=1, max_size=20)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(shapes, st.floats(1e-4, 10.0)), min_size=6, max_size=30))
def test_the_calibration_reads_back_every_step_recorded(tmp_path_factory, steps):
    path = tmp_path_factory.mktemp("rec") / "steps.csv"
    rec = StepRecorder(str(path))
    for shape, seconds in steps:
        rec.add(shape, seconds)
    rec.flush()
    back = read_steps(str(path))
    assert len(back) == len(steps)
    for (ctx, chunks, sec), (shape, seconds) in zip(back, steps):
        assert ctx == [before for _, before, decode in shape if decode]
        assert chunks == [(tokens, before) for tokens, before, decode in shape if not decode]
        assert sec == pytest.approx(seconds, rel=1e-5)


def test_a_restarted_engine_appends_to_its_record(tmp_path):
    path = tmp_path / "steps.csv"
    for seconds in (0.01, 0.02):
        rec = StepRecorder(str(path))
        rec.add([(1, 10, True)], seconds)
        rec.flush()
    lines = path.read_text().splitlines()
    assert lines == [HEADER, "10,,0.01", "10,,0.02"]


def test_a_row_a_killed_engine_left_half_written_is_cut_before_appending(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text(HEADER + "\n10,,0.01\n11;12,64@0,0.0")  # killed mid-row
    rec = StepRecorder(str(path))
    rec.add([(1, 13, True)], 0.02)
    rec.flush()
    assert path.read_text().splitlines() == [HEADER, "10,,0.01", "13,,0.02"]


def test_rows_reach_the_file_in_batches_and_at_most_a_batch_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(step_record, "FLUSH_EVERY", 4)
    path = tmp_path / "steps.csv"
    rec = StepRecorder(str(path))
    for i in range(7):
        rec.add([(1, i + 1, True)], 0.01)
    assert len(path.read_text().splitlines()) == 1 + 4  # the header and one batch
    rec.flush()
    assert len(path.read_text().splitlines()) == 1 + 7


def test_recording_stops_at_its_bound(tmp_path):
    path = tmp_path / "steps.csv"
    rec = StepRecorder(str(path), max_steps=7)
    for i in range(12):
        rec.add([(1, i + 1, True)], 0.01)
    rec.flush()
    assert rec.recorded == 7 and not rec.active
    assert [ctx for ctx, _, _ in read_steps(str(path))] == [[i + 1] for i in range(7)]


def test_steps_without_tokens_or_time_are_not_recorded(tmp_path):
    path = tmp_path / "steps.csv"
    rec = StepRecorder(str(path))
    rec.add([], 0.01)
    rec.add([(1, 5, True)], 0.0)
    rec.flush()
    assert path.read_text() == HEADER + "\n"


def test_a_write_error_stops_recording_and_never_raises(tmp_path, caplog):
    folder = tmp_path / "gone"
    folder.mkdir()
    rec = StepRecorder(str(folder / "steps.csv"))
    (folder / "steps.csv").unlink()
    folder.rmdir()
    rec.add([(1, 5, True)], 0.01)
    with caplog.at_level("WARNING", logger="vllm.chunkpilot"):
        rec.flush()
    assert not rec.active
    assert "cannot write the step record" in caplog.text
    rec.add([(1, 5, True)], 0.01)  # and stays off quietly
    rec.flush()


@pytest.mark.parametrize("case, words", [
    ("folder", "a folder"), ("missing", "its folder must exist"), ("other", "not a step record")])
def test_a_path_that_cannot_take_the_record_is_refused_before_serving(tmp_path, case, words):
    path = {"folder": tmp_path, "missing": tmp_path / "no" / "steps.csv",
            "other": tmp_path / "notes.csv"}[case]
    if case == "other":
        path.write_text("request_id,arrival_s\n1,0.5\n")
    with pytest.raises(StepRecordError, match=words) as err:
        check_record_path(str(path), "CHUNKPILOT_RECORD_STEPS")
    assert str(err.value).startswith("CHUNKPILOT_RECORD_STEPS: got")
    if case == "other":
        assert path.read_text() == "request_id,arrival_s\n1,0.5\n"  # untouched


def test_the_setting_is_checked_with_the_other_variables(tmp_path, monkeypatch):
    from policies.table import TableError
    from policies.vllm_startup import RECORD_STEPS_ENV, Settings

    monkeypatch.setenv(RECORD_STEPS_ENV, str(tmp_path))
    with pytest.raises(TableError, match="CHUNKPILOT_RECORD_STEPS: got .* a folder"):
        Settings.from_env("t.json")
    monkeypatch.setenv(RECORD_STEPS_ENV, str(tmp_path / "steps.csv"))
    assert Settings.from_env("t.json").record_steps == str(tmp_path / "steps.csv")
    monkeypatch.delenv(RECORD_STEPS_ENV)
    assert Settings.from_env("t.json").record_steps is None
