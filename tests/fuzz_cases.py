"""Malformed inputs for every command line and every file format the project reads.

Each :class:`Case` runs one command (a key of ``tests.conftest.COMMANDS``) with argv in
which ``{tmp}`` stands for a fresh folder holding the case's files; every case must end
with exit code 2 and one line on stderr that names ``expect`` (the field or the file),
without a traceback, within seconds. ``tests/test_fuzz.py`` runs them in-process;
``benchmarks/fuzz.py`` runs them as real subprocesses, adds random mutations, and
reports timings.

Cases change one thing at a time in an input that is otherwise valid and cheap, so that
an input wrongly accepted runs quickly to exit 0 and fails the check, rather than hangs.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIFO = object()
"""A file entry that is a named pipe (reading it would block forever)."""
FOLDER = object()
"""A file entry that is an empty folder."""
LOOP = object()
"""A file entry that is a symbolic link to itself."""


@dataclass(frozen=True)
class Case:
    command: str
    argv: tuple[str, ...]
    expect: str
    """A piece of the one-line error: the field, flag or file it must name."""
    files: tuple[tuple[str, object], ...] = field(default=())
    """(name, bytes | FIFO | FOLDER | LOOP) written into the case's folder first."""

    def named_in(self, line: str, tmp: str) -> bool:
        """Whether the error ``line`` names what the case expects. A field or flag name
        must stand as a name there (``tp`` in ``tp: got ...``, not inside ``output``);
        anything else (a file and what is wrong in it) must appear as written."""
        expect = self.expect.replace("{tmp}", tmp)
        if re.fullmatch(r"[a-z][a-z0-9_]*", expect):  # as a field, a flag or a quoted word
            flag = "--" + expect.replace("_", "-")
            return re.search(rf"((?<![\w.-]){expect}|{flag})(?=[:\s='),]|$)", line) is not None
        return expect in line

    @property
    def id(self) -> str:
        text = " ".join((self.command,) + self.argv)
        return text if len(text) <= 90 else text[:80] + f"...#{zlib.crc32(text.encode()):08x}"

    def materialize(self, folder: Path) -> list[str]:
        """Write the case's files into ``folder``; the argv with ``{tmp}`` filled in."""
        for name, content in self.files:
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if content is FIFO:
                os.mkfifo(path)
            elif content is FOLDER:
                path.mkdir()
            elif content is LOOP:
                path.symlink_to(path)
            else:
                path.write_bytes(content)
        return [a.replace("{tmp}", str(folder)) for a in self.argv]


# --- values ------------------------------------------------------------------------------

JUNK = ["abc", "", "1,5", "--"]
INT_JUNK = JUNK + ["1.5", "1e3", "nan", "inf", "0x10"]
INT_HUGE = ["9223372036854775808", "-9223372036854775809", "1" + "0" * 30, "9" * 401]
FLOAT_JUNK = JUNK + ["nan", "inf", "-inf", "1e400", "-1e400", "0x1p3"]
TOKENS_BAD = INT_JUNK + INT_HUGE + ["0", "-1", "2147483648", "9223372036854775807"]
SPECS_BAD = [
    "", "fixed", "fixed:", "fixed:0", "fixed:-5", "fixed:1.5", "fixed:abc", "fixed:1:2",
    "fixed:9223372036854775807", "fixed:9223372036854775800", "fixed:2147483648", "fixed:" + "9" * 401,
    "uniform:1", "uniform:10:5", "uniform:0:5", "uniform:1:10000000000000000000", "uniform:a:b",
    "uniform:1:2:3", "lognormal:128", "lognormal:128:inf", "lognormal:128:nan", "lognormal:0:1",
    "lognormal:inf:1", "lognormal:128:-1", "lognormal:128:0.8:0", "lognormal:128:0.8:1e9",
    "lognormal:1e400:1", "lognormal:128:1000", "lognormal:5000000000:1",
    "mix:", "mix:0.5", "mix:inf*fixed:5", "mix:nan*fixed:5", "mix:-1*fixed:5", "mix:0*fixed:5",
    "mix:1*", "mix:1*bogus:5", "mix:1e400*fixed:5", "mix:" + "1*mix:" * 300 + "fixed:5",
    "mix:" + "+".join(["1*fixed:5"] * 10000), "empirical:", "empirical:nope.csv",
    "empirical:azure_conv_2023:bogus_col", "empirical:{tmp}", "gaussian:5", "short-long:1",
]
POLICIES_BAD = [
    "", ",", "static", "static:0", "static:-1", "static:abc", "static:1e19",
    "static:10000000000000000000", "static:2147483648", "static:100", "static:2048:1",
    "vllm-default:gpu", "queue-depth:0", "queue-depth:x", "queue-depth:99999999999999999999",
    "no-decode-boost:1", "sarathi-slo:3", "free-ride:8192:256", "free-ride:0:5", "time-budget:0",
    "time-budget:nan", "time-budget:3", "time-budget:1:2", "time-budget-kv:inf", "time-budget-slack:0",
    "time-budget-slack:inf", "time-budget-slack:1e400", "time-budget-slack:x", "reference",
    "reference:0", "reference:2048:inf", "reference:2048:-1", "reference:2048:4:8", "model:",
    "model:{tmp}/norun", "table:", "table:{tmp}/nope.json", "table:{tmp}", "table-flat:",
    "table-flat:{tmp}/nope.json", "table-flat:0:auto", "table-flat:inf:auto", "table-flat:2:",
    "static:2048,static:2048", "bogus", "static:2048,bogus",
]


