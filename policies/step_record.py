"""An engine's steps, written down as it serves (standard library only, like the table
runtime): each step's shape and measured time, in the CSV that ``python -m envs.calibrate
--steps`` fits a deployment's profile to.

One row per step that carried tokens: ``decode_contexts`` (each decode's tokens before the
step, ';'-separated), ``chunks`` (each prefill chunk as ``SIZE@PREFIX``, ';'-separated)
and ``seconds`` (from the step's scheduling, or the previous step's output when it was
scheduled before that, to its output: what the table scheduler times).

The file is appended to, so an engine restarted with the same path adds to what it
recorded before (a row a killed engine left half-written is cut first); a file that is
not such a CSV is never written to. Rows are written in
whole lines, :data:`FLUSH_EVERY` at a time (and at exit), so a killed engine loses at most
that many steps and leaves a file the fit reads. Recording stops, with one log line, after
:data:`MAX_STEPS` steps (a fit needs hundreds; a day of serving would fill a disk) or on a
write error: serving never fails for it.
"""

from __future__ import annotations

import atexit
import logging
import os

COLUMNS = ("decode_contexts", "chunks", "seconds")
HEADER = ",".join(COLUMNS)
FLUSH_EVERY = 256
"""Steps buffered between writes: a few seconds of a loaded engine."""
MAX_STEPS = 200_000
"""Steps recorded at most per start: a few minutes to an hour of serving, tens of MB."""

logger = logging.getLogger("vllm.chunkpilot")


class StepRecordError(ValueError):
    """The path cannot take a step record (one line naming the variable and why)."""


def check_record_path(path: str, what: str) -> None:
    """Refuse, before serving, a path that cannot take the record: a folder, a missing or
    read-only folder, or an existing file that is not a step record."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise StepRecordError(f"{what}: got {path!r}, a folder; must be a file path (CSV)")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise StepRecordError(f"{what}: got {path!r}; its folder must exist and be writable")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise StepRecordError(f"{what}: got {path!r}, a file this process cannot write")
        with open(path, "rb") as f:
            head = f.read(len(HEADER) + 1)
        if head and head.rstrip(b"\r\n") != HEADER.encode():
            raise StepRecordError(f"{what}: got {path!r}, a file that is not a step record (its "
                                  f"first line is not {HEADER!r}); give a new path")


def step_row(shape, seconds: float) -> str | None:
    """One CSV line for a step: ``shape`` is its requests' (tokens, tokens before the step,
    whether it decodes); None for a step that carried no tokens."""
    if not shape:
        return None
    decodes = ";".join(str(before) for tokens, before, decode in shape if decode)
    chunks = ";".join(f"{tokens}@{before}" for tokens, before, decode in shape if not decode)
    return f"{decodes},{chunks},{seconds:.6g}\n"


class StepRecorder:
    """Appends step rows to ``path`` (see the module docstring)."""

    def __init__(self, path: str, max_steps: int = MAX_STEPS):
        self.path = path
        self.max_steps = max_steps
        self.recorded = 0
        self.active = True
        self._rows: list[str] = []
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            self._write(HEADER + "\n")
        else:
            self._drop_partial_row()
        atexit.register(self.flush)

    def _drop_partial_row(self) -> None:
        """An engine killed while writing leaves a last row without its newline: cut it, so
        that what is appended starts on a line of its own and the fit reads the file."""
        try:
            with open(self.path, "rb+") as f:
                size = f.seek(0, os.SEEK_END)
                tail_start = max(0, size - 65536)
                f.seek(tail_start)
                tail = f.read()
                if tail.endswith(b"\n"):
                    return
                cut = tail.rfind(b"\n")
                f.truncate(tail_start + cut + 1 if cut >= 0 else 0)
        except OSError as err:
            self.active = False
            logger.warning("chunkpilot: cannot write the step record %s (%s); recording stops",
                           self.path, err.strerror or err)

    def add(self, shape, seconds: float) -> None:
        if not self.active:
            return
        row = step_row(shape, seconds)
        if row is None or not seconds > 0:
            return
        self._rows.append(row)
        self.recorded += 1
        if self.recorded >= self.max_steps:
            self.flush()
            self.active = False
            logger.info("chunkpilot: recorded %d steps to %s; recording stops", self.recorded, self.path)
        elif len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows and self.active:
            self._write("".join(rows))

    def _write(self, text: str) -> None:
        try:
            with open(self.path, "a", encoding="ascii") as f:
                f.write(text)
        except OSError as err:
            self.active = False
            logger.warning("chunkpilot: cannot write the step record %s (%s); recording stops",
                           self.path, err.strerror or err)
