"""What a learned policy observes before a pass, and its inverse (pure: no gymnasium).

:func:`observe` is a function of the scheduler's state alone (``envs.state``'s
quantities and the engine's cost model), so a trained model can drive a simulator
outside the environment, or a real engine that counts the same quantities; the table in
:class:`envs.chunk_budget_env.ChunkBudgetEnv`'s docstring gives every entry and its
scaling.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from envs.deployment import deployment, scaled
from envs.metrics import SLO
from envs.pricing import chunk_within, decode_pass_s, prefill_due_s, queue_done_s
from envs.slack import SLACK_PASSES_TOP

OBSERVATION_FIELDS = (
    "running_decodes", "waiting_requests", "waiting_prefill_tokens", "kv_usage",
    "oldest_wait_vs_ttft", "decode_pass_vs_itl", "chunk_at_target", "head_remaining_tokens",
    "head_prefilled_share", "last_pass_vs_itl", "decode_context_mean", "itl_slack", "slo_ttft",
    "slo_itl", "prefill_due_vs_ttft", "decode_floor_vs_itl", "prefill_tokens_per_itl",
    "fixed_share", "kv_prompts",
)
EARLIER_WIDTHS = (14, 15)
"""Widths of earlier observation vectors, each a prefix of this one (fields are only ever
appended): a model trained on one still reads the first entries."""
SLACK_INDEX = OBSERVATION_FIELDS.index("itl_slack")
DUE_INDEX = OBSERVATION_FIELDS.index("prefill_due_vs_ttft")
DUE_SCALE = 0.25
"""The ``prefill_due_vs_ttft`` entry per TTFT target (4 targets or later read as 1)."""

_INV_LOG_512 = 1 / math.log1p(512)
_INV_LOG_16K = 1 / math.log1p(16384)
_INV_LOG_128K = 1 / math.log1p(131072)
_INV_LOG_SLACK = 1 / math.log1p(SLACK_PASSES_TOP)
SLACK_ONE_PASS = math.log1p(1.0) * _INV_LOG_SLACK
"""The ``itl_slack`` entry at which the slack covers one pass over the ITL target."""


def _log_scale(x: float, top: float) -> float:
    """log1p(x) / log1p(top), clipped to [0, 1]."""
    v = math.log1p(x) / math.log1p(top) if x > 0 else 0.0
    return v if v < 1.0 else 1.0


def slo_features(slo: SLO) -> tuple[float, float]:
    """The SLO pair as the last two observation entries."""
    return _log_scale(slo.ttft_s, 30.0), _log_scale(1000 * slo.itl_s, 1000.0)


@lru_cache(maxsize=256)
def deployment_features(cost, ttft_s: float, itl_s: float, kv_tokens: int) -> tuple:
    """The deployment's entries (``envs.deployment.scaled``), once per deployment."""
    return scaled(deployment(cost, ttft_s, itl_s, kv_tokens))


def observe(state, slo: SLO, slo_obs: tuple[float, float] | None = None) -> np.ndarray:
    """The observation of a scheduler's ``state`` (``envs.engine.SchedulerState``) before
    its next pass (once per step).

    Beyond the scheduler's counts it carries what identifies the condition the pass is
    in: the price of a decode-only pass at the current decode set against the ITL target
    (load, hardware, model and per-pass overheads in one number) and the chunk a pass
    could carry within the ITL target; the TTFT slack of the oldest waiting request; and
    the p99 ITL slack, in passes over the target the running decodes could still take
    (:mod:`envs.slack`); and when the prefill queue would be done at passes within the
    ITL target, from its oldest request's arrival (:func:`envs.pricing.prefill_due_s`).
    The last four identify the deployment (:mod:`envs.deployment`): its cost model and KV
    cache against the SLO pair, so that one policy can serve many deployments.
    """
    if slo_obs is None:
        slo_obs = slo_features(slo)
    n = state.running_decodes
    ctx = state.decode_context_tokens
    done_tokens = state.head_prefilled_tokens
    total_tokens = done_tokens + state.head_remaining_tokens
    oldest = state.oldest_wait_s
    cost = state.cost
    decode_s = decode_pass_s(cost, n, ctx) if n else 0.0
    chunk = chunk_within(cost, n, ctx, slo.itl_s, done_tokens, cap=16384) if n else 16384
    log1p = math.log1p
    waiting = state.waiting_prefill_tokens
    vals = (
        n / state.max_num_seqs,
        log1p(state.waiting_requests) * _INV_LOG_512,
        log1p(waiting) * _INV_LOG_128K,
        state.kv_usage,
        oldest / slo.ttft_s * 0.25,
        decode_s / slo.itl_s * 0.25,
        log1p(chunk) * _INV_LOG_16K,
        log1p(total_tokens - done_tokens) * _INV_LOG_128K,
        done_tokens / total_tokens if total_tokens else 0.0,
        state.last_step_s / slo.itl_s * 0.25,
        log1p(ctx / n) * _INV_LOG_128K if n else 0.0,
        log1p(state.itl_slack(slo.itl_s).passes(n)) * _INV_LOG_SLACK,
    )
    # The due time reuses this pass's chunk; with nothing decoding entry 6 is the cap, not
    # the chunk that fits.
    due = (queue_done_s(oldest, waiting, slo.itl_s, chunk) if n
           else prefill_due_s(cost, 0, 0, done_tokens, waiting, oldest, slo.itl_s))
    due = due / slo.ttft_s * DUE_SCALE
    deploy = deployment_features(cost, slo.ttft_s, slo.itl_s, state.kv_total_tokens)
    return np.array([v if v < 1.0 else 1.0 for v in vals] + list(slo_obs)
                    + [due if due < 1.0 else 1.0, *deploy], dtype=np.float32)


class ObservedState:
    """Scheduler counts recovered from an observation vector (the inverse of
    :func:`observe` up to rounding and clipping), so that rules written against the
    scheduler's state also answer SB3's ``predict(observation)``."""

    __slots__ = ("waiting_requests", "waiting_prefill_tokens", "running_decodes", "kv_usage",
                 "head_prefilled_tokens", "head_remaining_tokens")

    def __init__(self, obs, max_num_seqs: int = 256):
        o = [float(x) for x in obs]
        self.running_decodes = int(round(o[0] * max_num_seqs))
        self.waiting_requests = int(round(math.expm1(o[1] / _INV_LOG_512)))
        self.waiting_prefill_tokens = int(round(math.expm1(o[2] / _INV_LOG_128K)))
        self.kv_usage = o[3]
        remaining = math.expm1(o[7] / _INV_LOG_128K)
        share = o[8]
        total = remaining / (1 - share) if share < 1 else remaining
        self.head_prefilled_tokens = int(round(total - remaining))
        self.head_remaining_tokens = int(round(total)) - self.head_prefilled_tokens