# --- files -------------------------------------------------------------------------------

def _binary() -> bytes:
    return bytes(range(256)) * 8


HW_TOML = ('[hardware]\nname = "fz"\nhbm_bytes_per_s = 3.35e12\npeak_flops_per_s = 9.89e14\n'
           'memory_bytes = 8.0e10\n')
MODEL_TOML = ('[model]\nname = "fzm"\nlayers = 32\nhidden_size = 4096\nheads = 32\nkv_heads = 8\n'
              'head_dim = 128\nparams = 8.0e9\n')


def _toml_with(base: str, line: str) -> bytes:
    key = line.split("=")[0].strip()
    kept = [ln for ln in base.splitlines() if ln.split("=")[0].strip() != key]
    return ("\n".join(kept) + "\n" + line + "\n").encode()


def hardware_files() -> list[tuple[str, object, str]]:
    """(file name, content, what the refusal says after ``hardware: ``) of malformed
    hardware profiles."""
    def at(name: str, says: str) -> str:
        return f"'{{tmp}}/{name}'{says}"

    out: list[tuple[str, object, str]] = [
        ("bin.toml", _binary(), at("bin.toml", " line 2: not UTF-8 text")),
        ("latin1.toml", HW_TOML.replace('"fz"', '"f\xe9"').encode("latin-1"), at("latin1.toml", " line 2: not UTF-8 text")),
        ("utf16.toml", HW_TOML.encode("utf-16"), at("utf16.toml", " line 1: not UTF-8 text")),
        ("empty.toml", b"", "missing field(s) hbm_bytes_per_s, memory_bytes, peak_flops_per_s in '{tmp}/empty.toml'"),
        ("broken.toml", b"[hardware\nname=", at("broken.toml", ": not valid TOML")),
        ("list.json", b"[1, 2]", at("list.json", " must hold a table of fields")),
        ("deep.json", b"[" * 100000 + b"]" * 100000, at("deep.json", " nests lists or tables more than 32 deep")),
        ("deep.toml", b"a = " + b"[" * 3000 + b"]" * 3000 + b"\n", at("deep.toml", " nests lists or tables more than 32 deep")),
        ("nan.json", b'{"name": "x", "hbm_bytes_per_s": NaN, "peak_flops_per_s": 1e14, "memory_bytes": 1e10}',
         at("nan.json", ": not valid JSON ('NaN")),
        ("bigint.json", b'{"name": "x", "hbm_bytes_per_s": ' + b"9" * 5000 + b', "peak_flops_per_s": 1e14, '
                        b'"memory_bytes": 1e10}', at("bigint.json", ": not valid JSON (an integer of over")),
        ("bigint.toml", _toml_with(HW_TOML, "hbm_bytes_per_s = " + "9" * 5000),
         at("bigint.toml", ": not valid TOML (an integer of over")),
        ("huge.toml", b"#" * (2 << 20), at("huge.toml", " holds 2,097,152 bytes, must be <= 1,048,576")),
        ("section.toml", b"hardware = 5\n", "[hardware] in '{tmp}/section.toml' must be a table"),
        ("yaml.yaml", HW_TOML.encode(), "unknown preset "),  # the path itself is shortened
        ("dir.toml", FOLDER, at("dir.toml", " is a folder")), ("fifo.toml", FIFO, at("fifo.toml", " is not a regular file")),
        ("loop.toml", LOOP, "cannot read '{tmp}/loop.toml' (Too many levels of symbolic links)"),
    ]
    lines = ["hbm_bytes_per_s = " + "1" * 401, "bandwidth_fraction = true", "hbm_bytes_per_s = inf",
             "hbm_bytes_per_s = nan", "hbm_bytes_per_s = -1.0", "hbm_bytes_per_s = 0", "hbm_bytes_per_s = 1e400",
             'hbm_bytes_per_s = "fast"', "bogus_field = 1", "flops_fraction = 1.5", "overlap = 2.0",
             "per_pass_overhead_s = -1.0", "per_pass_overhead_s = 1e300", 'name = ""', "name = 5",
             'name = "a\\nb"', "memory_bytes = 1e300", "memory_bytes = true",
             "peak_flops_per_s = 1e-300", "attention_bandwidth_ratio = 0", "elementwise_bytes_per_s = -5.0",
             "allreduce_latency_s = inf", "hbm_bytes_per_s = [1, 2]"]
    for i, line in enumerate(lines):
        name, field = f"hw{i}.toml", line.split(" = ")[0]
        says = (f"unknown field(s) '{field}' in '{{tmp}}/{name}'" if field == "bogus_field"
                else at(name, f": hardware.{field}: got "))
        out.append((name, _toml_with(HW_TOML, line), says))
    out.append(("missing.toml", b'[hardware]\nname = "x"\nhbm_bytes_per_s = 1e12\n',
                "missing field(s) memory_bytes, peak_flops_per_s in '{tmp}/missing.toml'"))
    return out


