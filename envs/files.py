"""The project's files, read and written safely: every reader and writer goes through here.

Reading refuses, with one line naming the file (and the line where it can), before
anything is parsed into memory:

- anything but a regular file: a folder, a pipe that would block forever, a device such
  as ``/dev/zero`` that never ends;
- a file larger than the reader's limit (a profile is kilobytes, a trace gigabytes);
- text that is not UTF-8 (Latin-1, UTF-16, binary); a UTF-8 byte-order mark is skipped;
- JSON or TOML nested deeper than :data:`MAX_DEPTH`, integers of over 4,300 digits (the
  most Python converts), JSON's non-standard ``NaN`` and ``Infinity``;
- CSV lines longer than :data:`MAX_LINE_CHARS`, fields longer than the csv module's
  128 KB, NUL bytes.

Writing: :func:`check_output` refuses an output path that cannot be written before the
work that fills it starts (a folder where a file belongs, a path under a file, a
folder nothing can be created in), and :func:`write_atomic` / :func:`atomic_path` write
through a temporary file in the same folder renamed over the target, so a reader or a
crash never sees half a file. Standard library only.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
import tempfile
import tomllib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from envs.errors import ConfigError, show

MAX_DEPTH = 32
"""Deepest nesting of lists and tables a JSON or TOML input may have (profiles and tables
need 4)."""
MAX_LINE_CHARS = 1 << 20
"""Longest line of a CSV input, in characters."""
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _where(path) -> str:
    return show(str(path), 200)


def regular_file(what: str, path: str | Path, max_bytes: int) -> int:
    """The size of ``path``, a readable regular file of at most ``max_bytes`` bytes."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(f"{what}: cannot read {_where(path)} ({reason})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {_where(path)} is a folder, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: {_where(path)} is not a regular file (a pipe, socket or device)")
    if st.st_size > max_bytes:
        raise ConfigError(f"{what}: {_where(path)} holds {st.st_size:,} bytes, must be <= "
                          f"{max_bytes:,} for this kind of file")
    return st.st_size


def read_bytes(what: str, path: str | Path, max_bytes: int) -> bytes:
    regular_file(what, path, max_bytes)
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as err:
        raise ConfigError(f"{what}: cannot read {_where(path)} ({err.strerror})") from None


def decode(what: str, path: str | Path, raw: bytes, first_line: int = 1) -> str:
    """UTF-8 text (a leading byte-order mark dropped); anything else is refused with the line
    of the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        hint = " (UTF-16: it starts with a byte-order mark)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(f"{what}: {_where(path)} line {line}: not UTF-8 text (byte "
                          f"0x{raw[err.start]:02x}){hint}; save it as UTF-8") from None


def read_text(what: str, path: str | Path, max_bytes: int) -> str:
    return decode(what, path, read_bytes(what, path, max_bytes))


def _depth_error(what: str, path) -> ConfigError:
    return ConfigError(f"{what}: {_where(path)} nests lists or tables more than {MAX_DEPTH} deep")


def check_depth(what: str, path, data: object, limit: int = MAX_DEPTH) -> None:
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise _depth_error(what, path)
        stack.extend((c, depth + 1) for c in children)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _value_error(err: ValueError) -> str:
    """A parser's ValueError in one short phrase (Python's text on a huge integer is 150
    characters of advice)."""
    text = str(err)
    if "integer string conversion" in text:
        return f"an integer of over {sys.get_int_max_str_digits():,} digits"
    return show(text, 120)


def parse_json(what: str, path, text: str) -> object:
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{what}: {_where(path)} line {err.lineno}: not valid JSON ({err.msg})") from None
    except RecursionError:
        raise _depth_error(what, path) from None
    except ValueError as err:  # NaN/Infinity, or an integer of over 4,300 digits
        raise ConfigError(f"{what}: {_where(path)}: not valid JSON ({_value_error(err)})") from None
    check_depth(what, path, data)
    return data


def load_json(what: str, path: str | Path, max_bytes: int = MIB) -> object:
    return parse_json(what, path, read_text(what, path, max_bytes))


def parse_toml(what: str, path, text: str) -> dict:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{what}: {_where(path)}: not valid TOML ({show(str(err), 120)})") from None
    except RecursionError:
        raise _depth_error(what, path) from None
    except ValueError as err:  # an integer of over 4,300 digits
        raise ConfigError(f"{what}: {_where(path)}: not valid TOML ({_value_error(err)})") from None
    check_depth(what, path, data)
    return data


def load_toml(what: str, path: str | Path, max_bytes: int = MIB) -> dict:
    return parse_toml(what, path, read_text(what, path, max_bytes))


def _lines(what: str, path, fh) -> Iterator[str]:
    """Decoded lines of a binary file, each checked for length and encoding on its own, so
    an error names the right line."""
    number = 0
    while True:
        raw = fh.readline(MAX_LINE_CHARS + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_CHARS:
            raise ConfigError(f"{what}: {_where(path)} line {number}: longer than "
                              f"{MAX_LINE_CHARS:,} characters")
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        yield decode(what, path, raw, number)


def csv_rows(what: str, path: str | Path, max_bytes: int, skip_lines: int = 0
             ) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of every row of a CSV file, after ``skip_lines`` lines that are
    not CSV (a comment line); blank rows are skipped."""
    regular_file(what, path, max_bytes)
    try:
        fh = open(path, "rb")
    except OSError as err:
        raise ConfigError(f"{what}: cannot read {_where(path)} ({err.strerror})") from None
    with fh:
        lines = _lines(what, path, fh)
        for _ in range(skip_lines):
            next(lines, None)
        reader = csv.reader(lines)
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                raise ConfigError(f"{what}: {_where(path)} line {reader.line_num + skip_lines}: "
                                  f"not valid CSV ({err})") from None
            if row and any(c.strip() for c in row):
                yield reader.line_num + skip_lines, row


