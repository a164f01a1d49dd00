"""Per-request and aggregate serving metrics, named as in vLLM's benchmark.

- TTFT: first token time minus arrival.
- ITL: the gap between two consecutive tokens of one request. Every decode token
  of a pass has that pass's duration as its ITL (passes run back to back while
  anything decodes); a request resumed after a preemption adds one sample, the
  whole gap from its last token before the preemption.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request.
- Goodput (vLLM bench, ``--goodput``): requests meeting every SLO threshold. The
  SLO pair here is (TTFT target, ITL target) and, as in vLLM, a request meets the
  ITL target when its TPOT does. ``goodput`` is that share of finished requests,
  ``goodput_rps`` the count per second of serving time.
- Smoothness: the share of requests whose worst gap stays within twice the ITL
  target (DESIGN.md section 4: p99 hides stalls).
- Generation stalls: passes that carried prefill while decodes were running.
- Slow passes (``slow_pass_share``): the share of passes with decodes running that took
  longer than the ITL target; with ``itl_max_s``, the worst gap, what an operator's cap
  on the longest pass bounds (``Scenario.max_pass_itl``).

Percentiles use numpy's default (linear interpolation), as vLLM's benchmark does;
ITL percentiles are computed over every token exactly, from per-pass weights,
without expanding millions of samples. TTFT, TPOT and end-to-end percentiles come from
the per-request columns; ITL ones from the run-length pass log, read a chunk of at most a
million passes at a time (:func:`chunked_weighted_percentile`), so a run of any length
is summarised in bounded memory with the same numbers. :class:`StreamingSummary` (a
summary-only simulator) folds the same figures in as the run goes, its percentiles from
log-bucketed histograms (within 0.05%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from envs import records
from envs.errors import MAX_SLO_ITL_S, MAX_SLO_TTFT_S, slo_seconds
from envs.prefix_cache import PrefixCounts
from envs.records import PassChunk, PassHistory


@dataclass(frozen=True)
class SLO:
    """A latency target pair (DESIGN.md's default: TTFT 2 s, ITL 100 ms)."""

    ttft_s: float = 2.0
    itl_s: float = 0.1

    def __post_init__(self) -> None:
        slo_seconds("slo_ttft_s", self.ttft_s, MAX_SLO_TTFT_S)
        slo_seconds("slo_itl_s", self.itl_s, MAX_SLO_ITL_S)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q) -> np.ndarray | float:
    """``np.percentile(np.repeat(values, weights), q)`` without the repeat."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.int64)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    scalar = np.ndim(q) == 0
    qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
    if not len(values):
        out = np.full(len(qs), math.nan)
        return float(out[0]) if scalar else out
    order = np.argsort(values)
    v = values[order]
    cum = np.cumsum(weights[order])  # cum[i] - 1 is the last expanded index of v[i]
    n = int(cum[-1])
    h = (n - 1) * qs / 100.0
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    v_lo = v[np.searchsorted(cum, lo, side="right")]
    v_hi = v[np.searchsorted(cum, hi, side="right")]
    out = v_lo + (h - lo) * (v_hi - v_lo)
    return float(out[0]) if scalar else out


def _pcts(x: np.ndarray, qs: list[float]) -> list[float]:
    return [float(v) for v in np.percentile(x, qs)] if len(x) else [math.nan] * len(qs)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else math.nan


def chunked_weighted_percentile(source, q) -> np.ndarray | float:
    """:func:`weighted_percentile` over values that come in chunks, ``source()`` giving a
    fresh iterator of (values, weights) pairs: the same numbers, without holding every
    value at once. Values must be >= 0 (durations), so that their float64 bit patterns sort
    as int64: two counting passes over 65,536 buckets find the top 32 bits of each order
    statistic, a third collects the few values that share them."""
    scalar = np.ndim(q) == 0
    qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
    n = sum(int(w[w > 0].sum()) for _, w in source())
    if not n:
        out = np.full(len(qs), math.nan)
        return float(out[0]) if scalar else out
    h = (n - 1) * qs / 100.0
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    found = _order_statistics(source, sorted(set(lo.tolist()) | set(hi.tolist())))
    v_lo = np.array([found[k] for k in lo.tolist()])
    v_hi = np.array([found[k] for k in hi.tolist()])
    out = v_lo + (h - lo) * (v_hi - v_lo)
    return float(out[0]) if scalar else out


def _bits(source):
    for v, w in source():
        keep = w > 0
        out = np.ascontiguousarray(v[keep], dtype=np.float64).view(np.int64), w[keep]
        del v, w, keep  # one chunk alive at a time
        yield out


def _order_statistics(source, ranks: list[int]) -> dict[int, float]:
    """The value of rank k (0-based, in the weighted order) for each k in ``ranks``."""
    targets = {k: (0, k) for k in ranks}  # rank -> (known top bits, rank among values sharing them)
    for shift in (48, 32):
        hists: dict[int, np.ndarray] = {}
        prefixes = {p for p, _ in targets.values()}
        for bits, w in _bits(source):
            for p in prefixes:
                sel = slice(None) if shift == 48 else (bits >> 48) == p
                hist = np.bincount((bits[sel] >> shift) & 0xFFFF, weights=w[sel], minlength=1 << 16)
                hists[p] = hists[p] + hist if p in hists else hist
        for k, (p, r) in list(targets.items()):
            cum = np.cumsum(hists[p])
            b = int(np.searchsorted(cum, r, side="right"))
            targets[k] = ((p << 16) | b, r - (int(cum[b - 1]) if b else 0))
    prefixes = {p for p, _ in targets.values()}
    parts: dict[int, list] = {p: [] for p in prefixes}
    for bits, w in _bits(source):
        for p in prefixes:
            sel = (bits >> 32) == p
            if sel.any():
                vals, inv = np.unique(bits[sel], return_inverse=True)
                parts[p].append((vals, np.bincount(inv, weights=w[sel])))
    found = {}
    for k, (p, r) in targets.items():
        vals = np.concatenate([v for v, _ in parts[p]])
        weights = np.concatenate([c for _, c in parts[p]])
        uniq, inv = np.unique(vals, return_inverse=True)
        cum = np.cumsum(np.bincount(inv, weights=weights))
        found[k] = float(uniq[int(np.searchsorted(cum, r, side="right"))].view(np.float64))
    return found


@dataclass(frozen=True, eq=False)
class SimResult:
    """Everything a run produced: per-request arrays, and the pass log as run-length records
    (:class:`envs.records.PassHistory`) that :meth:`summary` reads in chunks. The per-pass
    arrays (``pass_duration_s`` and the rest) are expanded on first use."""

    # per request (warm-started requests excluded), in arrival order
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    preemptions: np.ndarray
    max_gap_s: np.ndarray
    """Each request's worst gap between consecutive tokens (NaN with one token)."""
    resume_gaps_s: np.ndarray
    """Every resumption's whole wait after a preemption, by request then in order."""
    history: PassHistory
    kv_total_blocks: int
    total_preemptions: int
    sim_time_s: float
    requests_total: int
    prefix_counts: PrefixCounts | None = None
    """With prefix caching: ``Simulator.prefix_counts`` (read by :func:`prefix_figures`)."""

    @classmethod
    def of(cls, sim) -> "SimResult":
        """Read a finished (or paused) simulator's requests and pass log."""
        cols = sim.requests.columns()
        warm = cols.pop("warm")
        if warm.any():  # warm-started requests are left out (no copies when there are none)
            keep = ~warm
            cols = {k: v[keep] for k, v in cols.items() if not k.startswith("resume")} | {
                "resume_gap_s": cols["resume_gap_s"][keep[cols["resume_position"]]]}
        max_gap = cols["max_gap_s"]
        max_gap[np.isneginf(max_gap)] = np.nan
        return cls(
            arrival_s=cols["arrival"], prompt_tokens=cols["prompt"], output_tokens=cols["output"],
            first_token_s=cols["first_token_s"], finish_s=cols["finish_s"],
            preemptions=cols["preemptions"].astype(np.int64), max_gap_s=max_gap,
            resume_gaps_s=cols["resume_gap_s"], history=sim.log.history(),
            kv_total_blocks=sim.total_blocks, total_preemptions=sim.preemptions, sim_time_s=sim.now,
            requests_total=len(sim.workload),
            prefix_counts=replace(sim.prefix_counts) if sim._prefix is not None else None)

    # --- per pass (expanded on first use) ------------------------------------------------

    @cached_property
    def _passes(self) -> PassChunk:
        h = self.history
        return next(h.chunks(max(h.passes, 1)), PassChunk(0, np.zeros(0), *[np.zeros(0, np.int64)] * 4))

    def _chunks(self):
        """The passes chunk by chunk; a short run's one chunk is the cached full expansion."""
        if self.history.passes <= records.CHUNK_PASSES:
            return iter([self._passes] if self.history.passes else [])
        return self.history.chunks(records.CHUNK_PASSES)

    @property
    def pass_duration_s(self) -> np.ndarray:
        return self._passes.duration_s

    @property
    def pass_decodes(self) -> np.ndarray:
        return self._passes.decodes

    @property
    def pass_prefill_tokens(self) -> np.ndarray:
        return self._passes.prefill_tokens

    @property
    def pass_budget(self) -> np.ndarray:
        """The budget asked of the policy, -1 for passes that needed no decision."""
        return self._passes.budget

    @property
    def kv_used_blocks(self) -> np.ndarray:
        """Blocks in use after each pass (carried forward between recorded passes)."""
        return self._passes.kv_blocks

    @cached_property
    def pass_end_s(self) -> np.ndarray:
        dur = self.pass_duration_s
        P = len(dur)
        idle = np.zeros(P + 1)
        il = np.concatenate(self.history.idle) if self.history.idle else np.zeros((0, 2))
        np.add.at(idle, il[:, 0].astype(np.int64) - self.history.first_pass, il[:, 1])
        return np.cumsum(dur + idle[:P]) if P else np.zeros(0)

    # --- derived per request --------------------------------------------------------

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.finish_s)

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """Per request; NaN for single-token outputs, as vLLM's benchmark skips them."""
        with np.errstate(invalid="ignore", divide="ignore"):
            t = (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
        return np.where(self.output_tokens > 1, t, np.nan)

    def itl_percentile(self, q) -> np.ndarray | float:
        """Exact ITL percentiles over every token: in one go when the run has at most
        ``records.CHUNK_PASSES`` passes, else chunk by chunk (the same numbers)."""
        ones = np.ones(len(self.resume_gaps_s), np.int64)
        if self.history.passes <= records.CHUNK_PASSES:
            c = self._passes
            return weighted_percentile(np.concatenate([c.duration_s, self.resume_gaps_s]),
                                       np.concatenate([c.decodes, ones]), q)

        def source():
            for c in self._chunks():
                d, n = c.duration_s, c.decodes
                del c
                yield d, n
            yield self.resume_gaps_s, ones
        return chunked_weighted_percentile(source, q)

    def pass_stats(self, itl_s: float = math.inf) -> dict:
        """Per-pass aggregates, read chunk by chunk (one chunk: the same arithmetic as on
        full arrays; several: sums add up chunk sums); ``slow``: passes with decodes that
        took longer than ``itl_s``."""
        h = self.history
        chunks = 0
        out = dict(ntok=0, dot=0.0, itl_max=-np.inf, stall=0, stall_tokens=0, kv_sum=0.0,
                   kv_max=-np.inf, kv_mean=math.nan, decoding=0, slow=0)
        stall_d, decided = [], []
        for c in self._chunks():
            chunks += 1
            dec, d = c.decodes, c.duration_s
            out["ntok"] += int(dec.sum())
            out["dot"] += float(d @ dec)
            out["itl_max"] = max(out["itl_max"], float(d[dec > 0].max(initial=-np.inf)))
            out["decoding"] += int((dec > 0).sum())
            out["slow"] += int(((dec > 0) & (d > itl_s)).sum())
            stall = (c.prefill_tokens > 0) & (dec > 0)
            out["stall"] += int(stall.sum())
            out["stall_tokens"] += int(dec[stall].sum())
            stall_d.append(d[stall])
            decided.append(c.budget[c.budget >= 0])
            kv = c.kv_blocks / self.kv_total_blocks
            out["kv_mean"] = _mean(kv)
            out["kv_sum"] += float(kv.sum())
            out["kv_max"] = max(out["kv_max"], float(kv.max()))
            del c, dec, d, stall, kv  # one chunk alive at a time
        if chunks > 1:
            out["kv_mean"] = out["kv_sum"] / h.passes
        out["stall_d"] = np.concatenate(stall_d) if stall_d else np.zeros(0)
        out["decided"] = np.concatenate(decided) if decided else np.zeros(0, np.int64)
        return out

    def meets_slo(self, slo: SLO) -> np.ndarray:
        tpot = np.nan_to_num(self.tpot_s, nan=0.0)
        return self.finished & (self.ttft_s <= slo.ttft_s) & (tpot <= slo.itl_s)

    # --- aggregate -------------------------------------------------------------------

    def summary(self, slo: SLO | None = None) -> dict:
        """Aggregate metrics (seconds, tokens, shares); key names follow vLLM's benchmark."""
        slo = slo or SLO()
        fin = self.finished
        ttft = self.ttft_s[~np.isnan(self.first_token_s)]
        tpot = self.tpot_s[fin]
        tpot = tpot[~np.isnan(tpot)]
        e2el = self.e2el_s[fin]
        ps = self.pass_stats(slo.itl_s)
        ntok = ps["ntok"] + len(self.resume_gaps_s)
        itl = self.itl_percentile([50, 90, 99]) if ntok else [math.nan] * 3
        itl_max = max(ps["itl_max"], float(self.resume_gaps_s.max(initial=-np.inf)))
        itl_mean = (ps["dot"] + float(self.resume_gaps_s.sum())) / ntok if ntok else math.nan
        start = float(self.arrival_s.min()) if len(self.arrival_s) else 0.0
        span = (float(np.nanmax(self.finish_s)) - start) if fin.any() else 0.0
        out_tok = int(self.output_tokens[fin].sum())
        good = self.meets_slo(slo)
        stall_d = ps["stall_d"]
        decided = ps["decided"]
        n_fin = int(fin.sum())
        gaps = self.max_gap_s[fin]
        smooth = np.nan_to_num(gaps, nan=0.0) <= 2 * slo.itl_s
        t50, t90, t99 = _pcts(ttft, [50, 90, 99])
        tp50, tp99 = _pcts(tpot, [50, 99])
        e50, e99 = _pcts(e2el, [50, 99])
        return {
            "requests_total": self.requests_total,
            "requests_finished": n_fin,
            "passes": self.history.passes,
            "sim_time_s": self.sim_time_s,
            "ttft_mean_s": _mean(ttft), "ttft_p50_s": t50, "ttft_p90_s": t90, "ttft_p99_s": t99,
            "itl_mean_s": itl_mean, "itl_p50_s": float(itl[0]), "itl_p90_s": float(itl[1]),
            "itl_p99_s": float(itl[2]), "itl_max_s": itl_max if ntok else math.nan,
            "slow_pass_share": ps["slow"] / ps["decoding"] if ps["decoding"] else math.nan,
            "tpot_mean_s": _mean(tpot), "tpot_p50_s": tp50, "tpot_p99_s": tp99,
            "e2el_p50_s": e50, "e2el_p99_s": e99,
            "throughput_tok_s": out_tok / span if span > 0 else math.nan,
            "request_throughput_rps": n_fin / span if span > 0 else math.nan,
            "output_tokens": out_tok,
            "goodput": float(good.sum()) / n_fin if n_fin else math.nan,
            "goodput_rps": float(good.sum()) / span if span > 0 else math.nan,
            "slo_ttft_s": slo.ttft_s, "slo_itl_s": slo.itl_s,
            "smooth_share": float(smooth.sum()) / n_fin if n_fin else math.nan,
            "preemptions": self.total_preemptions,
            "preempted_requests": int((self.preemptions > 0).sum()),
            "stall_passes": ps["stall"],
            "stall_itl_mean_s": _mean(stall_d),
            "stall_itl_max_s": float(stall_d.max()) if len(stall_d) else math.nan,
            "stall_decode_tokens": ps["stall_tokens"],
            "decision_passes": len(decided),
            "budget_mean": _mean(decided.astype(np.float64)),
            "prefill_passes_per_prompt_p95": _passes_per_prompt(self.prompt_tokens, decided),
            "kv_usage_mean": ps["kv_mean"],
            "kv_usage_max": ps["kv_max"] if self.history.passes else math.nan,
        } | prefix_figures(self.prefix_counts, len(decided))


def prefix_figures(counts: PrefixCounts | None, prefill_passes: int) -> dict:
    """Prefix caching's figures from ``Simulator.prefix_counts`` (none without it): the
    share of requests whose first admission hit a cached prefix and the share of their
    prompt tokens it covered; cached tokens per pass with prefill; prefill tokens not
    computed (every admission's hit, recomputations after a preemption included) and their
    share of all prefill the passes would have computed without them."""
    if counts is None:
        return {}
    first, hit, prompt = counts.first_admissions, counts.hit_admissions, counts.first_prompt_tokens
    cached_first, cached_all = counts.first_cached_tokens, counts.cached_tokens
    return {
        "prefix_hit_rate_requests": hit / first if first else math.nan,
        "prefix_hit_rate_tokens": cached_first / prompt if prompt else math.nan,
        "prefix_cached_tokens_per_pass": cached_all / prefill_passes if prefill_passes else math.nan,
        "prefill_tokens_saved": cached_all,
    }


def _passes_per_prompt(prompts: np.ndarray, budgets: np.ndarray) -> float:
    """DESIGN.md section 4: p95 prompt length over the (median) budget; 1 means no chunking."""
    if not len(prompts) or not len(budgets):
        return math.nan
    return float(math.ceil(np.percentile(prompts, 95) / np.median(budgets)))


# --- summaries in flat memory -------------------------------------------------------------

class LogHistogram:
    """Weighted values >= 0 in buckets 2^-10 wide in relative terms (the top 22 bits of their
    float64 bit patterns): memory grows with the range the values span, not their number.
    A percentile reads each order statistic as its bucket's middle (within 0.05%)."""

    SHIFT = 42

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        values = np.asarray(values, dtype=np.float64)
        if weights is not None:
            keep = np.asarray(weights) > 0
            values, weights = values[keep], np.asarray(weights)[keep]
        if not len(values):
            return
        keys, inv = np.unique(np.ascontiguousarray(values).view(np.int64) >> self.SHIFT,
                              return_inverse=True)
        totals = np.bincount(inv, weights=weights, minlength=len(keys))
        counts = self.counts
        for k, c in zip(keys.tolist(), totals.tolist()):
            counts[k] = counts.get(k, 0) + int(c)

    def copy(self) -> "LogHistogram":
        h = LogHistogram()
        h.counts = dict(self.counts)
        return h

    def percentile(self, qs: list[float]) -> list[float]:
        if not self.counts:
            return [math.nan] * len(qs)
        keys = np.array(sorted(self.counts), dtype=np.int64)
        low = (keys << self.SHIFT).view(np.float64)
        high = (((keys + 1) << self.SHIFT) - 1).view(np.float64)
        mid = low + (high - low) / 2  # each bucket stands for its middle
        counts = np.array([self.counts[k] for k in keys.tolist()], dtype=np.int64)
        return [float(v) for v in np.atleast_1d(weighted_percentile(mid, counts, list(qs)))]


class StreamingSummary:
    """:meth:`SimResult.summary`'s figures, folded in as requests finish and passes are filed
    away, in memory that does not grow with the run (``Simulator(summary_only=SLO)``).

    Exact: counts, token totals, maxima, goodput, smoothness, preemptions, the median
    budget; sums and means up to float rounding (added batch by batch). Approximate, within
    0.05%: the percentiles of TTFT, TPOT, end-to-end latency and ITL (:class:`LogHistogram`).
    """

    def __init__(self, slo: SLO, kv_total_blocks: int) -> None:
        self.slo, self.kv_total_blocks = slo, kv_total_blocks
        self.hist = {k: LogHistogram() for k in ("ttft", "tpot", "e2el", "itl")}
        self.n = dict(ttft=0, tpot=0, finished=0, good=0, smooth=0, preempted=0, output=0, ntok=0,
                      passes=0, stall=0, stall_tokens=0, decided=0, decoding=0, slow=0)
        self.sum = dict(ttft=0.0, tpot=0.0, itl=0.0, stall=0.0, budget=0.0, kv=0.0)
        self.max = dict(itl=-math.inf, stall=-math.inf, kv=-math.inf, finish=-math.inf)
        self.first_arrival = math.inf
        self.budgets: dict[int, int] = {}
        self.kv_last = 0

    def copy(self) -> "StreamingSummary":
        c = StreamingSummary(self.slo, self.kv_total_blocks)
        c.hist = {k: h.copy() for k, h in self.hist.items()}
        c.n, c.sum, c.max, c.budgets = dict(self.n), dict(self.sum), dict(self.max), dict(self.budgets)
        c.first_arrival, c.kv_last = self.first_arrival, self.kv_last
        return c

    def add_requests(self, cols: dict, resumes: np.ndarray) -> None:
        """Requests (``RequestBook`` columns; warm-started ones are left out) and their
        resume gaps, rows of (position, gap)."""
        warm = np.asarray(cols["warm"], dtype=bool)
        warm_pos = set(np.asarray(cols["position"])[warm].astype(np.int64).tolist())
        if len(resumes):
            gaps = resumes[[int(p) not in warm_pos for p in resumes[:, 0]], 1] if warm_pos else resumes[:, 1]
            self._itl(gaps, np.ones(len(gaps), dtype=np.int64))
        keep = ~warm
        arrival, first, finish = cols["arrival"][keep], cols["first_token_s"][keep], cols["finish_s"][keep]
        output, gap = cols["output"][keep], cols["max_gap_s"][keep]
        if not len(arrival):
            return
        self.first_arrival = min(self.first_arrival, float(arrival.min()))
        started = ~np.isnan(first)
        ttft = first - arrival
        self._values("ttft", ttft[started])
        fin = ~np.isnan(finish)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(output > 1, (finish - first) / (output - 1), np.nan)
        self._values("tpot", tpot[fin & ~np.isnan(tpot)])
        self.hist["e2el"].add((finish - arrival)[fin])
        self.n["finished"] += int(fin.sum())
        self.n["output"] += int(output[fin].sum())
        self.max["finish"] = max(self.max["finish"], float(finish[fin].max(initial=-np.inf)))
        ok = fin & (ttft <= self.slo.ttft_s) & (np.nan_to_num(tpot, nan=0.0) <= self.slo.itl_s)
        self.n["good"] += int(ok.sum())
        gap = np.where(np.isneginf(gap), np.nan, gap)
        self.n["smooth"] += int((np.nan_to_num(gap[fin], nan=0.0) <= 2 * self.slo.itl_s).sum())
        self.n["preempted"] += int((cols["preemptions"][keep] > 0).sum())

    def _values(self, name: str, values: np.ndarray) -> None:
        self.hist[name].add(values)
        self.n[name] += len(values)
        self.sum[name] += float(values.sum())

    def _itl(self, values: np.ndarray, weights: np.ndarray) -> None:
        self.hist["itl"].add(values, weights)
        self.n["ntok"] += int(weights.sum())
        self.sum["itl"] += float(values @ weights)
        if len(values) and (weights > 0).any():
            self.max["itl"] = max(self.max["itl"], float(values[weights > 0].max()))

    def add_passes(self, history: PassHistory) -> None:
        for c in history.chunks(records.CHUNK_PASSES, self.kv_last):
            d, dec = c.duration_s, c.decodes
            self.n["passes"] += len(d)
            self._itl(d, dec)
            self.n["decoding"] += int((dec > 0).sum())
            self.n["slow"] += int(((dec > 0) & (d > self.slo.itl_s)).sum())
            stall = (c.prefill_tokens > 0) & (dec > 0)
            self.n["stall"] += int(stall.sum())
            self.n["stall_tokens"] += int(dec[stall].sum())
            self.sum["stall"] += float(d[stall].sum())
            self.max["stall"] = max(self.max["stall"], float(d[stall].max(initial=-np.inf)))
            decided = c.budget[c.budget >= 0]
            self.n["decided"] += len(decided)
            self.sum["budget"] += float(decided.sum())
            for b, k in zip(*np.unique(decided, return_counts=True)):
                self.budgets[int(b)] = self.budgets.get(int(b), 0) + int(k)
            kv = c.kv_blocks / self.kv_total_blocks
            self.sum["kv"] += float(kv.sum())
            self.max["kv"] = max(self.max["kv"], float(kv.max()))
            self.kv_last = int(c.kv_blocks[-1])

    def _median_budget(self) -> float:
        keys = sorted(self.budgets)
        return float(weighted_percentile(np.array(keys), np.array([self.budgets[k] for k in keys]), 50))

    def summary(self, requests_total: int, prompts: np.ndarray, sim_time_s: float,
                total_preemptions: int) -> dict:
        """The same keys as :meth:`SimResult.summary`."""
        n, sm, mx = self.n, self.sum, self.max
        fin = n["finished"]
        span = mx["finish"] - self.first_arrival if fin else 0.0
        t50, t90, t99 = self.hist["ttft"].percentile([50, 90, 99])
        tp50, tp99 = self.hist["tpot"].percentile([50, 99])
        e50, e99 = self.hist["e2el"].percentile([50, 99])
        i50, i90, i99 = self.hist["itl"].percentile([50, 90, 99])
        ntok = n["ntok"]
        p95 = (float(math.ceil(np.percentile(prompts, 95) / self._median_budget()))
               if len(prompts) and self.budgets else math.nan)
        return {
            "requests_total": requests_total, "requests_finished": fin, "passes": n["passes"],
            "sim_time_s": sim_time_s,
            "ttft_mean_s": sm["ttft"] / n["ttft"] if n["ttft"] else math.nan,
            "ttft_p50_s": t50, "ttft_p90_s": t90, "ttft_p99_s": t99,
            "itl_mean_s": sm["itl"] / ntok if ntok else math.nan,
            "itl_p50_s": i50, "itl_p90_s": i90, "itl_p99_s": i99,
            "itl_max_s": mx["itl"] if ntok else math.nan,
            "slow_pass_share": n["slow"] / n["decoding"] if n["decoding"] else math.nan,
            "tpot_mean_s": sm["tpot"] / n["tpot"] if n["tpot"] else math.nan,
            "tpot_p50_s": tp50, "tpot_p99_s": tp99, "e2el_p50_s": e50, "e2el_p99_s": e99,
            "throughput_tok_s": n["output"] / span if span > 0 else math.nan,
            "request_throughput_rps": fin / span if span > 0 else math.nan,
            "output_tokens": n["output"],
            "goodput": n["good"] / fin if fin else math.nan,
            "goodput_rps": n["good"] / span if span > 0 else math.nan,
            "slo_ttft_s": self.slo.ttft_s, "slo_itl_s": self.slo.itl_s,
            "smooth_share": n["smooth"] / fin if fin else math.nan,
            "preemptions": total_preemptions, "preempted_requests": n["preempted"],
            "stall_passes": n["stall"],
            "stall_itl_mean_s": sm["stall"] / n["stall"] if n["stall"] else math.nan,
            "stall_itl_max_s": mx["stall"] if n["stall"] else math.nan,
            "stall_decode_tokens": n["stall_tokens"], "decision_passes": n["decided"],
            "budget_mean": sm["budget"] / n["decided"] if n["decided"] else math.nan,
            "prefill_passes_per_prompt_p95": p95,
            "kv_usage_mean": sm["kv"] / n["passes"] if n["passes"] else math.nan,
            "kv_usage_max": mx["kv"] if n["passes"] else math.nan,
        }


class StreamedResult:
    """What a summary-only simulator returns: :meth:`summary` under the SLO it was built for."""

    def __init__(self, sim) -> None:
        self.sim = sim

    def summary(self, slo: SLO | None = None) -> dict:
        sim = self.sim
        stream: StreamingSummary = sim.stream
        if slo is not None and (slo.ttft_s, slo.itl_s) != (stream.slo.ttft_s, stream.slo.itl_s):
            raise ValueError(f"this simulator summarises under {stream.slo}, not {slo}")
        sim.requests.flush()
        final = stream.copy()  # the records still held (the last passes, live requests) fold into a copy
        final.add_passes(sim.log.history())
        live, resumes = sim.requests.live_columns()
        final.add_requests(live, resumes)
        out = final.summary(len(sim.workload), sim.workload.prompt_tokens, sim.now, sim.preemptions)
        return out | prefix_figures(replace(sim.prefix_counts) if sim._prefix is not None else None,
                                    out["decision_passes"])