def model_files() -> list[tuple[str, object]]:
    lines = ["layers = 32.5", "layers = true", "heads = 0", "kv_heads = 3", "tensor_parallel = 0",
             "params = inf", "params = -1.0", "layers = 99999999999", "bytes_per_weight = 0",
             "head_dim = 1000000000000000000000000000000", "bytes_per_kv_element = 1e-300",
             "intermediate_size = -1", "params = 1e30", 'layers = "32"']
    return [(f"m{i}.toml", _toml_with(MODEL_TOML, line)) for i, line in enumerate(lines)] + [
        ("mbin.json", _binary()), ("mdeep.json", b"{\"a\": " * 50000 + b"1" + b"}" * 50000)]


TRACE_HEAD = "arrival_s,prompt_tokens,output_tokens\n"
TRACE_ROWS = "".join(f"{i * 0.5},{100 + i},{10 + i}\n" for i in range(20))


def trace_files() -> list[tuple[str, object]]:
    def t(rows: str) -> bytes:
        return (TRACE_HEAD + TRACE_ROWS + rows).encode()

    out: list[tuple[str, object]] = [
        ("bin.csv", _binary()), ("latin1.csv", (TRACE_HEAD.replace("arrival_s", "arriv\xe9e")
                                                + TRACE_ROWS).encode("latin-1")),
        ("latin1row.csv", t("11,100,10\n") + "12,\xe9,10\n".encode("latin-1")),
        ("utf16.csv", (TRACE_HEAD + TRACE_ROWS).encode("utf-16")), ("empty.csv", b""),
        ("header.csv", TRACE_HEAD.encode()), ("wrong.csv", b"time,prompt,output\n0,1,1\n"),
        ("nul.csv", t("11,1\x0000,10\n")), ("short.csv", t("11,100\n")),
        ("field.csv", t("11,100," + "9" * 200_000 + "\n")), ("line.csv", t("11,100,10" + "," * 1_100_000 + "\n")),
        ("quote.csv", t('11,"100,10\n' + "12,100,10\n" * 20000)), ("cr.csv", (TRACE_HEAD + TRACE_ROWS).replace("\n", "\r").encode()),
        ("dir.csv", FOLDER), ("fifo.csv", FIFO), ("loop.csv", LOOP),
    ]
    rows = ["11,abc,10", "11,100,abc", "abc,100,10", "nan,100,10", "inf,100,10", "-1,100,10", "1e400,100,10",
            "1,100,10", "11,0,10", "11,-1,10", "11,1.5,10", "11,9223372036854775807,10",
            "11,9223372036854775808,10", "11," + "1" * 31 + ",10", "11,2147483648,10", "11,1e3,10",
            "11,100,0", "11,100,9223372036854775800", "11,100," + "9" * 401]
    out += [(f"row{i}.csv", t(r + "\n")) for i, r in enumerate(rows)]
    return out


STEPS_HEAD = "decode_contexts,chunks,seconds\n"
STEPS_ROWS = "".join(f"{';'.join([str(64 + i)] * (i % 4 + 1))},{f'{32 * (i + 1)}@{16 * i}' if i % 2 else ''},"
                     f"{0.01 + 0.001 * i}\n" for i in range(1, 19))


def steps_files() -> list[tuple[str, object]]:
    def s(rows: str) -> bytes:
        return (STEPS_HEAD + STEPS_ROWS + rows).encode()

    out: list[tuple[str, object]] = [
        ("bin.csv", _binary()), ("utf16.csv", (STEPS_HEAD + STEPS_ROWS).encode("utf-16")),
        ("latin1.csv", s("64,,0.0\xe9\n".replace("\xe9", "5")) + "64,,\xe9\n".encode("latin-1")),
        ("empty.csv", b""), ("nocol.csv", b"decode_contexts,seconds\n64,0.1\n"), ("few.csv", (STEPS_HEAD + "64,,0.1\n" * 3).encode()),
        ("nul.csv", s("64,\x00,0.1\n")), ("field.csv", s(";".join(["64"] * 50_000) + ",,0.1\n")),
        ("dir.csv", FOLDER), ("fifo.csv", FIFO),
    ]
    rows = ["64,,inf", "64,,nan", "64,,-1", "64,,0", "64,,abc", "64,,1e400", "-5,,0.1", "9223372036854775808,,0.1",
            "x,,0.1", ",10@,0.1", ",@5,0.1", ",1@2@3,0.1", ",1000000000000000000000000000000@0,0.1", ",0@0,0.1",
            ",5@-1,0.1", ",2147483648@0,0.1", "64;;-1,,0.1", ",5@" + "9" * 401 + ",0.1"]
    out += [(f"s{i}.csv", s(r + "\n")) for i, r in enumerate(rows)]
    return out


VIDUR_OK = ROOT / "envs/data/vidur/h100__Llama-2-7b-hf.csv"


