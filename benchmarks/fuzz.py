"""The long fuzz run: the corpus of tests/fuzz_cases.py, then random mutations of valid inputs.

    python benchmarks/fuzz.py [--mutations 3000] [--seed 0] [--subprocess 100]

1. Every corpus case (malformed by construction) in this process: exit 2, one line.
2. ``--mutations`` random mutations of valid files (hardware and model profiles, traces,
   steps CSVs, Vidur CSVs, tables) and of valid command lines: byte flips, insertions,
   truncations, extreme values in place of fields. A mutant may still be valid, so the
   contract is: exit 0, or exit 2 with one line (``error:`` or, for a table that fits other
   hardware, ``mismatch:``); never a traceback, never more than 10 s.
3. ``--subprocess N``: N corpus cases (spread over the corpus) as real ``python -m``
   processes, end to end.

Prints counts, the exit-2 one-line share, the slowest case, and every failure.
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import cli  # noqa: E402
from tests.fuzz_cases import (HW_TOML, MODEL_TOML, STEPS_HEAD, STEPS_ROWS, TABLE_OK, TRACE_HEAD,  # noqa: E402
                              TRACE_ROWS, VIDUR_OK, Case, cases)

LIMIT_S = 10
EXTREMES = ["nan", "inf", "-inf", "-1", "0", "1e400", "9" * 30, "9223372036854775808", "", "true",
            "abc", "1e-300", "0x10", "\x00", "\xe9", "-0", "1" * 401, "2147483648"]


class Expired(Exception):
    pass


def _expire(signum, frame):
    raise Expired()


def check(command: str, argv: list[str], malformed: bool) -> tuple[str | None, float]:
    """(what went wrong or None, seconds)."""
    signal.signal(signal.SIGALRM, _expire)
    signal.alarm(LIMIT_S)
    t0 = time.perf_counter()
    try:
        out = cli(command, *argv)
    except Expired:
        return f"hang: still running after {LIMIT_S} s", LIMIT_S
    except BaseException as err:  # a crash the CLI layer let through
        return f"crash: {type(err).__name__}: {str(err)[:200]}", time.perf_counter() - t0
    finally:
        signal.alarm(0)
    dt = time.perf_counter() - t0
    lines = out.stderr.strip().splitlines()
    if "Traceback" in out.stderr:
        return "traceback", dt
    if out.returncode == 0 and not malformed:
        return None, dt
    if out.returncode != 2:
        return f"exit {out.returncode}: {out.stderr[-300:]!r}", dt
    if len(lines) != 1 or not lines[0].startswith(("error: ", "mismatch: ")):
        return f"not one line: {out.stderr[-300:]!r}", dt
    return None, dt


def mutate_text(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(6)
    if kind == 0 and data:  # flip bytes
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 1:  # insert random bytes
        at = rng.randrange(len(data) + 1)
        return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + data[at:]
    if kind == 2:  # truncate
        return data[:rng.randrange(len(data) + 1)]
    if kind == 3:  # an extreme value in place of a number
        text = data.decode("utf-8", "replace")
        spots = [i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isdigit())]
        if spots:
            i = rng.choice(spots)
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] in ".e-+"):
                j += 1
            text = text[:i] + rng.choice(EXTREMES) + text[j:]
        return text.encode("utf-8", "surrogateescape")
    if kind == 4:  # repeat a line many times
        lines = data.split(b"\n")
        i = rng.randrange(len(lines))
        return b"\n".join(lines[:i] + [lines[i]] * rng.randint(2, 3000) + lines[i:])
    return data.replace(b",", rng.choice([b";", b",,", b"\t", b""]), rng.randint(1, 4))


def file_targets() -> list[tuple[str, bytes, str, list[str]]]:
    """(file name, valid content, command, argv with {f} for the file)."""
    steps = (STEPS_HEAD + STEPS_ROWS).encode()
    return [
        ("hw.toml", HW_TOML.encode(), "envs.probe", ["--hardware", "{f}"]),
        ("m.toml", MODEL_TOML.encode(), "envs.probe", ["--model", "{f}"]),
        ("t.csv", (TRACE_HEAD + TRACE_ROWS).encode(), "envs.simulate", ["--trace", "{f}", "--max-requests", "50"]),
        ("s.csv", steps, "envs.calibrate", ["--steps", "{f}", "--out", "{tmp}/p.toml"]),
        ("h100__v.csv", "\n".join(VIDUR_OK.read_text().splitlines()[:40]).encode(), "envs.calibrate",
         ["--vidur", "{f}", "--out", "{tmp}/v.toml"]),
        ("table.json", TABLE_OK.read_bytes(), "policies.table",
         ["check", "{f}", "--hardware", "h100-sxm", "--model", "llama-3-8b"]),
    ]


ARGV_BASES = [
    ("envs.probe", ["--running", "8", "--context-tokens", "1000", "--prompt-tokens", "4000", "--budget", "512"]),
    ("envs.simulate", ["--num-requests", "30", "--rate", "4", "--budget", "1024", "--prompt", "uniform:10:900",
                       "--output", "lognormal:50:0.5:200", "--seed", "3", "--burstiness", "0.5",
                       "--arrival", "gamma", "--max-num-seqs", "64"]),
    ("policies.table", ["check", str(TABLE_OK), "--slo-ttft-s", "2", "--slo-itl-s", "0.1"]),
]


def mutate_argv(rng: random.Random, argv: list[str]) -> list[str]:
    argv = list(argv)
    values = [i for i, a in enumerate(argv) if not a.startswith("--") and i and argv[i - 1].startswith("--")]
    kind = rng.randrange(4)
    if kind <= 1 and values:
        argv[rng.choice(values)] = rng.choice(EXTREMES)
    elif kind == 2 and values:  # a spec's number
        i = rng.choice(values)
        argv[i] = argv[i].rsplit(":", 1)[0] + ":" + rng.choice(EXTREMES) if ":" in argv[i] else rng.choice(EXTREMES)
    else:
        del argv[rng.randrange(len(argv))]
    return argv


def run_corpus(corpus: list[Case], report) -> None:
    for case in corpus:
        with tempfile.TemporaryDirectory() as tmp:
            argv = case.materialize(Path(tmp))
            problem, dt = check(case.command, argv, malformed=True)
        report(case.id, problem, dt, True)


def run_mutations(n: int, seed: int, report) -> None:
    rng = random.Random(seed)
    targets = file_targets()
    for k in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            if k % 3 == 2:
                command, base = rng.choice(ARGV_BASES)
                argv = mutate_argv(rng, base)
                label = f"{command} {' '.join(argv)}"
            else:
                name, data, command, base = rng.choice(targets)
                path = Path(tmp) / name
                path.write_bytes(mutate_text(rng, data))
                argv = [a.replace("{f}", str(path)).replace("{tmp}", tmp) for a in base]
                label = f"{command} mutant #{k} of {name}"
            problem, dt = check(command, argv, malformed=False)
        report(label, problem, dt, False)


def run_subprocesses(corpus: list[Case], n: int, report) -> None:
    modules = {"eval": "eval", "envs.probe": "envs.probe", "envs.simulate": "envs.simulate",
               "envs.calibrate": "envs.calibrate", "policies.table": "policies.table"}
    step = max(len(corpus) // max(n, 1), 1)
    for case in corpus[::step][:n]:
        if any(len(a) > 100_000 for a in case.argv):
            continue  # over the kernel's limit for one argument
        with tempfile.TemporaryDirectory() as tmp:
            argv = case.materialize(Path(tmp))
            t0 = time.perf_counter()
            try:
                out = subprocess.run([sys.executable, "-m", modules[case.command], *argv], cwd=ROOT,
                                     capture_output=True, text=True, timeout=LIMIT_S)
                lines = out.stderr.strip().splitlines()
                ok = out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr
                problem = None if ok else f"exit {out.returncode}: {out.stderr[-300:]!r}"
            except subprocess.TimeoutExpired:
                problem = f"hang: still running after {LIMIT_S} s"
        report("subprocess: " + case.id, problem, time.perf_counter() - t0, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--subprocess", type=int, default=0, help="corpus cases to run as real processes")
    args = ap.parse_args()
    stats = {"inputs": 0, "malformed": 0, "exit2": 0, "failures": [], "slowest": (0.0, "")}

    def report(label, problem, dt, malformed):
        stats["inputs"] += 1
        stats["malformed"] += malformed
        stats["exit2"] += malformed and problem is None
        if problem:
            stats["failures"].append(f"{label[:120]}: {problem}")
        stats["slowest"] = max(stats["slowest"], (dt, label[:120]))

    t0 = time.perf_counter()
    corpus = cases()
    run_corpus(corpus, report)
    corpus_s = time.perf_counter() - t0
    run_mutations(args.mutations, args.seed, report)
    mutation_s = time.perf_counter() - t0 - corpus_s
    run_subprocesses(corpus, args.subprocess, report)
    dt, label = stats["slowest"]
    print(f"inputs: {stats['inputs']:,} ({len(corpus):,} corpus cases in {corpus_s:.0f} s, "
          f"{args.mutations:,} mutations in {mutation_s:.0f} s, {args.subprocess} processes)")
    print(f"malformed inputs with exit 2 and one line: {stats['exit2']:,} of {stats['malformed']:,} "
          f"({stats['exit2'] / max(stats['malformed'], 1):.1%})")
    print(f"failures (tracebacks, hangs, other exits, several lines): {len(stats['failures'])}")
    print(f"slowest input: {dt:.2f} s ({label})")
    for f in stats["failures"][:50]:
        print("  " + f)
    sys.exit(1 if stats["failures"] else 0)


if __name__ == "__main__":
    main()
