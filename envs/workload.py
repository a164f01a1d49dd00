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

import csv
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from envs.errors import ConfigError, non_negative, positive, positive_int, require

TRACE_HEADER = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests sorted by arrival. Arrays are read-only; times in seconds from 0."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    name: str = "workload"

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        require(len(self.prompt_tokens) == n and len(self.output_tokens) == n, "workload", n,
                "arrival_s, prompt_tokens and output_tokens must have the same length")
        for arr in (self.arrival_s, self.prompt_tokens, self.output_tokens):
            arr.setflags(write=False)
        if n:
            require(bool(np.all(np.isfinite(self.arrival_s))) and self.arrival_s.min() >= 0,
                    "arrival_s", "NaN/inf/negative", "must be finite and >= 0")
            require(bool(np.all(np.diff(self.arrival_s) >= 0)), "arrival_s", "unsorted",
                    "must be sorted ascending")
            require(self.prompt_tokens.min() >= 1, "prompt_tokens", int(self.prompt_tokens.min()),
                    "must be >= 1")
            require(self.output_tokens.min() >= 1, "output_tokens", int(self.output_tokens.min()),
                    "must be >= 1")

    @classmethod
    def from_arrays(cls, arrival_s, prompt_tokens, output_tokens, name: str = "workload") -> "Workload":
        return cls(np.array(arrival_s, dtype=np.float64), np.array(prompt_tokens, dtype=np.int64),
                   np.array(output_tokens, dtype=np.int64), name)

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
        positive("rate_scale", rate_scale)
        return Workload(self.arrival_s / rate_scale, self.prompt_tokens.copy(),
                        self.output_tokens.copy(), f"{self.name}x{rate_scale:g}")

    def window(self, start_s: float = 0.0, end_s: float | None = None) -> "Workload":
        """Requests arriving in [start_s, end_s), re-based so the window starts at 0."""
        non_negative("window start_s", start_s)
        if end_s is not None:
            require(end_s > start_s, "window end_s", end_s, f"must be > start_s ({start_s})")
        lo = int(np.searchsorted(self.arrival_s, start_s, side="left"))
        hi = len(self) if end_s is None else int(np.searchsorted(self.arrival_s, end_s, side="left"))
        return Workload(self.arrival_s[lo:hi] - start_s, self.prompt_tokens[lo:hi].copy(),
                        self.output_tokens[lo:hi].copy(), f"{self.name}[{start_s:g}:{end_s}]")

    def head(self, n: int) -> "Workload":
        return Workload(self.arrival_s[:n].copy(), self.prompt_tokens[:n].copy(),
                        self.output_tokens[:n].copy(), f"{self.name}[:{n}]")

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
    p = Path(path)
    if not p.exists() and (BUNDLED_TRACES / f"{p.stem}.csv").exists() and p.parent == Path("."):
        return BUNDLED_TRACES / f"{p.stem}.csv"
    return p


def load_trace(path: str | Path, rate_scale: float = 1.0, start_s: float = 0.0,
               end_s: float | None = None, max_requests: int | None = None) -> Workload:
    """Read an ``arrival_s,prompt_tokens,output_tokens`` CSV (or a bundled trace by name,
    see :func:`bundled_traces`); every bad row is reported with its line number."""
    path = resolve_trace(path)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    w = _read_trace(path, stamp)
    if start_s or end_s is not None:
        w = w.window(start_s, end_s)
    if rate_scale != 1.0:
        w = w.scaled(rate_scale)
    if max_requests is not None:
        positive_int("max_requests", max_requests)
        w = w.head(max_requests)
    if not len(w):
        raise ConfigError(f"trace {str(path)!r}: the window [{start_s}, {end_s}) holds no request")
    return w


@lru_cache(maxsize=16)
def _read_trace(path: Path, stamp: int | None) -> Workload:
    """The whole file, parsed once per (path, modification time): capacity searches
    replay the same trace hundreds of times. Workload arrays are read-only, so the
    cached copy is shared safely."""
    try:
        fh = path.open(newline="")
    except OSError as err:
        raise ConfigError(f"trace: cannot read {str(path)!r} ({err.strerror}); bundled traces: "
                          f"{', '.join(bundled_traces())}")
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header[:3]) != TRACE_HEADER:
            raise ConfigError(f"trace {str(path)!r} line 1: header must start with "
                              f"{','.join(TRACE_HEADER)}, got {','.join(header or [])!r}")
        last = 0.0
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < 3:
                raise ConfigError(f"trace {str(path)!r} line {line}: expected 3 fields, got {len(row)}")
            try:
                a = float(row[0])
            except ValueError:
                a = math.nan
            if not (math.isfinite(a) and a >= 0):
                raise ConfigError(f"trace {str(path)!r} line {line}: arrival_s: got {row[0]!r}, "
                                  "must be a finite number >= 0")
            if a < last:
                raise ConfigError(f"trace {str(path)!r} line {line}: arrival_s: got {a}, must be "
                                  f">= the previous row's {last} (rows sorted by arrival)")
            last = a
            vals = []
            for col, raw in zip(TRACE_HEADER[1:], row[1:3]):
                try:
                    v = int(raw)
                except ValueError:
                    v = 0
                if v < 1:
                    raise ConfigError(f"trace {str(path)!r} line {line}: {col}: got {raw!r}, "
                                      "must be an integer >= 1")
                vals.append(v)
            arrivals.append(a)
            prompts.append(vals[0])
            outputs.append(vals[1])
    if not arrivals:
        raise ConfigError(f"trace {str(path)!r}: no requests after the header")
    return Workload.from_arrays(arrivals, prompts, outputs, name=path.stem)


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