def vidur_files() -> list[tuple[str, object]]:
    text = VIDUR_OK.read_text()
    shape, rest = text.split("\n", 1)
    head, row, tail = rest.split("\n", 2)

    def with_row(new_row: str) -> bytes:
        return f"{shape}\n{head}\n{new_row}\n{tail}".encode()

    cols = head.split(",")

    def set_col(col: str, value: str) -> bytes:
        cells = row.split(",")
        cells[cols.index(col)] = value
        return with_row(",".join(cells))

    out: list[tuple[str, object]] = [
        ("h100__bin.csv", _binary()), ("h100__utf16.csv", text.encode("utf-16")),
        ("h100__noshape.csv", rest.encode()), ("h100__rows.csv", f"{shape}\n{head}\n".encode()),
        ("h100__nocol.csv", f"{shape}\nnum_tokens,tp\n1,1\n".encode()), ("h100__nul.csv", with_row(row.replace(",", ",\x00", 3))),
        ("h100__field.csv", with_row(row.replace(",", "," + "1" * 200_000, 1))), ("h100__dir.csv", FOLDER),
        ("h100__fifo.csv", FIFO),
    ]
    shapes = [shape.replace("n_head=32", "n_head=0"), shape.replace("n_head=32", "n_head=x"),
              shape.replace("n_head=32", "n_head=" + "1" * 31), shape.replace("use_gated_mlp=True", "use_gated_mlp=maybe"),
              shape.replace("n_embd=4096", "n_embd=4100"), shape.replace("n_kv_head=32, ", ""),
              shape.replace("# ", "").replace("#", "")]
    out += [(f"h100__shape{i}.csv", f"{s}\n{rest}".encode()) for i, s in enumerate(shapes)]
    values = [("input_layernorm_ms", "fast"), ("input_layernorm_ms", "-1"), ("mlp_act_ms", "inf"),
              ("mlp_act_ms", "nan"), ("add_ms", "1e400"), ("num_tokens", "1.5"), ("num_tokens", "0"),
              ("tp", "0"), ("num_tokens", "1" + "0" * 30), ("tp", "9" * 401), ("tp", "9223372036854775808")]
    out += [(f"h100__v{i}.csv", set_col(c, v)) for i, (c, v) in enumerate(values)]
    out.append(("h100__zero.csv", with_row(",".join(v if cols[i] in ("num_tokens", "tp") else "0"
                                                     for i, v in enumerate(row.split(","))))))
    return out


TABLE_OK = ROOT / "tables/h100-sxm__llama-3-8b.json"


def table_files() -> list[tuple[str, object, str]]:
    """Broken variants of the shipped table (time fractions) and of its token twin: (file
    name, content, what the refusal must say after the file name: the field it names, or
    what is wrong with the file as a whole)."""
    good = json.loads(TABLE_OK.read_text())
    cells = len(good["fractions"])
    tokens = {k: v for k, v in good.items() if k not in ("fractions", "action")}
    tokens.update(action={"kind": "tokens"}, budgets=[2048] * cells, features=[
        {"name": n, "edges": f["edges"]}  # state quantities a token table reads as they are
        for n, f in zip(("running_decodes", "kv_usage", "waiting_requests", "oldest_wait_s"),
                        good["features"])])

    def edit(base, fn) -> bytes:
        data = json.loads(json.dumps(base))
        fn(data)
        return json.dumps(data).encode()

    def setter(*path_and_value, says: str | None = None):
        """An edit setting one field, and the field as the refusal names it
        (``features[0].edges``), unless ``says`` is given."""
        *path, value = path_and_value

        def fn(d):
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value
        named = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
        return fn, says or f"{named}: "

    out: list[tuple[str, object, str]] = [
        ("bin.json", _binary(), "line 2: not UTF-8 text"),
        ("utf16.json", TABLE_OK.read_text().encode("utf-16"), "line 1: not UTF-8 text"),
        ("latin1.json", TABLE_OK.read_text().replace('"kind"', '"k\xefnd"').encode("latin-1"),
         "line 3: not UTF-8 text"),
        ("empty.json", b"", "line 1: not valid JSON"), ("list.json", b"[]", "not a JSON object"),
        ("deep.json", b"[" * 200000 + b"]" * 200000, "nests lists or objects more than 32 deep"),
        ("nan.json", TABLE_OK.read_text().replace('"default_budget": ', '"default_budget": NaN, "x": ').encode(),
         "not valid JSON (NaN"),
        ("bigint.json", TABLE_OK.read_text().replace('"default_budget": ', '"default_budget": ' + "9" * 5000 + ', "x": ').encode(),
         "not valid JSON (an integer of over"),
        ("huge.json", b" " * (17 << 20) + b"{}", "holds 17,825,794 bytes"),
        ("dir.json", FOLDER, "cannot read: a folder"), ("fifo.json", FIFO, "cannot read: not a regular file"),
    ]
    not_json = "not valid JSON (Infinity"  # json.dumps writes 1e400 as Infinity
    token_edits = [
        setter("budgets", [10**30] * cells), setter("budgets", [True] * cells), setter("budgets", [-1] * cells),
        setter("budgets", [1.5] * cells), setter("budgets", [2048] * (cells - 1)), setter("budgets", [2**31] * cells),
    ]
    time_edits = [
        setter("fractions", [10**30] * cells), setter("fractions", [True] * cells),
        setter("fractions", [0] * cells), setter("fractions", ["x"] * cells),
        setter("fractions", [1.0] * (cells - 1)), setter("fractions", [17.0] * cells),
        setter("action", "cost", "token_s", -1.0), setter("action", "cost", "exposed", 2.0),
        setter("action", "cost", None), setter("action", "itl_s", 0), setter("action", "cap", 1.5),
        setter("default_budget", True), setter("default_budget", 10**30), setter("default_budget", 0),
        setter("default_budget", "x"), setter("features", []), setter("features", 5),
        setter("features", 0, "edges", [True]), setter("features", 0, "edges", ["x"]),
        setter("features", 0, "edges", [5.0, 1.0]), setter("features", 0, "edges", [1e400], says=not_json),
        setter("features", 0, "name", "gpu_temperature"),
        (lambda d: d["features"][1].update(name=d["features"][0]["name"]), "features: names must be distinct"),
        setter("visited", [1]), setter("kind", "other"), setter("schema_version", 1, says="schema_version 1 "),
        setter("schema_version", 3),
        setter("provenance", None), setter("provenance", "hardware", "memory_bytes", -1),
        setter("provenance", "hardware", "memory_bytes", 1e400, says=not_json),
        setter("provenance", "hardware", "memory_bytes", True),
        setter("provenance", "model", "layers", 3.5), setter("provenance", "model", "layers", 10**30),
        setter("provenance", "slo", "itl_s", 0), setter("action", {"kind": "magic"}, says="action.kind: "),
        setter("features", [{"name": "kv_usage", "edges": [0.1, 0.2]}] * 50, says="features: names must be distinct"),
    ]
    out += [(f"k{i}.json", edit(tokens, fn), says) for i, (fn, says) in enumerate(token_edits)]
    out += [(f"t{i}.json", edit(good, fn), says) for i, (fn, says) in enumerate(time_edits)]
    return out


