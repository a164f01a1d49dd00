"""Request streams: seeded synthetic arrivals and lengths, and trace replay.

A :class:`Workload` is three aligned arrays (arrival time, prompt tokens, output
tokens), sorted by arrival. Synthetic streams draw everything from one
``numpy.random.Generator`` seeded by the caller, so the same seed gives the same
requests. Traces are CSV files with the header ``arrival_s,prompt_tokens,output_tokens``
(the format of shared/traces and of ``chunkpilot/traces``).

Length distributions are written as short specs:

=================================  ==============================================
``fixed:N``                        always N tokens
``uniform:LO:HI``                  integers uniform in [LO, HI]
``lognormal:MEDIAN:SIGMA[:MAX]``   lognormal with that median and log-space sigma,
                                   rounded, clipped to [1, MAX] (MAX default 32768)
``empirical:PATH[:COLUMN]``        resampled from a trace's prompt_tokens or
                                   output_tokens column (the column defaults to the
                                   one being drawn)
``mix:W*SPEC+W*SPEC...``           a mixture; weights are normalised
``short-long``                     DESIGN.md's mix: 70% uniform 32-512, 30% 4K-16K
=================================  ==============================================
"""

from __future__ import annotations

import math
import os
from array import array
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from envs.errors import (MAX_TOKENS, ConfigError, integer, non_negative, number, positive, require,
                         show)
from envs.files import GIB, csv_rows
from envs.sharing import HASH_BLOCK_TOKENS, parse_sharing, share_prefixes

TRACE_HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
HASH_COLUMN = "block_hashes"
"""A trace's optional fourth column: its prompt's prefix-cache block ids, space-separated."""
TRACE_BLOCK_TOKENS = 512
"""Tokens per id of a trace's ``block_hashes`` unless told (the Mooncake trace's 512-token
blocks: its README and ``../shared/traces/README.md``)."""

BYTES_PER_REQUEST = 512
"""The most memory one request costs a run: its arrival and lengths (in the workload and
in the simulator's copy, 48 bytes), its compact record once finished (~60 bytes), its
share of the pass log (~220 bytes), with room for the summary's transients."""
MAX_RATE = 1e9
"""Arrival rates and trace speed-ups stay in [1/MAX_RATE, MAX_RATE] (one request in 30
years to a billion a second), so arrival times stay finite."""
MAX_SECONDS = 1e12
"""Times and durations of a workload in seconds (30,000 years)."""
MAX_SPEC_CHARS = 4096
MAX_SPEC_DEPTH = 8
TRACE_MAX_BYTES = 64 * GIB


