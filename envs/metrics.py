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

Percentiles use numpy's default (linear interpolation), as vLLM's benchmark does;
ITL percentiles are computed over every token exactly, from per-pass weights,
without expanding millions of samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from envs.errors import positive


@dataclass(frozen=True)
class SLO:
    """A latency target pair (DESIGN.md's default: TTFT 2 s, ITL 100 ms)."""

    ttft_s: float = 2.0
    itl_s: float = 0.1

    def __post_init__(self) -> None:
        positive("slo ttft_s", self.ttft_s)
        positive("slo itl_s", self.itl_s)


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


@dataclass(frozen=True, eq=False)
class SimResult:
    """Everything a run produced, as arrays; :meth:`summary` aggregates."""

    # per request (warm-started requests excluded)
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    preemptions: np.ndarray
    max_gap_s: np.ndarray
    """Each request's worst gap between consecutive tokens (NaN with one token)."""
    # per pass
    pass_duration_s: np.ndarray
    pass_end_s: np.ndarray
    pass_decodes: np.ndarray
    pass_prefill_tokens: np.ndarray
    pass_budget: np.ndarray
    """The budget asked of the policy, -1 for passes that needed no decision."""
    kv_used_blocks: np.ndarray
    """Blocks in use after each pass (carried forward between recorded passes)."""
    kv_total_blocks: int
    resume_gaps_s: np.ndarray
    total_preemptions: int
    sim_time_s: float
    requests_total: int

    @classmethod
    def of(cls, sim) -> "SimResult":
        """Read a finished (or paused) simulator's requests and pass log."""
        reqs = [r for r in sim.requests if not r.warm]
        dur, decodes = sim.log.pass_records()
        P = len(dur)
        idle = np.zeros(P + 1)
        il = sim.log.idle_records()
        np.add.at(idle, il[:, 0].astype(np.int64), il[:, 1])
        end = np.cumsum(dur + idle[:P]) if P else np.zeros(0)
        prefill = np.zeros(P, dtype=np.int64)
        budget = np.full(P, -1, dtype=np.int64)
        pl = sim.log.prefill_records()
        prefill[pl[:, 0]] = pl[:, 1]
        budget[pl[:, 0]] = pl[:, 2]
        kv = np.zeros(P, dtype=np.int64)
        kl = sim.log.kv_records()
        if len(kl) and P:
            kv_idx = np.searchsorted(kl[:, 0], np.arange(P), side="right") - 1
            kv = np.where(kv_idx >= 0, kl[np.maximum(kv_idx, 0), 1], 0)
        max_gap, gaps = _worst_gaps(reqs, dur)

        def col(name, dtype=np.float64):
            return np.fromiter(map(attrgetter(name), reqs), dtype=dtype, count=len(reqs))

        return cls(
            arrival_s=col("arrival"), prompt_tokens=col("prompt", np.int64),
            output_tokens=col("output", np.int64), first_token_s=col("first_token_s"),
            finish_s=col("finish_s"), preemptions=col("preemptions", np.int64), max_gap_s=max_gap,
            pass_duration_s=dur, pass_end_s=end, pass_decodes=decodes,
            pass_prefill_tokens=prefill, pass_budget=budget, kv_used_blocks=kv,
            kv_total_blocks=sim.total_blocks, resume_gaps_s=np.asarray(gaps, dtype=np.float64),
            total_preemptions=sim.preemptions, sim_time_s=sim.now,
            requests_total=len(sim.workload))

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
        values = np.concatenate([self.pass_duration_s, self.resume_gaps_s])
        weights = np.concatenate([self.pass_decodes, np.ones(len(self.resume_gaps_s), np.int64)])
        return weighted_percentile(values, weights, q)

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
        ntok = int(self.pass_decodes.sum()) + len(self.resume_gaps_s)
        itl = self.itl_percentile([50, 90, 99]) if ntok else [math.nan] * 3
        itl_max = max(float(self.pass_duration_s[self.pass_decodes > 0].max(initial=-np.inf)),
                      float(self.resume_gaps_s.max(initial=-np.inf)))
        itl_mean = ((float(self.pass_duration_s @ self.pass_decodes) + float(self.resume_gaps_s.sum()))
                    / ntok if ntok else math.nan)
        start = float(self.arrival_s.min()) if len(self.arrival_s) else 0.0
        span = (float(np.nanmax(self.finish_s)) - start) if fin.any() else 0.0
        out_tok = int(self.output_tokens[fin].sum())
        good = self.meets_slo(slo)
        stall = (self.pass_prefill_tokens > 0) & (self.pass_decodes > 0)
        stall_d = self.pass_duration_s[stall]
        decided = self.pass_budget[self.pass_budget >= 0]
        n_fin = int(fin.sum())
        gaps = self.max_gap_s[fin]
        smooth = np.nan_to_num(gaps, nan=0.0) <= 2 * slo.itl_s
        kv = self.kv_used_blocks / self.kv_total_blocks
        t50, t90, t99 = _pcts(ttft, [50, 90, 99])
        tp50, tp99 = _pcts(tpot, [50, 99])
        e50, e99 = _pcts(e2el, [50, 99])
        return {
            "requests_total": self.requests_total,
            "requests_finished": n_fin,
            "passes": len(self.pass_duration_s),
            "sim_time_s": self.sim_time_s,
            "ttft_mean_s": _mean(ttft), "ttft_p50_s": t50, "ttft_p90_s": t90, "ttft_p99_s": t99,
            "itl_mean_s": itl_mean, "itl_p50_s": float(itl[0]), "itl_p90_s": float(itl[1]),
            "itl_p99_s": float(itl[2]), "itl_max_s": itl_max if ntok else math.nan,
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
            "stall_passes": int(stall.sum()),
            "stall_itl_mean_s": _mean(stall_d),
            "stall_itl_max_s": float(stall_d.max()) if len(stall_d) else math.nan,
            "stall_decode_tokens": int(self.pass_decodes[stall].sum()),
            "decision_passes": len(decided),
            "budget_mean": _mean(decided.astype(np.float64)),
            "prefill_passes_per_prompt_p95": _passes_per_prompt(self.prompt_tokens, decided),
            "kv_usage_mean": _mean(kv), "kv_usage_max": float(kv.max()) if len(kv) else math.nan,
        }