# --- the cases ---------------------------------------------------------------------------

STEPS_OK_FILE = ("ok_steps.csv", (STEPS_HEAD + STEPS_ROWS).encode())
UNDER_FILE = ("afile", b"x")
OUT_FILE_BAD = [  # (value, files) for an output that must be a file
    ("{tmp}/afile/x.out", (UNDER_FILE,)), ("{tmp}/adir", (("adir", FOLDER),)),
    ("/proc/chunkpilot-fuzz.out", ()), ("", ()), ("/dev/null/x.out", ()), ("{tmp}/loop/x.out", (("loop", LOOP),)),
    ("{tmp}/adir/", ()), ("{tmp}/apipe", (("apipe", FIFO),)),
]
OUT_DIR_BAD = [  # for an output that must be a folder
    ("{tmp}/afile", (UNDER_FILE,)), ("{tmp}/afile/sub", (UNDER_FILE,)), ("/proc/chunkpilot-fuzz", ()), ("", ()),
    ("/dev/null", ()),
]


def _flag_cases(command: str, base: list[str], flag: str, values, expect: str) -> list[Case]:
    return [Case(command, tuple(base + [flag, v]), expect) for v in values]


def probe_cases() -> list[Case]:
    c = "envs.probe"
    out = []
    for flag, bad, expect in [
        ("--running", INT_JUNK + INT_HUGE + ["-1", "256", "300"], "running"),
        ("--context-tokens", TOKENS_BAD, "context_tokens"),
        ("--prompt-tokens", TOKENS_BAD, "prompt_tokens"),
        ("--budget", TOKENS_BAD + ["255"], "budget"),
        ("--max-num-seqs", TOKENS_BAD, "max_num_seqs"),
        ("--per-pass-overhead-s", FLOAT_JUNK + ["-1", "1e300"], "per_pass_overhead_s"),
        ("--hardware", ["", "tpu9", "x.toml", "h100-sxm.yaml"], "hardware"),
        ("--model", ["", "gpt-9", "{tmp}/none.json"], "model"),
    ]:
        out += _flag_cases(c, [], flag, bad, expect)
    out += [Case(c, ("--hardware", f"{{tmp}}/{name}"), f"hardware: {says}", ((name, content),))
            for name, content, says in hardware_files()]
    out += [Case(c, ("--model", f"{{tmp}}/{name}"), "model", ((name, content),)) for name, content in model_files()]
    out += [Case(c, ("--bogus",), "bogus"), Case(c, ("extra",), "extra"), Case(c, ("--budget",), "budget"),
            Case(c, ("--json=maybe",), "json"),
            Case(c, ("--prompt-tokens", "900000"), "prompt_tokens+output_tokens of request 0: got 900001")]
    return out


SCENARIO_FLAGS = [
    ("--per-pass-overhead-s", FLOAT_JUNK + ["-1", "1e300"], "per_pass_overhead_s"),
    ("--rate-scale", FLOAT_JUNK + ["0", "-1", "1e-300", "1e300"], "rate_scale"),
    ("--window-start-s", FLOAT_JUNK + ["-1"], "window_start_s"),
    ("--window-end-s", ["nan", "inf", "-1", "0", "abc"], "window_end_s"),
    ("--max-requests", INT_JUNK + INT_HUGE + ["0", "-1"], "max_requests"),
    ("--rate", FLOAT_JUNK + ["0", "-2", "5e-324", "1e300"], "rate"),
    ("--num-requests", INT_JUNK + INT_HUGE + ["0", "-1", "1000000000000"], "num_requests"),
    ("--arrival", ["uniform", "", "POISSON"], "arrival"),
    ("--burstiness", FLOAT_JUNK + ["0", "-1", "1e-300", "1e300"], "burstiness"),
    ("--on-s", FLOAT_JUNK + ["0", "-1", "1e300"], "on_s"),
    ("--off-s", FLOAT_JUNK + ["-1", "1e300"], "off_s"),
    ("--seed", INT_JUNK + INT_HUGE + ["-1"], "seed"),
    ("--max-num-seqs", TOKENS_BAD, "max_num_seqs"),
    ("--long-prefill-token-threshold", INT_JUNK + INT_HUGE + ["-1", "2147483648"], "long_prefill_token_threshold"),
    ("--gpu-memory-utilization", FLOAT_JUNK + ["0", "1.5", "-1"], "gpu_memory_utilization"),
    ("--num-kv-blocks", INT_JUNK + INT_HUGE + ["0", "-1", "3"], "num_kv_blocks"),
    ("--slo-ttft-s", FLOAT_JUNK + ["0", "-1"], "slo_ttft_s"),
    ("--slo-itl-s", FLOAT_JUNK + ["0", "-1"], "slo_itl_s"),
]