def max_requests() -> int:
    """The most requests one workload may hold: what this machine's memory holds at
    :data:`BYTES_PER_REQUEST` each."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 64 * GIB
    return max(int(memory // BYTES_PER_REQUEST), 1)


def check_rate(field_name: str, value: float) -> float:
    """A rate or a speed-up: > 0 (the usual mistake, said plainly), then within
    [1/MAX_RATE, MAX_RATE]."""
    positive(field_name, value)
    return number(field_name, value, 1 / MAX_RATE, MAX_RATE)


def check_num_requests(field_name: str, n: int) -> int:
    return integer(field_name, n, 1, max_requests(),
                   f"at ~{BYTES_PER_REQUEST} bytes a request, what this machine's memory holds")


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests sorted by arrival. Arrays are read-only; times in seconds from 0."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    name: str = "workload"
    block_hashes: tuple | None = None
    """Prefix-cache ids of each request's blocks (an int64 array a request, or None for a
    request without them), or None for none: consecutive ``hash_block_tokens``-token blocks
    of its prompt from its first token, each naming everything up to its end, so that
    requests whose leading ids agree share that prefix (``envs.prefix_cache.units_of``)."""
    hash_block_tokens: int = 0
    """Tokens per id of ``block_hashes`` (512 in the Mooncake trace)."""
    hashes_cover_output: bool = False
    """Whether the ids go on past the prompt into the request's output (a conversation's
    next turn resends the answer); a trace's name its prompt only, whose last block may
    be partial."""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        require(len(self.prompt_tokens) == n and len(self.output_tokens) == n, "workload", n,
                "arrival_s, prompt_tokens and output_tokens must have the same length")
        require(self.arrival_s.dtype == np.float64, "arrival_s", str(self.arrival_s.dtype),
                "must be float64 seconds")
        for name in ("prompt_tokens", "output_tokens"):
            arr = getattr(self, name)
            require(arr.dtype == np.int64, name, str(arr.dtype), "must be int64 token counts")
        for arr in (self.arrival_s, self.prompt_tokens, self.output_tokens):
            arr.setflags(write=False)
        if n:
            bad = np.flatnonzero(~(np.isfinite(self.arrival_s) & (self.arrival_s >= 0)
                                   & (self.arrival_s <= MAX_SECONDS)))
            if len(bad):
                number(f"arrival_s of request {bad[0]}", float(self.arrival_s[bad[0]]), 0, MAX_SECONDS)
            down = np.flatnonzero(np.diff(self.arrival_s) < 0)
            require(not len(down), f"arrival_s of request {down[0] + 1 if len(down) else 0}",
                    float(self.arrival_s[down[0] + 1]) if len(down) else 0.0,
                    "must be >= the previous request's (sorted ascending)")
            for name in ("prompt_tokens", "output_tokens"):
                arr = getattr(self, name)
                bad = np.flatnonzero((arr < 1) | (arr > MAX_TOKENS))
                if len(bad):
                    integer(f"{name} of request {bad[0]}", int(arr[bad[0]]), 1, MAX_TOKENS)
        if self.block_hashes is not None:
            require(len(self.block_hashes) == n, "block_hashes", len(self.block_hashes),
                    f"must hold one array of ids per request ({n})")
            integer("hash_block_tokens", self.hash_block_tokens, 1, MAX_TOKENS)
            for i, ids in enumerate(self.block_hashes):
                require(ids is None or (isinstance(ids, np.ndarray) and ids.dtype == np.int64
                                        and ids.ndim == 1), f"block_hashes of request {i}",
                        type(ids).__name__, "must be a 1-D int64 array of ids, or None")

    @classmethod
    def from_arrays(cls, arrival_s, prompt_tokens, output_tokens, name: str = "workload") -> "Workload":
        """Build from sequences; numbers that do not fit (float64 seconds, int64 tokens) are
        refused with the field and the request."""
        cols = []
        for field_name, values, dtype in (("arrival_s", arrival_s, np.float64),
                                          ("prompt_tokens", prompt_tokens, np.int64),
                                          ("output_tokens", output_tokens, np.int64)):
            if not isinstance(values, np.ndarray):
                # One by one, so that a bool, a float where a count belongs, or a number beyond
                # int64 or float64 is refused with its request, not truncated or overflowed.
                for i, v in enumerate(values):
                    if dtype is np.float64:
                        number(f"{field_name} of request {i}", v, 0, MAX_SECONDS)
                    else:
                        integer(f"{field_name} of request {i}", v, 1, MAX_TOKENS)
            cols.append(np.array(values, dtype=dtype).reshape(-1))
        return cls(*cols, name)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else float("nan")

    def scaled(self, rate_scale: float) -> "Workload":
        """The same requests arriving ``rate_scale`` times as fast."""
        check_rate("rate_scale", rate_scale)
        return self.rows(slice(None), self.arrival_s / rate_scale, f"{self.name}x{rate_scale:g}")

    def rows(self, rows, arrival_s: np.ndarray, name: str) -> "Workload":
        """Requests ``rows`` (a slice or an array of indices: their lengths and block ids)
        arriving at ``arrival_s``."""
        hashes = None
        if self.block_hashes is not None:
            hashes = (self.block_hashes[rows] if isinstance(rows, slice)
                      else tuple(self.block_hashes[i] for i in rows))
        return Workload(arrival_s, self.prompt_tokens[rows].copy(), self.output_tokens[rows].copy(),
                        name, hashes, self.hash_block_tokens, self.hashes_cover_output)

    def window(self, start_s: float = 0.0, end_s: float | None = None) -> "Workload":
        """Requests arriving in [start_s, end_s), re-based so the window starts at 0."""
        non_negative("window_start_s", start_s, MAX_SECONDS)
        if end_s is not None:
            number("window_end_s", end_s, start_s, MAX_SECONDS, low_open=True)
        lo = int(np.searchsorted(self.arrival_s, start_s, side="left"))
        hi = len(self) if end_s is None else int(np.searchsorted(self.arrival_s, end_s, side="left"))
        return self.rows(slice(lo, hi), self.arrival_s[lo:hi] - start_s,
                         f"{self.name}[{start_s:g}:{end_s}]")

    def head(self, n: int) -> "Workload":
        return self.rows(slice(None, n), self.arrival_s[:n].copy(), f"{self.name}[:{n}]")

    def describe(self) -> dict:
        if not len(self):
            return {"name": self.name, "requests": 0}
        p = self.prompt_tokens
        return {
            "name": self.name, "requests": len(self), "duration_s": self.duration_s,
            "mean_rate": self.mean_rate,
            "prompt_p50": float(np.percentile(p, 50)), "prompt_p95": float(np.percentile(p, 95)),
            "output_p50": float(np.percentile(self.output_tokens, 50)),
        }


# --- Traces -------------------------------------------------------------------------

BUNDLED_TRACES = Path(__file__).parent / "data"


def bundled_traces() -> list[str]:
    return sorted(p.stem for p in BUNDLED_TRACES.glob("*.csv"))


def resolve_trace(path: str | Path) -> Path:
    """A path to a CSV, or the name of a bundled trace (``azure_conv_2023``)."""
    require(isinstance(path, (str, Path)) and bool(str(path).strip()), "trace", path,
            f"must be a CSV path or a bundled trace ({', '.join(bundled_traces())})")
    p = Path(path)
    if not p.exists() and (BUNDLED_TRACES / f"{p.stem}.csv").exists() and p.parent == Path("."):
        return BUNDLED_TRACES / f"{p.stem}.csv"
    return p


def load_trace(path: str | Path, rate_scale: float = 1.0, start_s: float = 0.0,
               end_s: float | None = None, max_requests: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> Workload:
    """Read an ``arrival_s,prompt_tokens,output_tokens[,block_hashes]`` CSV (or a bundled
    trace by name, see :func:`bundled_traces`); every bad row is reported with its line
    number. ``block_hashes`` ids name ``block_tokens``-token blocks of each prompt, and a
    prompt of P tokens has ceil(P / block_tokens) of them."""
    check_rate("rate_scale", rate_scale)
    integer("trace_block_tokens", block_tokens, 1, MAX_TOKENS)
    non_negative("window_start_s", start_s, MAX_SECONDS)
    if end_s is not None:
        number("window_end_s", end_s, start_s, MAX_SECONDS, low_open=True)
    if max_requests is not None:
        integer("max_requests", max_requests, 1)
    path = resolve_trace(path)
    try:
        stamp = path.stat().st_mtime_ns
    except (OSError, ValueError):
        stamp = None
    w = _read_trace(path, stamp)
    if w.block_hashes is not None:
        w = replace(w, hash_block_tokens=block_tokens)
        _check_hash_counts(path, w)
    if start_s or end_s is not None:
        w = w.window(start_s, end_s)
    if rate_scale != 1.0:
        w = w.scaled(rate_scale)
    if max_requests is not None:
        w = w.head(max_requests)
    if not len(w):
        raise ConfigError(f"window_start_s: trace {str(path)!r}: the window [{start_s}, {end_s}) "
                          "holds no request")
    return w


def _trace_error(path: Path, line: int, text: str) -> ConfigError:
    return ConfigError(f"trace {show(str(path), 200)} line {line}: {text}")


def _token_cell(path: Path, line: int, column: str, raw: str) -> int:
    try:
        v = int(raw)
    except ValueError:  # not an integer, or one of over 4,300 digits
        v = 0
    if not 1 <= v <= MAX_TOKENS:
        raise _trace_error(path, line, f"{column}: got {show(raw)}, must be an integer >= 1 and "
                                       f"<= {MAX_TOKENS}")
    return v


@lru_cache(maxsize=16)
def _read_trace(path: Path, stamp: int | None) -> Workload:
    """The whole file, parsed once per (path, modification time): capacity searches
    replay the same trace hundreds of times. Workload arrays are read-only, so the
    cached copy is shared safely. Columns are kept in typed arrays (24 bytes a row)."""
    if stamp is None or not path.is_file():
        try:
            os.stat(path)
        except (OSError, ValueError) as err:
            reason = getattr(err, "strerror", None) or str(err)
            raise ConfigError(f"trace: cannot read {show(str(path), 200)} ({reason}); bundled "
                              f"traces: {', '.join(bundled_traces())}") from None
    arrivals, prompts, outputs = array("d"), array("q"), array("q")
    limit = max_requests()
    rows = csv_rows("trace", path, TRACE_MAX_BYTES)
    line, header = next(rows, (1, None))
    if header is None or tuple(h.strip() for h in header[:3]) != TRACE_HEADER:
        raise _trace_error(path, line, f"header must start with {','.join(TRACE_HEADER)}, got "
                                       f"{show(','.join(header or []))}")
    hashes = [] if len(header) > 3 and header[3].strip() == HASH_COLUMN else None
    last = 0.0
    for line, row in rows:
        if len(row) < 3:
            raise _trace_error(path, line, f"expected 3 fields, got {len(row)}")
        try:
            a = float(row[0])
        except ValueError:
            a = math.nan
        if not (math.isfinite(a) and 0 <= a <= MAX_SECONDS):
            raise _trace_error(path, line, f"arrival_s: got {show(row[0])}, must be a finite number "
                                           f">= 0 and <= {MAX_SECONDS:g}")
        if a < last:
            raise _trace_error(path, line, f"arrival_s: got {a}, must be >= the previous row's "
                                           f"{last} (rows sorted by arrival)")
        last = a
        if len(arrivals) >= limit:
            raise _trace_error(path, line, f"more than {limit:,} requests, what this machine's "
                                           f"memory holds at ~{BYTES_PER_REQUEST} bytes a request")
        arrivals.append(a)
        prompts.append(_token_cell(path, line, TRACE_HEADER[1], row[1]))
        outputs.append(_token_cell(path, line, TRACE_HEADER[2], row[2]))
        if hashes is not None:
            hashes.append(_hash_cell(path, line, row[3] if len(row) > 3 else ""))
    if not arrivals:
        raise ConfigError(f"trace {show(str(path), 200)}: no requests after the header")
    # Views of the typed arrays, which they keep alive: no copy of a large trace.
    return Workload(np.frombuffer(arrivals, dtype=np.float64), np.frombuffer(prompts, dtype=np.int64),
                    np.frombuffer(outputs, dtype=np.int64), name=path.stem,
                    block_hashes=tuple(hashes) if hashes is not None else None,
                    hash_block_tokens=TRACE_BLOCK_TOKENS if hashes is not None else 0)


MAX_BLOCK_ID = 2**40
"""Largest block id: its KV blocks' names (id x block tokens + place) stay int64."""


