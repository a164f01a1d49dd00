"""Malformed input to every command and file format: exit 2 and one line naming the field
(or the file), no traceback, no hang (tests/fuzz_cases.py lists the cases)."""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest

from tests.conftest import cli
from tests.fuzz_cases import ROOT, Case, cases

CASES = cases()
TIME_LIMIT_S = 10


@contextmanager
def time_limit(seconds: int):
    """Fail a case that runs longer than ``seconds`` instead of hanging the suite."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_corpus_is_large_and_covers_every_command():
    assert len(CASES) >= 400
    commands = {c.command for c in CASES}
    assert commands == {"envs.probe", "envs.simulate", "envs.calibrate", "eval", "policies.table", "train.py"}
    eval_subcommands = {c.argv[0] for c in CASES if c.command == "eval" and c.argv}
    assert {"compare", "capacity", "suite", "export"} <= eval_subcommands
    flags = {a for c in CASES for a in c.argv if a.startswith("--")}
    assert {"--steps", "--vidur", "--held-out", "--trace", "--hardware", "--model", "--out", "--csv"} <= flags


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_gets_one_line_and_exit_2(case: Case, tmp_path):
    argv = case.materialize(tmp_path)
    with time_limit(TIME_LIMIT_S):
        out = cli(case.command, *argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:], out.stdout[-500:])
    assert "Traceback" not in out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert case.named_in(lines[0], str(tmp_path)), (case.expect, lines[0])


@pytest.mark.parametrize("argv", [["envs.simulate", "--rate", "5e-324"],
                                  ["policies.table", "check", "/dev/zero"]])
def test_malformed_input_as_a_real_process(argv):
    """The same contract end to end, outside pytest's process."""
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_an_expected_field_must_stand_as_a_name_in_the_error():
    tp = Case("envs.calibrate", (), "tp")
    assert tp.named_in("error: tp: got 'abc', must be an integer", "/t")
    assert not tp.named_in("error: output: got 'abc', must be an integer", "/t")
    assert not tp.named_in("error: tp_degree: got 'abc'", "/t")
    slo = Case("eval", (), "slo_ttft_s")
    assert slo.named_in("error: --slo-ttft-s: got inf, must be a number > 0", "/t")
    assert not slo.named_in("error: slo ttft_s: got inf", "/t")
    file = Case("policies.table", (), "{tmp}/t4.json: fractions: ")
    assert file.named_in("error: /t/t4.json: fractions: must list 56 cells", "/t")
    assert not file.named_in("error: /t/t4.json: not valid JSON", "/t")