def _worst_gaps(reqs, dur: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Each request's worst gap (the longest pass among those it decoded in, or a resume
    gap; NaN with one token), and every resume gap."""
    seg_req, seg_lo, seg_hi, gaps = [], [], [], []
    for i, r in enumerate(reqs):
        for lo, hi in r.segments:
            seg_req.append(i)
            seg_lo.append(lo)
            seg_hi.append(hi)
        gaps.extend(r.resume_gaps)
    max_gap = np.full(len(reqs), -np.inf)
    if seg_req:
        padded = np.append(dur, 0.0)
        bounds = np.empty(2 * len(seg_lo), dtype=np.int64)
        bounds[0::2] = seg_lo
        bounds[1::2] = seg_hi
        seg_max = np.maximum.reduceat(padded, bounds)[0::2]
        np.maximum.at(max_gap, np.asarray(seg_req), seg_max)
    for i, r in enumerate(reqs):
        if r.resume_gaps:
            max_gap[i] = max(max_gap[i], max(r.resume_gaps))
    max_gap[np.isneginf(max_gap)] = np.nan
    return max_gap, gaps


def _passes_per_prompt(prompts: np.ndarray, budgets: np.ndarray) -> float:
    """DESIGN.md section 4: p95 prompt length over the (median) budget; 1 means no chunking."""
    if not len(prompts) or not len(budgets):
        return math.nan
    return float(math.ceil(np.percentile(prompts, 95) / np.median(budgets)))
