"""Reading and writing files safely (envs/files.py) and the range checks (envs/errors.py)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from envs.errors import MAX_TOKENS, ConfigError, integer, number, show
from envs.files import (MAX_DEPTH, atomic_path, check_distinct, check_output, csv_rows, load_json,
                        load_toml, read_text, write_atomic)


def test_numbers_refuse_bools_nan_inf_and_huge_ints():
    assert number("x", 3, 0, 10) == 3.0
    assert number("x", np.float32(0.5), 0, 1) == 0.5
    for bad in (True, float("nan"), float("inf"), 10**400, "3", None, -1):
        with pytest.raises(ConfigError, match=r"^x: got .*, must be a finite number >= 0 and <= 10$"):
            number("x", bad, 0, 10)
    assert integer("n", np.int64(7), 1) == 7
    for bad in (False, 1.0, 2**63, -1, "5"):
        with pytest.raises(ConfigError, match="^n: got .*, must be an integer >= 0 and <= 9223372036854775807"):
            integer("n", bad)


def test_shown_values_stay_one_short_line():
    assert show(10**400) == "an integer of about 401 digits"
    assert show(2**64) == "18446744073709551616"
    assert len(show("x" * 200_000)) <= 60
    with pytest.raises(ConfigError) as err:
        integer("prompt", 10**5000, 1, MAX_TOKENS)  # str() of it would raise ValueError
    assert "about 5001 digits" in str(err.value)


def test_text_must_be_utf8_and_the_error_names_the_line(tmp_path):
    p = tmp_path / "p.toml"
    p.write_bytes(b'a = 1\nb = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"line 2: not UTF-8 text \(byte 0xe9\)"):
        read_text("profile", p, 1000)
    p.write_bytes("a = 1".encode("utf-16"))
    with pytest.raises(ConfigError, match="UTF-16"):
        read_text("profile", p, 1000)
    p.write_bytes(b"\xef\xbb\xbfa = 1\n")  # a byte-order mark is dropped
    assert load_toml("profile", p) == {"a": 1}


def test_only_regular_files_of_bounded_size_are_read(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    with pytest.raises(ConfigError, match="not a regular file"):
        load_json("table", fifo)
    with pytest.raises(ConfigError, match="is a folder"):
        load_json("table", tmp_path)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_text("trace", "/dev/zero", 1000)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(ConfigError, match="holds 2,000 bytes, must be <= 1,000"):
        load_json("table", big, 1000)


def test_json_and_toml_nesting_numbers_and_constants(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    with pytest.raises(ConfigError, match=f"more than {MAX_DEPTH} deep"):
        load_json("table", p)
    p.write_text("[" * 100_000 + "]" * 100_000)  # deeper than the parser's recursion
    with pytest.raises(ConfigError, match="deep"):
        load_json("table", p)
    p.write_text('{"a": NaN}')
    with pytest.raises(ConfigError, match="NaN is not a JSON number"):
        load_json("table", p)
    p.write_text('{"a": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_json("table", p)
    t = tmp_path / "x.toml"
    t.write_text("a = " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="deep"):
        load_toml("profile", t)


def test_csv_rows_name_their_lines_and_refuse_huge_fields(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("a,b\n1,2\n\n3,4\n")
    assert list(csv_rows("trace", p, 10**6)) == [(1, ["a", "b"]), (2, ["1", "2"]), (4, ["3", "4"])]
    p.write_text("a,b\n1,2\n3," + "9" * 200_000 + "\n")
    with pytest.raises(ConfigError, match="line 3: not valid CSV"):
        list(csv_rows("trace", p, 10**7))
    p.write_bytes(b"a,b\n1,2\n3,\xff\n")
    with pytest.raises(ConfigError, match="line 3: not UTF-8"):
        list(csv_rows("trace", p, 10**6))


@pytest.mark.parametrize("make, path, kind, message", [
    (lambda d: (d / "f").write_text("x"), "f/out.json", "file", "is not a folder"),
    (lambda d: (d / "sub").mkdir(), "sub", "file", "is a folder, expected a file"),
    (lambda d: (d / "f").write_text("x"), "f", "folder", "is a file, expected a folder"),
    (lambda d: None, "", "file", "must be a path"),
    (lambda d: (d / "loop").symlink_to(d / "loop"), "loop/x.json", "file", "broken symbolic link"),
    # Written by renaming a new file over it: a link or a pipe would be replaced, not written.
    (lambda d: ((d / "t.json").write_text("{}"), (d / "link.json").symlink_to(d / "t.json")),
     "link.json", "file", "is not a plain file"),
    (lambda d: os.mkfifo(d / "pipe"), "pipe", "file", "is not a plain file"),
])
def test_output_paths_are_refused_before_any_work(tmp_path, make, path, kind, message):
    make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        check_output("out", str(tmp_path / path) if path else "", kind)


def test_a_device_is_not_an_output_file():
    with pytest.raises(ConfigError, match="'/dev/null' is not a plain file"):
        check_output("out", "/dev/null")


def test_output_in_a_folder_nothing_can_be_created_in():
    with pytest.raises(ConfigError, match="nothing can be created in '/proc'"):
        check_output("out", "/proc/report.json")


def test_a_new_nested_output_is_accepted_without_creating_anything(tmp_path):
    assert check_output("out", tmp_path / "a/b/c.json") == tmp_path / "a/b/c.json"
    assert os.listdir(tmp_path) == []


def test_two_outputs_that_are_one_file(tmp_path):
    check_distinct(out=tmp_path / "a.json", csv=tmp_path / "a.csv", plot=None)
    with pytest.raises(ConfigError, match="csv: got .*, the same file as --out"):
        check_distinct(out=tmp_path / "a.json", csv=str(tmp_path / "x/../a.json"))


def test_atomic_writes_replace_whole_files_and_leave_nothing_behind(tmp_path):
    target = tmp_path / "deep/p.toml"
    write_atomic(target, "a = 1\n")
    assert target.read_text() == "a = 1\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash while writing")
    assert target.read_text() == "a = 1\n"  # the old file, untouched
    assert sorted(os.listdir(target.parent)) == ["p.toml"]  # no temporary left
