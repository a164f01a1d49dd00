"""The README as a new user reads it: a guide that points to its reference
(docs/reference.md), and every command and path the two name exists (each command's
``--help`` runs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
NAMED = README + "\n" + REFERENCE
"""The guide and its reference: what their commands and paths name must exist."""

GUIDE_LINES = 150
"""The guide (what it is, the set-up, the serving engineer's path, what the tables
achieve) ends within this many lines, where the reference sections begin."""

WRITTEN = ("runs/", "reports/", "tables/mine.json", "tables/rule.json", "my_trace.csv")
"""Paths the README's own commands write or the user brings."""


def commands() -> list[list[str]]:
    """Every ``python ...`` command line of the README's and its reference's bash blocks,
    continuations joined, as argv after ``python``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", NAMED, re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            for part in line.split("&&"):
                part = part.split("#")[0].strip()
                words = shlex.split(part) if part else []
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value before the command
                if words[:1] == ["python"]:
                    out.append(words[1:])
    return out


def test_the_guide_comes_before_the_reference():
    lines = README.splitlines()
    reference = next(i for i, line in enumerate(lines, 1) if line.startswith("## Reference"))
    assert reference <= GUIDE_LINES and len(lines) <= GUIDE_LINES + 10
    assert "[docs/reference.md](docs/reference.md)" in "\n".join(lines[reference:])
    # The first lines are exactly the two commands for a fresh machine.
    assert lines[3:5] == [
        'pip install torch==2.13.0 && pip install -e . && python train.py',
        'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q']


SUBCOMMANDED = {"eval", "policies.table"}


def help_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """(command, argv for --help) of a README command line, or None for pytest."""
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        if module == "pytest":
            return None
        sub = [rest[0]] if module in SUBCOMMANDED and rest and not rest[0].startswith("-") else []
        if sub == ["export"] and "--rule" in rest:  # a rule's export has flags of its own
            sub += rest[rest.index("--rule"):rest.index("--rule") + 2]
        return module, sub + ["--help"]
    return argv[0], ["--help"]


@pytest.mark.parametrize("argv", commands(), ids=lambda a: " ".join(a)[:60])
def test_every_command_the_readme_names_runs(argv):
    found = help_argv(argv)
    if found is None:
        return
    command, args = found
    if command.endswith(".py") and command != "train.py":  # a benchmark script
        assert (ROOT / command).is_file(), command
        return
    if command == "agents.presets":
        from agents.presets import main
        with pytest.raises(SystemExit) as stop:
            main(args)
        assert stop.value.code == 0
        return
    done = cli(command, *args)
    assert done.returncode == 0, (argv, done.stderr)
    assert "usage:" in done.stdout
    # Every flag the README gives is one the command takes.
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", done.stdout), (argv, flag)


def test_the_readme_finds_commands_in_every_part():
    named = {" ".join(a[:2]) if a[0] == "-m" else a[0] for a in commands()}
    assert {"train.py", "-m eval", "-m policies.table", "-m envs.simulate", "-m envs.probe",
            "-m agents.presets"} <= named


def test_every_path_the_readme_names_exists():
    paths = set(re.findall(r"`((?:envs|policies|eval|agents|tests|benchmarks|docs|tables|\.ci)/[\w./-]*)`",
                           NAMED))
    paths |= set(re.findall(r"\]\(((?:docs|tables)/[\w./-]+)\)", README))
    assert len(paths) > 15
    missing = [p for p in sorted(paths) if not p.startswith(WRITTEN) and not (ROOT / p).exists()]
    assert not missing, missing