def simulate_cases() -> list[Case]:
    c, base = "envs.simulate", ["--num-requests", "20"]
    out = []
    for flag, bad, expect in SCENARIO_FLAGS:
        out += _flag_cases(c, base if flag != "--num-requests" else [], flag, bad, expect)
    out += _flag_cases(c, base, "--budget", TOKENS_BAD + ["255", "10000000000000000000"], "budget")
    out += _flag_cases(c, base, "--prompt", SPECS_BAD, "prompt")
    out += _flag_cases(c, base, "--output", SPECS_BAD[:24], "output")
    out += _flag_cases(c, base, "--trace", ["nope.csv", "/dev/zero", "/dev/null", "", "{tmp}"], "trace")
    out += [Case(c, ("--trace", f"{{tmp}}/{name}", "--num-requests", "20"), "trace", ((name, content),))
            for name, content in trace_files()]
    out += [Case(c, tuple(base + ["--prompt", f"empirical:{{tmp}}/{name}"]), "trace", ((name, content),))
            for name, content in trace_files()[:12]]
    out += [Case(c, tuple(base + ["--hardware", f"{{tmp}}/{name}"]), f"hardware: {says}", ((name, content),))
            for name, content, says in hardware_files()[:10]]
    out += [Case(c, ("--trace", "azure_conv_2023", "--window-start-s", "10", "--window-end-s", "5"), "window_end_s"),
            Case(c, ("--trace", "azure_conv_2023", "--window-start-s", "1e9"), "window"),
            Case(c, ("--trace", "azure_conv_2023", "--rate-scale", "1e-300"), "rate_scale"),
            Case(c, tuple(base + ["--model", "qwen2.5-32b", "--hardware", "l40s"]), "weights need"),
            Case(c, tuple(base + ["--prompt", "fixed:2000000"]), "KV cache"),
            Case(c, tuple(base + ["--bogus", "1"]), "bogus"), Case(c, tuple(base + ["--budget"]), "budget")]
    return out


def _steps_case(argv, expect, files=()) -> Case:
    return Case("envs.calibrate", ("--steps", "{tmp}/ok_steps.csv", "--model", "llama-3-8b",
                                   "--out", "{tmp}/out/p.toml") + tuple(argv), expect, (STEPS_OK_FILE,) + tuple(files))


def calibrate_cases() -> list[Case]:
    c = "envs.calibrate"
    out = []
    for name, content in steps_files():
        out.append(Case(c, ("--steps", f"{{tmp}}/{name}", "--out", "{tmp}/p.toml"), "steps", ((name, content),)))
    out += [Case(c, ("--steps", p, "--out", "{tmp}/p.toml"), "steps") for p in ("{tmp}/nope.csv", "/dev/zero", "")]
    for name, content in vidur_files():
        out.append(Case(c, ("--vidur", f"{{tmp}}/{name}", "--out", "{tmp}/v.toml"), "vidur", ((name, content),)))
    for name, content in vidur_files()[:6]:
        out.append(Case(c, ("--vidur", str(VIDUR_OK), "--held-out", f"{{tmp}}/{name}", "--out", "{tmp}/v.toml"),
                        "vidur", ((name, content),)))
    out += [Case(c, ("--vidur", "{tmp}/nope.csv", "--out", "{tmp}/v.toml"), "vidur"),
            Case(c, ("--held-out", str(VIDUR_OK)), "vidur"),
            Case(c, ("--vidur", str(VIDUR_OK), "--check"), "hardware"),
            Case(c, ("--check",), "check"),
            Case(c, ("--vidur", str(VIDUR_OK), "--hardware", "{tmp}/hw.toml", "--out", "{tmp}/v.toml"), "hardware",
                 (("hw.toml", _binary()),))]
    out += _flag_cases(c, ["--vidur", str(VIDUR_OK), "--out", "{tmp}/v.toml"], "--tp",
                       INT_JUNK + INT_HUGE + ["0", "-1", "7"], "tp")
    for value, files in OUT_FILE_BAD:
        out.append(_steps_case(["--out", value], "out", files))
        out.append(Case(c, ("--vidur", str(VIDUR_OK), "--out", value), "out", files))
        out.append(_steps_case(["--plot", value], "plot", files))
    out.append(_steps_case(["--csv", "{tmp}/out/p.toml"], "csv"))
    out.append(_steps_case(["--plot", "{tmp}/out/p.toml"], "plot"))
    out += [_steps_case(["--hardware", f"{{tmp}}/{name}"], f"hardware: {says}", ((name, content),))
            for name, content, says in hardware_files()[:12]]
    out += [_steps_case(["--name", v], "name") for v in ("", "x\ny", "n" * 1000, "\x1b[31m")]
    out += [_steps_case(["--form", v], "form") for v in ("bogus", "")]
    # Torch options are checked before torch is imported or anything is timed.
    for flag, bad, expect in [("--device", ["tpu", "", "cuda:0"], "device"),
                              ("--layers", INT_JUNK + INT_HUGE + ["0", "-1", "33"], "layers"),
                              ("--repeats", INT_JUNK + ["0", "-1", "100000"], "repeats"),
                              ("--scale", FLOAT_JUNK + ["0", "-1", "1e300"], "scale"),
                              ("--dtype", ["int8", ""], "dtype")]:
        out += _flag_cases(c, ["--out", "{tmp}/t.toml"], flag, bad, expect)
    out += [Case(c, ("--out", "{tmp}/t.toml", "--csv", "{tmp}/t.toml"), "csv")]
    return out