def first_line(what: str, path: str | Path, max_bytes: int) -> str:
    """The first line of a text file, decoded (for files that open with a comment line)."""
    regular_file(what, path, max_bytes)
    try:
        with open(path, "rb") as fh:
            return next(_lines(what, path, fh), "")
    except OSError as err:
        raise ConfigError(f"{what}: cannot read {_where(path)} ({err.strerror})") from None


# --- writing ---------------------------------------------------------------------------

def check_output(what: str, path: str | Path, kind: str = "file") -> Path:
    """Refuse, before any work, an output ``path`` (a ``file`` or a ``folder``) that cannot
    be written: empty, a folder where a file belongs or a file where a folder belongs, under
    something that is not a folder, or in a folder where nothing can be created (probed by
    creating and removing a file there, which also catches read-only file systems)."""
    text = str(path)
    if not text.strip() or "\0" in text:
        raise ConfigError(f"{what}: got {show(text)}, must be a path to a {kind}")
    p = Path(text)
    if kind == "file" and (p.is_dir() or text.endswith(os.sep)):
        raise ConfigError(f"{what}: {_where(p)} is a folder, expected a file path")
    if kind == "folder" and p.exists() and not p.is_dir():
        raise ConfigError(f"{what}: {_where(p)} is a file, expected a folder")
    if kind == "file" and (p.is_symlink() or (p.exists() and not p.is_file())):
        # Written atomically, by renaming a new file over it: a device, a pipe or a link
        # would be replaced by a plain file, not written through.
        raise ConfigError(f"{what}: {_where(p)} is not a plain file (a link, device or pipe); "
                          "give the path of a plain file")
    base = p if kind == "folder" else p.parent
    while not base.exists() and base != base.parent:
        if base.is_symlink():  # a dangling link or a loop: nothing can be created through it
            raise ConfigError(f"{what}: {_where(base)} is a broken symbolic link")
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{what}: cannot write {_where(p)}: {_where(base)} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".probe-")
    except OSError as err:
        raise ConfigError(f"{what}: cannot write {_where(p)}: nothing can be created in "
                          f"{_where(base)} ({err.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_distinct(**paths: str | Path | None) -> None:
    """Refuse two outputs (or an output and an input it would overwrite) that are one file."""
    seen: dict[str, str] = {}
    for name, path in paths.items():
        if path is None or not str(path):
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise ConfigError(f"{name}: got {_where(path)}, the same file as --{seen[key].replace('_', '-')}; "
                              "give each its own path")
        seen[key] = name


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to ``path`` (with its suffix, for writers that infer the format
    from it) that replaces ``path`` when the block finishes, and is removed if it fails."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs are meant to be shared
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


def write_json_atomic(path: Path, data) -> None:
    """``data`` as indented JSON, written atomically (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2, default=str))
