"""The probe and simulate command lines: DESIGN.md's worked example, JSON output, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


from tests.conftest import cli


def probe_json(*args):
    out = cli("envs.probe", *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_probe_reproduces_the_worked_example_unchunked():
    r = probe_json("--hardware", "h100-sxm-datasheet", "--model", "llama-3-8b", "--running", "32",
                   "--context-tokens", "2304", "--prompt-tokens", "8192", "--budget", "16384")
    assert r["passes"] == 1
    assert r["ttft_ms"] == pytest.approx(208, rel=0.05)
    assert r["baseline_pass_ms"] == pytest.approx(9.8, rel=0.05)
    assert r["free_ride_formula_tokens"] == pytest.approx(444, rel=0.05)
    assert r["pass_ms"] == [pytest.approx(r["ttft_ms"])]
    assert r["worst_gap_ms"] == pytest.approx(217, rel=0.05)  # "from 9.8 ms to about 217 ms"
    assert r["tokens_delivered"] == 32
    assert isinstance(r["free_ride_tokens"], int) and r["free_ride_tokens"] < r["free_ride_formula_tokens"]


def test_probe_chunking_trades_ttft_for_gaps():
    big = probe_json("--budget", "16384")
    mid = probe_json("--budget", "2048")
    small = probe_json("--budget", "256")
    # 2,048 - 32 decodes = 2,016 prompt tokens a pass: 5 passes for 8,192 tokens.
    assert mid["passes"] == 5 and len(mid["pass_ms"]) == 5
    assert small["passes"] == -(-8192 // (256 - 32))
    assert big["worst_gap_ms"] > mid["worst_gap_ms"] > small["worst_gap_ms"]
    assert big["ttft_ms"] < mid["ttft_ms"] < small["ttft_ms"]
    assert small["worst_gap_ms"] < 1.1 * small["baseline_pass_ms"]  # chunks inside the free ride
    assert mid["tokens_delivered"] == 32 * 5
    # Late chunks pay more attention over their longer prefix.
    assert mid["pass_ms"][3] > mid["pass_ms"][0]


def test_probe_human_output_explains():
    out = cli("envs.probe", "--budget", "16384")
    assert out.returncode == 0
    assert "Unchunked" in out.stdout and "free ride" in out.stdout


def test_simulate_json_keys():
    out = cli("envs.simulate", "--trace", "azure_conv_2023", "--max-requests", "300", "--budget",
              "2048", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for key in ("requests_finished", "passes", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                "itl_max_s", "throughput_tok_s", "preemptions", "wall_s", "goodput"):
        assert key in r
    assert r["requests_finished"] == 300


def test_simulate_summary_only_gives_the_same_figures():
    args = ["--trace", "azure_conv_2023", "--max-requests", "500", "--budget", "1024", "--json"]
    full = json.loads(cli("envs.simulate", *args).stdout)
    flat = json.loads(cli("envs.simulate", *args, "--summary-only").stdout)
    assert flat.keys() == full.keys()
    for k in ("requests_finished", "passes", "output_tokens", "goodput", "preemptions", "itl_max_s"):
        assert flat[k] == full[k]
    for k in ("ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s"):
        assert flat[k] == pytest.approx(full[k], rel=5e-4)


def test_simulate_synthetic_flags():
    out = cli("envs.simulate", "--rate", "3", "--num-requests", "100", "--arrival", "onoff",
              "--prompt", "fixed:1000", "--output", "fixed:10", "--budget", "512", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output_tokens"] == 1000


@pytest.mark.parametrize("module, args, message", [
    ("envs.probe", ["--hardware", "tpu9"], "hardware: unknown preset 'tpu9'; known:"),
    ("envs.probe", ["--hardware", "h100sxm"], "hardware: unknown preset 'h100sxm'; did you mean h100-sxm? known:"),
    ("envs.probe", ["--model", "lama-3-8b"], "model: unknown preset 'lama-3-8b'; did you mean llama-3-8b? known:"),
    ("train.py", ["--workload", "mooncak"], "workload: unknown name 'mooncak'; did you mean mooncake? known:"),
    ("envs.probe", ["--running", "300"], "running: got 300, must be < max_num_seqs"),
    ("envs.probe", ["--budget", "64"], "budget: got 64, must be an integer >= max_num_seqs"),
    ("envs.probe", ["--prompt-tokens", "0"], "prompt_tokens: got 0"),
    ("envs.probe", ["--prompt-tokens", "900000"], "prompt_tokens+output_tokens of request 0: got"),
    ("envs.simulate", ["--trace", "nope.csv"], "trace: cannot read 'nope.csv'"),
    ("envs.simulate", ["--rate", "-2"], "rate: got -2.0, must be a finite number > 0"),
    ("envs.simulate", ["--prompt", "fixed:abc"], "prompt: got 'fixed:abc'"),
    ("envs.simulate", ["--model", "qwen2.5-32b", "--hardware", "l40s"], "weights need"),
    ("envs.simulate", ["--slo-itl-s", "0"], "slo_itl_s: got 0.0"),
    # An SLO in milliseconds where seconds are meant: refused, with the unit named.
    ("envs.simulate", ["--slo-itl-s", "100"],
     "slo_itl_s: got 100.0, must be at most 10 seconds; targets are in seconds (100 ms is 0.1)"),
    ("envs.simulate", ["--slo-ttft-s", "2000"], "slo_ttft_s: got 2000.0, must be at most 600 seconds"),
    ("policies.table", ["check", "tables/h100-sxm__llama-3-8b.json", "--slo-itl-s", "100"],
     "--slo-itl-s: got 100.0, must be at most 10 seconds"),
])
def test_bad_input_is_one_line_and_exit_2(module, args, message):
    out = cli(module, *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_bad_trace_row_names_the_line(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,10,5\n0.5,10,5\n")
    out = cli("envs.simulate", "--trace", str(p))
    assert out.returncode == 2
    assert "line 4: arrival_s" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("cmd", [["envs.probe"], ["envs.simulate"], ["envs.calibrate"], ["train.py"],
                                 ["eval", "compare"], ["eval", "capacity"], ["eval", "suite"],
                                 ["eval", "export"]])
def test_every_command_line_has_help(cmd):
    out = cli(*cmd, "--help")
    assert out.returncode == 0, out.stderr[-1500:]
    assert "usage:" in out.stdout and "--" in out.stdout


@pytest.mark.parametrize("module", ["envs.probe", "envs.simulate"])
def test_command_runs_as_a_module(module):
    """One real subprocess per simulator command: ``python -m`` works end to end."""
    out = subprocess.run([sys.executable, "-m", module, "--json", "--budget", "2048"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["passes"] > 0


def test_argparse_errors_are_one_line():
    out = cli("envs.probe", "--budget", "x")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "budget: got 'x', must be an integer" in out.stderr


@pytest.mark.parametrize("module, args, message", [
    ("eval", ["suite", "--seed", "3"], "unrecognized arguments: --seed 3; did you mean --seeds?"),
    ("envs.simulate", ["--budg", "512"], "unrecognized arguments: --budg 512; did you mean --budget?"),
    ("envs.simulate", ["--zzz"], "unrecognized arguments: --zzz (see"),
    ("policies.table", ["check", "t.json", "--slo-i", "1"],
     "--slo-i 1; did you mean --slo-itl-s? (see python -m policies.table check --help)"),
    ("train.py", ["--load", "1"], "did you mean --load-low or --load-high?"),
])
def test_flags_are_taken_whole_never_abbreviated(module, args, message):
    """An abbreviation is refused, with the nearest flag named: `suite --seed 3` ran 3
    streams as `--seeds 3` when argparse completed it."""
    out = cli(module, *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize("budget, ttft_s, worst_s", [(16384, 3.1, 3.1), (1024, 3.5, 0.5), (256, 4.6, 0.2)])
def test_probe_reproduces_the_measured_laptop_trade_table(budget, ttft_s, worst_s):
    # DESIGN.md: M5 Max, 8B Q4, an 8,000-token prompt among three streaming users.
    r = probe_json("--hardware", "m5-max", "--model", "llama-3-8b-q4", "--running", "3",
                   "--context-tokens", "1000", "--prompt-tokens", "8000", "--budget", str(budget))
    assert r["ttft_ms"] / 1e3 == pytest.approx(ttft_s, rel=0.05)
    assert r["worst_gap_ms"] / 1e3 == pytest.approx(worst_s, abs=0.05)


def test_sigterm_and_a_second_ctrl_c_end_a_command_in_one_line():
    """A command stopped by SIGTERM says "terminated" and exits 143 (Ray's driver prints a
    native stack dump for it otherwise); after a first Ctrl-C, a second one during the
    cleanup (Ray's shutdown sleeps in an atexit hook) ends the process at once, without
    the "Exception ignored in atexit callback" traceback."""
    import signal
    import time

    script = textwrap.dedent("""
        import atexit, sys, time
        from envs.errors import run_cli
        atexit.register(lambda: time.sleep(5))  # a slow cleanup, as ray.shutdown's
        def main(argv):
            print("ready", flush=True)
            time.sleep(30)
            return 0
        run_cli(main)
    """)
    for signals, code, line in (([signal.SIGTERM], 143, "terminated"),
                                ([signal.SIGINT, signal.SIGINT], 130, "interrupted")):
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.3)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == code and err.strip() == line, err
        if len(signals) > 1:  # the second Ctrl-C cut the 5 s cleanup short
            assert time.monotonic() - start < 4


def test_a_signal_that_ray_wraps_in_a_system_error_still_ends_in_one_line(capsys, monkeypatch):
    """SIGTERM or Ctrl-C raised inside Ray's native wait comes out as a SystemError caused
    by it (a 51-minute export ended in a stack dump): one line and 143 or 130; any other
    SystemError is not swallowed."""
    import envs.errors as errors

    monkeypatch.setattr(errors, "exit_on_the_next_signal", lambda: None)

    def wrapped(stop):
        def main(argv):
            try:
                raise stop
            except BaseException as err:
                raise SystemError("returned a result with an exception set") from err
        return main

    assert errors.cli_main(wrapped(errors.Terminated()), []) == 143
    assert capsys.readouterr().err.strip() == "terminated"
    assert errors.cli_main(wrapped(KeyboardInterrupt()), []) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    with pytest.raises(SystemError):
        errors.cli_main(wrapped(ValueError("x")), [])


def test_a_second_ctrl_c_after_a_command_stopped_itself_ends_the_cleanup():
    """train.py catches the first Ctrl-C itself (it saves a checkpoint) and returns 130; a
    second one during the slow cleanup after it exits at once too, with no traceback."""
    import signal
    import time

    script = textwrap.dedent("""
        import atexit, sys, time
        from envs.errors import run_cli
        atexit.register(lambda: time.sleep(5))  # a slow cleanup, as ray.shutdown's
        def main(argv):
            print("ready", flush=True)
            try:
                time.sleep(30)
            except KeyboardInterrupt:
                print("stopped; checkpoint saved", file=sys.stderr)
                return 130
            return 0
        run_cli(main)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # into the try block
    start = time.monotonic()
    for _ in range(2):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and err.strip() == "stopped; checkpoint saved", err
    assert time.monotonic() - start < 4