EVAL_BASE = {
    "compare": ["compare", "--workers", "1", "--seeds", "1", "--requests", "20", "--policies", "static:2048",
                "--out", "{tmp}/rep"],
    "capacity": ["capacity", "--workers", "1", "--seeds", "1", "--requests", "20", "--policies", "static:2048",
                 "--out", "{tmp}/cap"],
    "suite": ["suite", "--workers", "1", "--seeds", "1", "--requests", "20", "--policies", "static:2048",
              "--scenarios", "idle", "--no-capacity", "--out", "{tmp}/suite"],
}


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


def eval_cases() -> list[Case]:
    c = "eval"
    out = [Case(c, (), "command"), Case(c, ("bogus",), "command"), Case(c, ("--bogus",), "command")]
    for sub, base in EVAL_BASE.items():
        for flag, bad, expect in [("--seeds", INT_JUNK + ["0", "-1", "10000000000000000000", "100000"], "seeds"),
                                  ("--requests", INT_JUNK + ["0", "-1", "1" + "0" * 30], "requests"),
                                  ("--workers", ["0", "-1", "abc", "100000", "9" * 30], "workers"),
                                  ("--policies", POLICIES_BAD if sub == "compare" else POLICIES_BAD[::4], None)]:
            # A list that names no policy, or one twice, is refused as "policies"; a list
            # with a bad spec, by that "policy".
            out += [Case(c, tuple(_replace(base, flag, v)), expect or (
                "policies" if v in ("", ",", "static:2048,static:2048") else "policy")) for v in bad]
        bad_out = OUT_DIR_BAD
        out += [Case(c, tuple(_replace(base, "--out", v)), "out", files) for v, files in bad_out]
        out += [Case(c, tuple(base + ["--bogus"]), "bogus")]
    for flag, bad, expect in SCENARIO_FLAGS[::2]:
        out += _flag_cases(c, EVAL_BASE["compare"], flag, bad[::2], expect)
        out += _flag_cases(c, EVAL_BASE["capacity"], flag, bad[1::3], expect)
    out += [Case(c, tuple(EVAL_BASE["compare"] + ["--seed", "7"]), "seed"),
            Case(c, tuple(EVAL_BASE["capacity"] + ["--seed", "7"]), "seed")]
    out += [Case(c, tuple(EVAL_BASE["compare"] + ["--trace", f"{{tmp}}/{name}"]), "trace", ((name, content),))
            for name, content in trace_files()[::3]]
    out += [Case(c, tuple(_replace(EVAL_BASE["compare"], "--policies", f"table:{{tmp}}/{name}")),
                 f"{{tmp}}/{name}: {says}", ((name, content),)) for name, content, says in table_files()[::2]]
    out += [Case(c, tuple(_replace(EVAL_BASE["suite"], "--scenarios", v)), "scenarios") for v in ("", "bogus", "idle,bogus", ",")]
    exp = ["export", "{tmp}/run", "--out", "{tmp}/t.json"]
    run = (("run/config.json", b"{}"),)
    for flag, bad in [("--buckets", INT_JUNK + ["0", "-1", "100000", "9" * 30]),
                      ("--build-episodes", ["0", "-1", "abc", "100000000"]),
                      ("--held-episodes", ["0", "-1", "abc"]), ("--max-features", ["0", "7", "x"]),
                      ("--dagger-rounds", ["-1", "11", "x", "9" * 30]),
                      ("--fidelity-seeds", ["-1", "abc", "9" * 30]), ("--fidelity-requests", ["0", "-5", "nan"]),
                      ("--slo-ttft-s", ["0", "-1", "nan", "inf"]), ("--slo-itl-s", ["0", "1e9"])]:
        out += [Case(c, tuple(_replace(exp, flag, v)), flag[2:].replace("-", "_"), run) for v in bad]
    out += [Case(c, tuple(_replace(exp, "--out", v)), "out", run + files) for v, files in OUT_FILE_BAD]
    out += [Case(c, tuple(exp + ["--csv", v]), "csv", run + files) for v, files in OUT_FILE_BAD]
    out += [Case(c, tuple(exp + ["--csv", "{tmp}/t.json"]), "csv", run),
            Case(c, ("export",), "run_dir"), Case(c, ("export", "{tmp}/nope", "--out", "{tmp}/t.json"), "run_dir"),
            Case(c, ("export", "{tmp}/afile", "--out", "{tmp}/t.json"), "run_dir", (UNDER_FILE,)),
            Case(c, ("export", "{tmp}/empty", "--out", "{tmp}/t.json"), "run_dir", (("empty", FOLDER),)),
            Case(c, ("export", "{tmp}/run", "{tmp}/run2", "--out", "{tmp}/t.json"),
                 "unrecognized arguments: {tmp}/run2", run)]
    out += [Case(c, tuple(_replace(exp, "--rules", v)), "rules", run)
            for v in ("time-budget-kv", "static:2048", "time-budget-slack:99", "x:y:z")]
    out += [Case(c, tuple(exp + ["--refine-on", v]), "refine_on", run) for v in ("bogus", "final")]
    out += [Case(c, tuple(exp + ["--select-streams", v]), "select_streams", run)
            for v in ("0", "-1", "x", "101", "9" * 30)]
    out += [Case(c, tuple(exp + ["--refine-streams", "2", "--out", "{tmp}/run/refined_table.json"]),
                 "refined_table", run)]
    rule = ["export", "--rule", "time-budget", "--out", "{tmp}/t.json"]
    out += [Case(c, tuple(_replace(rule, "--rule", v)), "rule")
            for v in ("", "time-budget-kv", "queue-depth", "time-budget:0", "time-budget-deadline:nan")]
    out += [Case(c, tuple(_replace(rule, "--num-requests", v)), "num_requests") for v in ("0", "-3", "x")]
    out += [Case(c, tuple(_replace(exp, "--rules", v)), "rules", run) for v in ("", ",", "none,time-budget")]
    out += [Case(c, tuple(_replace(rule, "--out", v)), "out", files) for v, files in OUT_FILE_BAD[::2]]
    out += [Case(c, tuple(rule + ["--hardware", "nope"]), "hardware"), Case(c, tuple(rule + ["--bogus"]), "bogus")]
    return out