def _hash_cell(path: Path, line: int, raw: str) -> np.ndarray:
    """One row's block ids: non-negative integers, space-separated."""
    try:
        ids = np.array([int(x) for x in raw.split()], dtype=np.int64)
    except (ValueError, OverflowError):
        ids = None
    if ids is None or not len(ids) or ids.min() < 0 or ids.max() > MAX_BLOCK_ID:
        raise _trace_error(path, line, f"{HASH_COLUMN}: got {show(raw)}, must be integers >= 0 and "
                                       f"<= {MAX_BLOCK_ID}, space-separated, at least one")
    ids.setflags(write=False)
    return ids


def _check_hash_counts(path: Path, w: Workload) -> None:
    """Each prompt of P tokens has ceil(P / block tokens) ids: else the block size given is
    not the trace's."""
    bt = w.hash_block_tokens
    for i, (ids, p) in enumerate(zip(w.block_hashes, w.prompt_tokens)):
        if len(ids) != -(-int(p) // bt):
            raise ConfigError(f"trace_block_tokens: got {bt}, but request {i} of {show(str(path), 200)} "
                              f"has {int(p)} prompt tokens and {len(ids)} block ids (needs "
                              f"ceil(prompt / trace_block_tokens) ids: is the trace's block size "
                              f"{bt}?)")


@lru_cache(maxsize=8)
def _trace_column(path: str, column: str) -> np.ndarray:
    w = load_trace(path)
    return w.prompt_tokens if column == "prompt_tokens" else w.output_tokens


# --- Length distributions -------------------------------------------------------------

class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def sample(self, rng, n):
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int

    def sample(self, rng, n):
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    max_tokens: int = 32768

    def sample(self, rng, n):
        x = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=n))
        return np.clip(x, 1, self.max_tokens).astype(np.int64)