def parse_lengths(spec: str, field_name: str = "lengths", column: str = "prompt_tokens") -> LengthDist:
    """Parse a length spec (see the module docstring)."""
    require(isinstance(spec, str) and bool(spec), field_name, spec,
            "must be fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA, empirical:PATH, mix:..., "
            f"or one of {', '.join(NAMED_LENGTHS)}")
    spec = NAMED_LENGTHS.get(spec, spec)
    kind, _, rest = spec.partition(":")
    try:
        if kind == "mix":
            weights, parts = [], []
            for term in rest.split("+"):
                w, _, sub = term.partition("*")
                weights.append(float(w))
                parts.append(parse_lengths(sub, field_name, column))
            require(all(w > 0 for w in weights), field_name, spec, "mixture weights must be > 0")
            return Mixture(tuple(weights), tuple(parts))
        args = rest.split(":") if rest else []
        if kind == "fixed" and len(args) == 1:
            n = int(args[0])
            require(n >= 1, field_name, spec, "fixed:N needs N >= 1")
            return Fixed(n)
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            require(1 <= lo <= hi, field_name, spec, "uniform:LO:HI needs 1 <= LO <= HI")
            return Uniform(lo, hi)
        if kind == "lognormal" and len(args) in (2, 3):
            med, sig = float(args[0]), float(args[1])
            mx = int(args[2]) if len(args) == 3 else 32768
            require(med >= 1 and sig >= 0 and mx >= 1, field_name, spec,
                    "lognormal:MEDIAN:SIGMA[:MAX] needs MEDIAN >= 1, SIGMA >= 0, MAX >= 1")
            return LogNormal(med, sig, mx)
        if kind == "empirical" and args:
            col = column
            path = rest
            if args[-1] in TRACE_HEADER[1:]:
                col = args[-1]
                path = ":".join(args[:-1])
            return Empirical(tuple(int(v) for v in _trace_column(path, col)), f"{path}:{col}")
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{field_name}: got {spec!r}, numbers in it do not parse ({err})")
    raise ConfigError(f"{field_name}: got {spec!r}, must be fixed:N, uniform:LO:HI, "
                      "lognormal:MEDIAN:SIGMA[:MAX], empirical:PATH[:COLUMN], mix:W*SPEC+W*SPEC, "
                      f"or one of {', '.join(NAMED_LENGTHS)}")


# --- Arrival processes ----------------------------------------------------------------

def arrival_times(rng: np.random.Generator, process: str, rate: float, n: int,
                  burstiness: float = 1.0, on_s: float = 10.0, off_s: float = 10.0) -> np.ndarray:
    """``n`` sorted arrival times (first at its own gap after 0, then shifted to start at 0).

    - ``poisson``: exponential gaps at ``rate`` per second.
    - ``gamma``: gamma gaps with shape ``burstiness`` and mean 1/rate (vLLM bench's
      convention: 1.0 is Poisson, below 1 is burstier, above 1 is smoother).
    - ``onoff``: Poisson during ``on_s``-second bursts separated by ``off_s`` seconds of
      silence, at the rate that keeps the long-run mean at ``rate``.
    """
    positive("rate", rate)
    positive_int("num_requests", n)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif process == "gamma":
        positive("burstiness", burstiness)
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    elif process == "onoff":
        positive("on_s", on_s)
        non_negative("off_s", off_s)
        on_rate = rate * (on_s + off_s) / on_s
        busy = np.cumsum(rng.exponential(1.0 / on_rate, size=n))  # time spent in "on" periods
        wall = busy + np.floor(busy / on_s) * off_s  # insert an off period after each on period
        return wall - wall[0]
    else:
        raise ConfigError(f"arrival: got {process!r}, must be one of poisson, gamma, onoff")
    t = np.cumsum(gaps)
    return t - t[0]


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

    def build(self, seed: int) -> Workload:
        rng = np.random.default_rng(seed)
        t = arrival_times(rng, self.arrival, self.rate, self.num_requests, self.burstiness,
                          self.on_s, self.off_s)
        prompts = parse_lengths(self.prompt, "prompt", "prompt_tokens").sample(rng, self.num_requests)
        outputs = parse_lengths(self.output, "output", "output_tokens").sample(rng, self.num_requests)
        name = f"{self.arrival}@{self.rate:g}rps,{self.prompt},{self.output}"
        return Workload(t, prompts, outputs, name)
