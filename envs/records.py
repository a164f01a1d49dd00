"""What a simulator keeps of its past, compactly: the pass log and the finished requests.

Both grow for the whole run, so both are fixed-width numeric records. The hot path
appends a tuple to a plain list (``buf += (a, b, c)``, the cheapest append Python has);
every :data:`FLUSH_RECORDS` runs the lists are moved into numpy blocks (:class:`Records`),
so a record costs its bytes and not a Python object a value.

- :class:`PassLog`: runs of passes (a decode-only stretch is one arithmetic sequence of
  durations), prefill passes, idle gaps: 32 bytes a run and 28 a prefill pass, some 170
  bytes a request on a busy engine (3.5 runs and 2 prefill passes each).
- :class:`RequestBook` (``Simulator.requests``): every request in arrival order. Live
  requests are their :class:`~envs.engine.Request` objects; a finished one is moved into
  columns (61 bytes) and read back as a :class:`FinishedRequest`. Its worst gap is
  computed from the pass log when it is filed, and its decode segments are then dropped
  (kept when the simulator records shapes, for :meth:`Simulator.request_gaps`).
- :class:`PassHistory`: a frozen view of a log's blocks (shared, never copied), read by
  :class:`~envs.metrics.SimResult` in chunks of at most :data:`CHUNK_PASSES` passes, so
  summarising a run of a million requests never expands its 20 million passes at once.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import numpy as np

FLUSH_RECORDS = 1 << 15
"""Runs the simulator's hot list holds before it files the log and the finished requests
away into blocks."""
CHUNK_PASSES = 1 << 20
"""Most passes expanded at once when a history is read (runs of up to this many passes are
read in one chunk, exactly as a full expansion)."""


class Records:
    """Fixed-width numeric records: ``buf`` (a list, appended on the hot path as
    ``buf += (a, b, ...)``) and the numpy ``blocks`` it is moved into by :meth:`flush`."""

    __slots__ = ("width", "dtype", "buf", "blocks", "count")

    def __init__(self, width: int, dtype) -> None:
        self.width, self.dtype = width, np.dtype(dtype)
        self.buf: list = []
        self.blocks: list[np.ndarray] = []
        self.count = 0  # records in blocks

    def __len__(self) -> int:
        return self.count + len(self.buf) // self.width

    def flush(self) -> None:
        """Move the list into a read-only block (the list object stays: the hot path may hold
        it under another name). A structured dtype gets one field per value of a record."""
        if self.buf:
            if self.dtype.names:
                flat = np.array(self.buf, dtype=np.int64).reshape(-1, self.width)
                block = np.empty(len(flat), dtype=self.dtype)
                for j, name in enumerate(self.dtype.names):
                    block[name] = flat[:, j]
            else:
                block = np.array(self.buf, dtype=self.dtype).reshape(-1, self.width)
            block.setflags(write=False)
            self.blocks.append(block)
            self.count += len(block)
            del self.buf[:]

    def frozen(self) -> tuple[np.ndarray, ...]:
        self.flush()
        return tuple(self.blocks)

    def array(self) -> np.ndarray:
        """Every record as one array (a copy)."""
        return _concat(self.frozen(), self.width, self.dtype)

    def since(self, start: int) -> Iterator[tuple[list, int]]:
        """The records from index ``start`` on, as (flat sequence, index of the first value to
        read) pairs: the blocks' tails as lists, then the hot list itself (not copied), for
        readers that walk a few recent records in Python."""
        if start < self.count:
            skip = start
            for block in self.blocks:
                if skip < len(block):
                    yield block[skip:].ravel().tolist(), 0
                    skip = 0
                else:
                    skip -= len(block)
            start = self.count
        yield self.buf, (start - self.count) * self.width


def _concat(blocks, width: int, dtype) -> np.ndarray:
    if not blocks:
        return np.zeros(0 if np.dtype(dtype).names else (0, width), dtype=dtype)
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def _columns(rows: np.ndarray) -> np.ndarray:
    """Structured records as a 2-D int64 array, one column per field."""
    return np.stack([rows[name].astype(np.int64) for name in rows.dtype.names], axis=1) if len(rows) \
        else np.zeros((0, len(rows.dtype.names)), dtype=np.int64)


# --- the pass log ------------------------------------------------------------------------

RUN, PREFILL, IDLE = 4, 5, 2
FLUSH_VALUES = RUN * FLUSH_RECORDS
"""The length of the hot run list at which the simulator flushes."""
PREFILL_RECORD = np.dtype([("pass", "i8"), ("tokens", "i4"), ("budget", "i4"), ("chunks", "i4"),
                           ("kv_blocks", "i8")])
"""A prefill pass: 28 bytes (token counts and budgets fit int32: envs.errors.MAX_TOKENS)."""


class PassLog:
    """What every pass of a simulator did, as fixed-width records:

    - runs of passes, ``(count, A, B, decodes)``: the run's pass ``i`` took ``A + B * i``
      seconds and carried ``decodes`` decode tokens (decode-only stretches are arithmetic
      sequences with ``B >= 0``; a pass with prefill is a run of one). Runs follow each
      other pass after pass, so a run's first pass is the sum of the counts before it;
    - prefill passes, ``(pass, prefill tokens, budget, chunks, KV blocks in use after it)``;
    - idle gaps, ``(pass, idle seconds before it)``.

    Only the simulator writes (``log.runs += (...)`` and so on); everyone else reads through
    the methods below. A mark from :meth:`position` counts runs.
    """

    __slots__ = ("runs", "prefill", "idle", "_runs", "_prefill", "_idle", "_starts", "_dropped")

    def __init__(self, first_pass: int = 0) -> None:
        """``first_pass``: the pass the log starts at (a fork's log starts where it forked)."""
        self._runs = Records(RUN, np.float64)
        self._prefill = Records(PREFILL, PREFILL_RECORD)
        self._idle = Records(IDLE, np.float64)
        self._starts = [first_pass]  # the first pass of each runs block, and the end of the last
        self._dropped = 0  # runs let go by drop_before
        self.runs, self.prefill, self.idle = self._runs.buf, self._prefill.buf, self._idle.buf

    def flush(self) -> None:
        if self.runs:
            self._runs.flush()
            self._starts.append(self._starts[-1] + int(self._runs.blocks[-1][:, 0].sum()))
        self._prefill.flush()
        self._idle.flush()

    def history(self) -> "PassHistory":
        """A frozen view of everything logged so far."""
        self.flush()
        return PassHistory(tuple(self._runs.blocks), tuple(self._starts), tuple(self._prefill.blocks),
                           tuple(self._idle.blocks))

    def drop_before(self, p: int) -> "PassHistory | None":
        """Let go of the runs blocks that end at or before pass ``p`` (and of the prefill and
        idle records of their passes); a history of what was let go, or None. Marks from
        :meth:`position` stay valid for passes after ``p``."""
        self.flush()
        k = 0
        while k < len(self._runs.blocks) and self._starts[k + 1] <= p:
            k += 1
        if not k:
            return None
        end = self._starts[k]
        runs, starts = self._runs.blocks[:k], self._starts[:k + 1]
        del self._runs.blocks[:k]
        del self._starts[:k]
        self._runs.count -= sum(len(b) for b in runs)
        self._dropped += sum(len(b) for b in runs)
        parts = []
        for rec in (self._prefill, self._idle):
            col = (lambda b: b["pass"]) if rec.dtype.names else (lambda b: b[:, 0])
            gone, kept = [], []
            for b in rec.blocks:
                cut = int(np.searchsorted(col(b), end, side="left"))
                gone.append(b[:cut])
                if cut < len(b):
                    kept.append(b[cut:].copy() if cut else b)
            rec.blocks[:] = kept
            rec.count = sum(len(b) for b in kept)
            parts.append(tuple(g for g in gone if len(g)))
        return PassHistory(tuple(runs), tuple(starts), parts[0], parts[1])

    def position(self) -> int:
        """A mark: the runs recorded so far (see :meth:`tokens_over_since`)."""
        return self._dropped + len(self._runs)

    def tokens_over_since(self, mark: int, itl_s: float) -> tuple[int, int]:
        """(decode tokens of the passes since ``mark`` whose gap exceeded ``itl_s``; the new
        mark)."""
        slow, _, mark = self.decode_tokens_since(mark, itl_s)
        return slow, mark

    def decode_tokens_since(self, mark: int, itl_s: float) -> tuple[int, int, int]:
        """(decode tokens of the passes since ``mark`` whose gap exceeded ``itl_s``, all
        their decode tokens, the new mark), counted in closed form over each run's
        arithmetic sequence."""
        start, rec = max(mark - self._dropped, 0), self._runs
        pieces = ((rec.buf, (start - rec.count) * RUN),) if start >= rec.count else rec.since(start)
        count = total = 0
        for runs, i in pieces:
            end = len(runs)
            while i < end:
                k, a, b, n = runs[i], runs[i + 1], runs[i + 2], runs[i + 3]
                i += RUN
                if not n:
                    continue
                k = int(k)
                total += n * k
                if b <= 0:
                    if a > itl_s:
                        count += n * k
                    continue
                i0 = 0 if a > itl_s else int((itl_s - a) / b) + 1  # first pass over the target
                if i0 < k:
                    count += n * (k - i0)
        return int(count), int(total), self.position()

    def pass_records(self, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(duration in seconds, decodes carried) of every pass from pass ``start`` on."""
        history = self.history()
        return expand(history.runs_between(start, history.end_pass), start, history.end_pass)


def expand(runs: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(duration, decodes) of passes [lo, hi), from rows ``(first pass, count, A, B,
    decodes)`` of the runs that cover them (rows may start before ``lo`` and end after
    ``hi``). Pass ``first + i`` of a run takes exactly ``A + B * i`` computed in float64,
    however the passes are chunked."""
    if hi <= lo or not len(runs):
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    first = runs[:, 0].astype(np.int64)
    count = runs[:, 1].astype(np.int64)
    start = np.clip(lo - first, 0, count)
    stop = np.clip(hi - first, 0, count)
    cnt = stop - start
    i = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(start, cnt)
    d = np.repeat(runs[:, 2], cnt) + np.repeat(runs[:, 3], cnt) * i
    n = np.repeat(runs[:, 4].astype(np.int64), cnt)
    return d, n


class PassChunk(NamedTuple):
    """Per-pass arrays of passes [start, start + len(duration_s))."""

    start: int
    duration_s: np.ndarray
    decodes: np.ndarray
    prefill_tokens: np.ndarray
    budget: np.ndarray
    """-1 where no budget was asked."""
    kv_blocks: np.ndarray
    """Blocks in use after each pass (carried forward between prefill passes)."""


class PassHistory:
    """A frozen view of a :class:`PassLog`: its blocks, shared (they are read-only)."""

    __slots__ = ("runs", "starts", "prefill", "idle", "first_pass", "end_pass", "passes")

    def __init__(self, runs: tuple, starts: tuple, prefill: tuple, idle: tuple) -> None:
        self.runs, self.starts, self.prefill, self.idle = runs, starts, prefill, idle
        self.first_pass, self.end_pass = starts[0], starts[-1]
        self.passes = self.end_pass - self.first_pass
        """Passes in the history (a fork's starts where it forked)."""

    @property
    def _pass_ranges(self):
        return zip(self.starts, self.starts[1:])

    def runs_between(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``(first pass, count, A, B, decodes)`` of the runs covering passes [lo, hi)."""
        picked = []
        for b, (f, e) in zip(self.runs, self._pass_ranges):
            if f < hi and e > lo:
                first = f + np.cumsum(b[:, 0]) - b[:, 0]
                i0 = int(np.searchsorted(first, lo, side="right")) - 1 if lo > f else 0
                i1 = int(np.searchsorted(first, hi, side="left"))
                picked.append(np.column_stack([first[i0:i1], b[i0:i1]]))
        return _concat(picked, RUN + 1, np.float64)

    def prefill_between(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``(pass, tokens, budget, chunks, KV blocks)`` of prefill passes in [lo, hi)."""
        picked = []
        for b in self.prefill:
            if len(b) and b["pass"][0] < hi and b["pass"][-1] >= lo:
                i0, i1 = np.searchsorted(b["pass"], [lo, hi], side="left")
                picked.append(_columns(b[i0:i1]))
        return _concat(picked, PREFILL, np.int64)

    def _ranges(self, max_passes: int) -> Iterator[tuple[int, int]]:
        if self.passes <= max_passes:
            if self.passes:
                yield self.first_pass, self.end_pass
            return
        for f, e in self._pass_ranges:
            for s in range(f, e, max_passes):
                yield s, min(s + max_passes, e)

    def chunks(self, max_passes: int = CHUNK_PASSES, kv_before: int = 0) -> Iterator[PassChunk]:
        """Per-pass arrays, at most ``max_passes`` passes at a time, in order. A history of
        at most ``max_passes`` passes is one chunk. ``kv_before``: the KV blocks in use
        before its first pass (0 at the start of a run)."""
        kv_carry = kv_before  # blocks in use before the chunk's first pass
        for lo, hi in self._ranges(max_passes):
            dur, dec = expand(self.runs_between(lo, hi), lo, hi)
            rows = self.prefill_between(lo, hi)
            n = hi - lo
            prefill = np.zeros(n, dtype=np.int64)
            budget = np.full(n, -1, dtype=np.int64)
            prefill[rows[:, 0] - lo] = rows[:, 1]
            budget[rows[:, 0] - lo] = rows[:, 2]
            if len(rows):
                at = np.searchsorted(rows[:, 0], np.arange(lo, hi), side="right") - 1
                kv = np.where(at >= 0, rows[np.maximum(at, 0), 4], kv_carry)
            else:
                kv = np.full(n, kv_carry, dtype=np.int64)
            kv_carry = int(kv[-1])
            yield PassChunk(lo, dur, dec, prefill, budget, kv)

    def range_max(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The longest pass among passes [lo[j], hi[j]) for each j (every range non-empty), in
        closed form over the runs: a run's durations never decrease, so its longest pass in a
        range is the range's last; identical to the maximum of the expanded durations."""
        out = np.full(len(lo), -np.inf)
        inside = hi > self.first_pass  # a fork's log starts where it forked: earlier passes are not in it
        if not inside.all():
            out[inside] = self.range_max(lo[inside], hi[inside])
            return out
        if not len(lo):
            return out
        lo = np.maximum(lo, self.first_pass)
        runs = self.runs_between(int(lo.min()), int(hi.max()))
        first, count, a, b = runs[:, 0].astype(np.int64), runs[:, 1].astype(np.int64), runs[:, 2], runs[:, 3]
        r0 = np.searchsorted(first, lo, side="right") - 1
        r1 = np.searchsorted(first, hi, side="left") - 1  # the run holding the range's last pass
        last = a[r1] + b[r1] * (np.minimum(hi, first[r1] + count[r1]) - first[r1] - 1)
        full = a + b * (count - 1)  # each run's last (and longest) pass
        inner = r1 > r0
        if inner.any():
            bounds = np.empty(2 * int(inner.sum()), dtype=np.int64)
            bounds[0::2], bounds[1::2] = r0[inner], r1[inner]
            padded = np.append(full, -np.inf)
            out[inner] = np.maximum.reduceat(padded, bounds)[0::2]
        return np.maximum(out, last)


# --- the requests ------------------------------------------------------------------------

COLUMNS = np.dtype([("arrival", "f8"), ("prompt", "i8"), ("output", "i8"), ("first_token_s", "f8"),
                    ("finish_s", "f8"), ("max_gap_s", "f8"), ("recomputed", "i8"),
                    ("preemptions", "i4"), ("warm", "?")], align=False)
"""A finished request's record: 61 bytes."""
BLOCK_BITS = 16
FILED = 10  # (position, arrival, prompt, output, first token, finish, preemptions, recomputed, warm, worst resume gap)


class FinishedRequest(NamedTuple):
    """A finished request as ``Simulator.requests[i]`` reads it back."""

    rid: int
    arrival: float
    prompt: int
    output: int
    warm: bool
    first_token_s: float
    finish_s: float
    preemptions: int
    recomputed: int
    max_gap_s: float
    """Its worst gap between two tokens (NaN with one token)."""
    resume_gaps: tuple
    segments: tuple
    """Its decode segments (kept only when the simulator records shapes)."""

    @property
    def generated(self) -> int:
        return self.output

    @property
    def last_token_s(self) -> float:
        return self.finish_s

    @property
    def computed(self) -> int:
        return 0  # its KV blocks are released

    @property
    def target(self) -> int:
        return self.prompt + self.output


def _filed_columns(filed: np.ndarray, worst: np.ndarray) -> dict[str, np.ndarray]:
    """The COLUMNS of filed rows (see RequestBook.finish)."""
    return {"arrival": filed[:, 1], "prompt": filed[:, 2], "output": filed[:, 3],
            "first_token_s": filed[:, 4], "finish_s": filed[:, 5], "preemptions": filed[:, 6],
            "recomputed": filed[:, 7], "warm": filed[:, 8] != 0, "max_gap_s": worst,
            "position": filed[:, 0]}


class RequestBook:
    """Every request a simulator has seen, in arrival order (``Simulator.requests``):
    ``book[i]`` is the live :class:`Request` object while it runs and a
    :class:`FinishedRequest` once it has finished; ``len`` and iteration work as on a list."""

    __slots__ = ("log", "keep_segments", "sink", "_live", "_recent", "_n", "_filed", "_segments",
                 "_pending_segments", "_resumes", "_blocks", "_index")

    def __init__(self, log: PassLog, keep_segments: bool = False, sink=None) -> None:
        """``sink(columns, resumes)``, when given, receives finished requests instead of the
        columns (a streaming summary): nothing of them is kept."""
        self.log, self.keep_segments, self.sink = log, keep_segments, sink
        self._live: dict = {}  # position -> Request
        self._recent: dict = {}  # position -> Request, finished but not yet filed away
        self._n = 0
        self._filed = Records(FILED, np.float64)  # finished, not yet in the columns
        self._pending_segments = Records(3, np.int64)  # (position, lo, hi) not yet measured
        self._segments = Records(3, np.int64)  # kept ones (keep_segments)
        self._resumes = Records(2, np.float64)  # (position, gap) of finished requests
        self._blocks: list[np.ndarray] = []  # COLUMNS rows by position
        self._index: tuple[dict, dict] | None = None  # position -> resume gaps, segments

    # --- writing (the simulator) ---------------------------------------------------------

    def add(self, r) -> None:
        r.pos = self._n
        self._live[self._n] = r
        self._n += 1

    def finish(self, r) -> None:
        """``r`` has finished: it is filed into the columns (and its object let go) at the
        next :meth:`flush`, in one batch with the others."""
        del self._live[r.pos]
        self._recent[r.pos] = r

    def _file_recent(self) -> None:
        done = list(self._recent.values())
        self._recent.clear()
        filed = self._filed.buf
        for r in done:
            gaps = r.resume_gaps
            filed += (r.pos, r.arrival, r.prompt, r.output, r.first_token_s, r.finish_s,
                      r.preemptions, r.recomputed, r.warm, max(gaps) if gaps else -math.inf)
            for lo, hi in r.segments:
                self._pending_segments.buf += (r.pos, lo, hi)
            for g in gaps:
                self._resumes.buf += (r.pos, g)

    def flush(self) -> None:
        """Measure the filed requests' worst gaps on the pass log and move them into the
        columns (or hand them to the sink)."""
        if not self._recent:
            return
        self._file_recent()
        self._index = None
        self.log.flush()
        filed = self._filed.array()
        pos = filed[:, 0].astype(np.int64)
        worst = filed[:, 9].copy()  # the worst resume gap, then the worst pass it decoded in
        segments = self._pending_segments.array()
        if len(segments):
            top = self.log.history().range_max(segments[:, 1], segments[:, 2])
            order = np.argsort(pos)
            np.maximum.at(worst, order[np.searchsorted(pos[order], segments[:, 0])], top)
            if self.keep_segments:
                self._segments.buf += segments.ravel().tolist()
        self._filed, self._pending_segments = Records(FILED, np.float64), Records(3, np.int64)
        if self.sink is not None:
            resumes = self._resumes.array()
            self._resumes = Records(2, np.float64)
            self.sink(_filed_columns(filed, worst), resumes)
            return
        self._grow(int(pos.max()) + 1 if len(pos) else 0)
        for b in np.unique(pos >> BLOCK_BITS):
            sel = (pos >> BLOCK_BITS) == b
            rows = self._blocks[b]
            at = pos[sel] & ((1 << BLOCK_BITS) - 1)
            for name, values in _filed_columns(filed[sel], worst[sel]).items():
                if name != "position":
                    rows[name][at] = values

    def _grow(self, n: int) -> None:
        while len(self._blocks) << BLOCK_BITS < n:
            block = np.zeros(1 << BLOCK_BITS, dtype=COLUMNS)
            for name in ("first_token_s", "finish_s"):
                block[name] = math.nan
            block["max_gap_s"] = -math.inf
            self._blocks.append(block)

    # --- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int):
        if type(i) is int:  # the hot path: a live request, or one finished since the last flush
            r = self._live.get(i) or self._recent.get(i)
            if r is not None:
                return r
        return self._item(i)

    def _item(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("request index out of range")
        r = self._live.get(i)
        if r is None:
            r = self._recent.get(i)  # finished since the last flush: still its own object
        if r is not None:
            return r
        if self.sink is not None:
            raise IndexError(f"request {i} has finished, and a summary-only simulator keeps no "
                             "finished request")
        row = self._blocks[i >> BLOCK_BITS][i & ((1 << BLOCK_BITS) - 1)]
        resumes, segments = self._by_position()
        gap = float(row["max_gap_s"])
        return FinishedRequest(
            i, float(row["arrival"]), int(row["prompt"]), int(row["output"]), bool(row["warm"]),
            float(row["first_token_s"]), float(row["finish_s"]), int(row["preemptions"]),
            int(row["recomputed"]), gap if gap > -math.inf else math.nan,
            tuple(resumes.get(i, ())), tuple(segments.get(i, ())))

    def _by_position(self) -> tuple[dict, dict]:
        """Finished requests' resume gaps and kept segments by position (built once per flush;
        only preempted requests have gaps)."""
        if self._index is None:
            resumes: dict[int, list] = {}
            for p, g in self._resumes.array().tolist():
                resumes.setdefault(int(p), []).append(g)
            segments: dict[int, list] = {}
            for p, lo, hi in self._segments.array().tolist():
                segments.setdefault(p, []).append((lo, hi))
            self._index = (resumes, segments)
        return self._index

    def __iter__(self):
        self.flush()
        return (self[i] for i in range(self._n))

    def live(self) -> list:
        """The live requests, in arrival order."""
        return [self._live[k] for k in sorted(self._live)]

    def live_columns(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The live requests' columns as they stand now (with ``position``; the worst gap over
        their finished decode segments and resume gaps), and their resume gaps, rows of
        (position, gap)."""
        live = self.live()
        out = {name: np.array([getattr(r, name) for r in live], dtype=COLUMNS[name])
               for name in ("arrival", "prompt", "output", "first_token_s", "finish_s", "preemptions",
                            "recomputed", "warm")}
        at = np.array([r.pos for r in live], dtype=np.int64)
        out["position"] = at
        worst = np.array([max(r.resume_gaps) if r.resume_gaps else -math.inf for r in live])
        segs = [(r.pos, lo, hi) for r in live for lo, hi in r.segments]
        if segs:
            s = np.array(segs, dtype=np.int64)
            top = self.log.history().range_max(s[:, 1], s[:, 2])
            np.maximum.at(worst, np.searchsorted(at, s[:, 0]), top)
        out["max_gap_s"] = worst
        resumes = np.array([(r.pos, g) for r in live for g in r.resume_gaps], dtype=np.float64)
        return out, resumes.reshape(-1, 2)

    def columns(self) -> dict[str, np.ndarray]:
        """Every request's record by position (live ones as they stand now), plus
        ``resume_position`` and ``resume_gap_s`` (every resume gap, by position then order)."""
        self.flush()
        n = self._n
        self._grow(n)
        out = {name: np.concatenate([b[name] for b in self._blocks])[:n] if self._blocks else
               np.zeros(0, dtype=COLUMNS[name]) for name in COLUMNS.names if name != "recomputed"}
        gaps = self._resumes.array()
        live, live_gaps = self.live_columns()
        for name in out:
            out[name][live["position"]] = live[name]
        gaps = np.concatenate([gaps, live_gaps])
        order = np.argsort(gaps[:, 0], kind="stable")
        out["resume_position"], out["resume_gap_s"] = gaps[order, 0].astype(np.int64), gaps[order, 1]
        return out

    def segments_of(self, i: int) -> list[tuple[int, int]]:
        r = self._live.get(i)
        if r is not None:
            return list(r.segments)
        if not self.keep_segments:
            raise RuntimeError("a finished request's decode segments are kept only when the "
                               "Simulator is constructed with record_shapes=True")
        return list(self[i].segments)