@dataclass(frozen=True)
class Empirical:
    values: tuple[int, ...] = field(repr=False)
    source: str = ""

    def sample(self, rng, n):
        return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size=n)]


@dataclass(frozen=True)
class Mixture:
    weights: tuple[float, ...]
    parts: tuple[LengthDist, ...]

    def sample(self, rng, n):
        w = np.asarray(self.weights, dtype=float)
        which = rng.choice(len(self.parts), size=n, p=w / w.sum())
        out = np.empty(n, dtype=np.int64)
        for i, part in enumerate(self.parts):
            idx = np.flatnonzero(which == i)
            out[idx] = part.sample(rng, len(idx))
        return out


NAMED_LENGTHS = {
    # DESIGN.md section 5: 70% short prompts, 30% 4K-16K.
    "short-long": "mix:0.7*uniform:32:512+0.3*uniform:4096:16384",
}


SPEC_FORMS = ("fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX], empirical:PATH[:COLUMN], "
              "mix:W*SPEC+W*SPEC")
MAX_SIGMA = 10.0
"""Largest lognormal sigma (in log space: e^10 is a 22,000x spread)."""


def parse_lengths(spec: str, field_name: str = "lengths", column: str = "prompt_tokens") -> LengthDist:
    """Parse a length spec (see the module docstring); every number is range-checked and
    an error names the field, the spec and the allowed forms."""
    require(isinstance(spec, str) and bool(spec.strip()), field_name, spec,
            f"must be {SPEC_FORMS}, or one of {', '.join(NAMED_LENGTHS)}")
    require(len(spec) <= MAX_SPEC_CHARS, field_name, spec, f"must be at most {MAX_SPEC_CHARS} characters")
    return _parse_lengths(spec, field_name, column, 0)