def table_cases() -> list[Case]:
    c = "policies.table"
    out = []
    for name, content, says in table_files():
        out.append(Case(c, ("check", f"{{tmp}}/{name}", "--hardware", "h100-sxm", "--model", "llama-3-8b"),
                        f"{{tmp}}/{name}: {says}", ((name, content),)))
    for name, content, says in table_files()[::3]:
        out.append(Case(c, ("show", f"{{tmp}}/{name}"), f"{{tmp}}/{name}: {says}", ((name, content),)))
    ok = str(TABLE_OK)
    out += [Case(c, ("check", ok, "--hardware", f"{{tmp}}/{name}"), f"hardware: {says}", ((name, content),))
            for name, content, says in hardware_files()[::2]]
    out += _flag_cases(c, ["check", ok], "--slo-ttft-s", FLOAT_JUNK + ["0", "-1"], "slo_ttft_s")
    out += _flag_cases(c, ["check", ok], "--slo-itl-s", ["nan", "inf", "0", "-1", "abc"], "slo_itl_s")
    out += [Case(c, (), "command"), Case(c, ("bogus",), "bogus"), Case(c, ("check",), "table"),
            Case(c, ("check", ok, "--bogus"), "bogus"), Case(c, ("check", "{tmp}/nope.json"), "nope.json"),
            Case(c, ("check", "/dev/zero"), "/dev/zero"), Case(c, ("check", ok, "--model", "gpt-9"), "model")]
    return out


def train_cases() -> list[Case]:
    """train.py: every numeric flag, the serving scenario's fields and the run directory,
    refused before anything is trained or measured."""
    c = "train.py"
    base = ["--run-dir", "{tmp}/run"]
    out = []
    for flag in ("--total-timesteps", "--n-envs", "--eval-every", "--eval-episodes", "--final-seeds",
                 "--final-requests", "--checkpoint-every", "--conditions", "--n-steps", "--seed"):
        out += _flag_cases(c, base, flag, INT_JUNK[::2] + INT_HUGE[::2] + ["-1"],
                           flag[2:].replace("-", "_"))
    for flag in ("--learning-rate", "--load-low", "--episode-s", "--gamma", "--decision-interval-s"):
        out += _flag_cases(c, base, flag, FLOAT_JUNK[::2] + ["-1"], flag[2:].replace("-", "_"))
    out += _flag_cases(c, base, "--net-arch", ["", "0", "64,0", "100000000", "a,b", "64," * 20],
                       "net_arch")
    out += _flag_cases(c, base, "--rate", ["0", "-3", "nan", "inf"], "rate")
    out += _flag_cases(c, base, "--workload", ["", "nope", "mixed"], "workload")
    out += _flag_cases(c, base, "--hardware", ["tpu9", "{tmp}/nope.toml"], "hardware")
    out += [Case(c, ("--load-low", "2", "--load-high", "1", *base), "load_high"),
            Case(c, ("--run-dir", "{tmp}/afile"), "run_dir", (UNDER_FILE,)),
            Case(c, ("--resume", "{tmp}/nothing"), "resume"),
            Case(c, ("--resume", "{tmp}/run"), "resume", (("run/config.json", b"{}"),)),
            Case(c, ("--resume", "{tmp}/run"), "resume", (("run/config.json", b"\xff\xfe"),))]
    return out


def cases() -> list[Case]:
    return (probe_cases() + simulate_cases() + calibrate_cases() + eval_cases() + table_cases()
            + train_cases())