def _spec_number(field_name: str, spec: str, what: str, text: str, low: float, high: float,
                 low_open: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    try:
        return number(f"{field_name} {what}", value, low, high, low_open=low_open)
    except ConfigError as err:
        raise ConfigError(f"{field_name}: got {show(spec)}, {what} {show(text)}: "
                          f"{str(err).split(', ', 1)[1]}") from None


def _spec_tokens(field_name: str, spec: str, what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # not an integer, or one of over 4,300 digits
        raise ConfigError(f"{field_name}: got {show(spec)}, {what} {show(text)} must be an integer "
                          f"in [1, {MAX_TOKENS}]") from None
    if not 1 <= value <= MAX_TOKENS:
        raise ConfigError(f"{field_name}: got {show(spec)}, {what} {show(text)} must be an integer "
                          f">= 1 and <= {MAX_TOKENS}")
    return value


def _parse_lengths(spec: str, field_name: str, column: str, depth: int) -> LengthDist:
    require(depth <= MAX_SPEC_DEPTH, field_name, spec, f"mixtures nest at most {MAX_SPEC_DEPTH} deep")
    spec = NAMED_LENGTHS.get(spec, spec)
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    if kind == "mix" and rest:
        weights, parts = [], []
        for term in rest.split("+"):
            w, star, sub = term.partition("*")
            require(bool(star) and bool(sub), field_name, spec, "each mixture term must be W*SPEC")
            weights.append(_spec_number(field_name, spec, "weight", w, 0, 1e12, low_open=True))
            parts.append(_parse_lengths(sub, field_name, column, depth + 1))
        return Mixture(tuple(weights), tuple(parts))
    if kind == "fixed" and len(args) == 1:
        return Fixed(_spec_tokens(field_name, spec, "N", args[0]))
    if kind == "uniform" and len(args) == 2:
        lo, hi = (_spec_tokens(field_name, spec, w, a) for w, a in zip(("LO", "HI"), args))
        require(lo <= hi, field_name, spec, "uniform:LO:HI needs LO <= HI")
        return Uniform(lo, hi)
    if kind == "lognormal" and len(args) in (2, 3):
        med = _spec_number(field_name, spec, "MEDIAN", args[0], 1, MAX_TOKENS)
        sig = _spec_number(field_name, spec, "SIGMA", args[1], 0, MAX_SIGMA)
        mx = _spec_tokens(field_name, spec, "MAX", args[2]) if len(args) == 3 else 32768
        return LogNormal(med, sig, mx)
    if kind == "empirical" and rest:
        return _empirical(spec, rest, field_name, column)
    raise ConfigError(f"{field_name}: got {show(spec)}, must be {SPEC_FORMS}, or one of "
                      f"{', '.join(NAMED_LENGTHS)}")


def _empirical(spec: str, rest: str, field_name: str, column: str) -> "Empirical":
    """``empirical:PATH[:COLUMN]``: a trailing ``:WORD`` that is not part of an existing path
    is a column, and must be one of the trace's length columns."""
    path, col = rest, column
    head, sep, last = rest.rpartition(":")
    if sep and last in TRACE_HEADER[1:]:
        path, col = head, last
    elif sep and head and not Path(rest).exists() and not resolve_trace(rest).exists():
        if Path(head).exists() or resolve_trace(head).exists():
            raise ConfigError(f"{field_name}: got {show(spec)}, column {last!r} must be one of "
                              f"{', '.join(TRACE_HEADER[1:])}")
    try:
        values = _trace_column(path, col)
    except ConfigError as err:
        raise ConfigError(f"{field_name}: got {show(spec)}: {err}") from None
    return Empirical(tuple(int(v) for v in values), f"{path}:{col}")


# --- Arrival processes ----------------------------------------------------------------

ARRIVALS = ("poisson", "gamma", "onoff")
MAX_BURSTINESS = 1e4
"""Gamma shapes stay in [1/MAX_BURSTINESS, MAX_BURSTINESS] (vLLM bench uses 0.1-10)."""


def arrival_times(rng: np.random.Generator, process: str, rate: float, n: int,
                  burstiness: float = 1.0, on_s: float = 10.0, off_s: float = 10.0) -> np.ndarray:
    """``n`` sorted arrival times (first at its own gap after 0, then shifted to start at 0).

    - ``poisson``: exponential gaps at ``rate`` per second.
    - ``gamma``: gamma gaps with shape ``burstiness`` and mean 1/rate (vLLM bench's
      convention: 1.0 is Poisson, below 1 is burstier, above 1 is smoother).
    - ``onoff``: Poisson during ``on_s``-second bursts separated by ``off_s`` seconds of
      silence, at the rate that keeps the long-run mean at ``rate``.
    """
    check_rate("rate", rate)
    check_num_requests("num_requests", n)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif process == "gamma":
        number("burstiness", burstiness, 1 / MAX_BURSTINESS, MAX_BURSTINESS)
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    elif process == "onoff":
        positive("on_s", on_s, MAX_SECONDS)
        non_negative("off_s", off_s, MAX_SECONDS)
        on_rate = rate * (on_s + off_s) / on_s
        busy = np.cumsum(rng.exponential(1.0 / on_rate, size=n))  # time spent in "on" periods
        wall = busy + np.floor(busy / on_s) * off_s  # insert an off period after each on period
        return _finite_times(wall - wall[0], rate)
    else:
        raise ConfigError(f"arrival: got {show(process)}, must be one of poisson, gamma, onoff")
    t = np.cumsum(gaps)
    return _finite_times(t - t[0], rate)


def _finite_times(t: np.ndarray, rate: float) -> np.ndarray:
    if len(t) and not (np.isfinite(t[-1]) and t[-1] <= MAX_SECONDS):
        raise ConfigError(f"rate: got {rate!r}, the arrivals would span {t[-1]:g} s, must stay "
                          f"within {MAX_SECONDS:g} s (raise the rate or lower num_requests)")
    return t


@dataclass(frozen=True)
class SyntheticSpec:
    """A seeded synthetic workload: arrival process x prompt and output length specs."""

    rate: float = 4.0
    """Mean arrival rate, requests per second."""
    num_requests: int = 1000
    arrival: str = "poisson"
    """poisson | gamma | onoff."""
    burstiness: float = 1.0
    """Gamma shape for ``arrival=gamma`` (1 = Poisson, < 1 = burstier)."""
    on_s: float = 10.0
    off_s: float = 10.0
    prompt: str = "short-long"
    output: str = "lognormal:128:0.8:1024"
    sharing: str = "none"
    """Shared prefixes (``envs.sharing``): none, conversation:TURNS[:USERS] or
    agent:HIT[:PREFIXES]; ``prompt`` is then each request's own new text."""

    def __post_init__(self) -> None:
        """Scalars are checked here; the length specs when :meth:`build` parses them."""
        parse_sharing(self.sharing)
        check_rate("rate", self.rate)
        check_num_requests("num_requests", self.num_requests)
        require(self.arrival in ARRIVALS, "arrival", self.arrival, f"must be one of {', '.join(ARRIVALS)}")
        number("burstiness", self.burstiness, 1 / MAX_BURSTINESS, MAX_BURSTINESS)
        positive("on_s", self.on_s, MAX_SECONDS)
        non_negative("off_s", self.off_s, MAX_SECONDS)
        for name in ("prompt", "output"):
            spec = getattr(self, name)
            require(isinstance(spec, str) and bool(spec.strip()) and len(spec) <= MAX_SPEC_CHARS,
                    name, spec, f"must be a length spec of at most {MAX_SPEC_CHARS} characters "
                    f"({SPEC_FORMS})")

    def build(self, seed: int) -> Workload:
        integer("seed", seed)
        rng = np.random.default_rng(seed)
        t = arrival_times(rng, self.arrival, self.rate, self.num_requests, self.burstiness,
                          self.on_s, self.off_s)
        prompts = parse_lengths(self.prompt, "prompt", "prompt_tokens").sample(rng, self.num_requests)
        outputs = parse_lengths(self.output, "output", "output_tokens").sample(rng, self.num_requests)
        name = f"{self.arrival}@{self.rate:g}rps,{self.prompt},{self.output}"
        if self.sharing == "none":
            return Workload(t, prompts, outputs, name)
        prompts, ids, cover = share_prefixes(self.sharing, rng, prompts, outputs)
        return Workload(t, prompts, outputs, f"{name},{self.sharing}", ids, HASH_BLOCK_TOKENS, cover)
