"""What identifies a deployment, in the units a budget policy acts in (standard library only).

A policy that serves many deployments must tell an A100 at a 100 ms ITL target from an
H100 at 50 ms. It acts in fractions of the ITL target, turned into tokens by the cost
model, so what it needs to know of a deployment is that cost model and its SLO pair
measured against the targets:

============================  =====================================================================
``decode_floor_vs_itl``       the lightest decode-only pass (one decode, no context) over the ITL
                              target: the share of every pass that serves no one's prompt
``prefill_tokens_per_itl``    the chunk a pass with one decode carries within the ITL target: the
                              price of a token of prefill, as tokens per target
``fixed_share``               the share of that lightest pass which is fixed cost (per-pass and
                              per-layer overheads, all-reduce latency): what a longer pass amortises
``kv_prompts``                the KV cache over one TTFT target's worth of prefill at passes of the
                              ITL target: how many targets' worth of prompts the cache holds, so
                              how soon admitting more fills it
``slo_ttft_s``, ``slo_itl_s``  the SLO pair itself
============================  =====================================================================

The simulator's observation (:mod:`envs.observation`), the table runtime
(:mod:`policies.table`, which re-prices a table for the deployment it serves) and so the
vLLM adapter all compute them here, from a cost model (``envs.pricing.Coefficients``),
the SLO pair and the KV cache's capacity in tokens. The module also names the deployments
a policy trained across them learns from (``TRAINING_DEPLOYMENTS``) and those it is
measured on, never trained or selected on (``HELD_OUT_DEPLOYMENTS``).
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

from envs.pricing import Coefficients, chunk_within, decode_pass_s

FEATURES = ("decode_floor_vs_itl", "prefill_tokens_per_itl", "fixed_share", "kv_prompts",
            "slo_ttft_s", "slo_itl_s")
"""The deployment's features, in :class:`Deployment`'s order."""
MAX_CHUNK = 1 << 20
"""The largest chunk ``prefill_tokens_per_itl`` counts to (a million tokens per target)."""


class Deployment(NamedTuple):
    """One deployment's features (see the module docstring)."""

    decode_floor_vs_itl: float
    prefill_tokens_per_itl: int
    fixed_share: float
    kv_prompts: float
    slo_ttft_s: float
    slo_itl_s: float

    def as_dict(self) -> dict:
        return dict(zip(FEATURES, self))


def deployment(cost: Coefficients, ttft_s: float, itl_s: float, kv_tokens: float) -> Deployment:
    """The features of a deployment priced by ``cost``, serving TTFT and ITL targets of
    ``ttft_s`` and ``itl_s`` seconds, with a KV cache of ``kv_tokens`` tokens.

    >>> c = Coefficients(weights_s=0.008, kv_s_per_token=0.0, token_s=1e-5, pair_s=0.0,
    ...                  exposed=0.0, fixed_s=0.002, serial_s_per_token=0.0)
    >>> d = deployment(c, ttft_s=2.0, itl_s=0.1, kv_tokens=400_000)
    >>> round(d.decode_floor_vs_itl, 3), round(d.fixed_share, 3)   # 10 ms, 2 of them fixed
    (0.1, 0.2)
    >>> d.prefill_tokens_per_itl   # max(8 ms, 1e-5 s x (1 + x)) + 2 ms <= 100 ms
    9799
    >>> round(d.kv_prompts, 3)   # 400,000 / (2 s / 0.1 s = 20 passes of 9,799 tokens)
    2.041
    """
    floor = decode_pass_s(cost, 1, 0)
    tokens = chunk_within(cost, 1, 0, itl_s, 0, MAX_CHUNK)
    per_ttft = ttft_s / itl_s * tokens
    return Deployment(
        decode_floor_vs_itl=floor / itl_s,
        prefill_tokens_per_itl=tokens,
        fixed_share=cost.fixed_s / floor if floor > 0 else 0.0,
        kv_prompts=kv_tokens / per_ttft if per_ttft > 0 else math.inf,
        slo_ttft_s=float(ttft_s), slo_itl_s=float(itl_s))


def feature_range(deployments: Iterable[Deployment]) -> dict:
    """Each feature's [lowest, highest] over ``deployments``: the range a policy or table made
    on them was made for (provenance ``deployments.range``). Values that are not finite (the
    cache's targets' worth where no prefill fits the ITL target) are left out; a feature
    with none left has no range."""
    deployments, out = list(deployments), {}
    for i, name in enumerate(FEATURES):
        values = [d[i] for d in deployments if math.isfinite(d[i])]
        if values:
            out[name] = [min(values), max(values)]
    return out


def scaled(d: Deployment) -> tuple[float, float, float, float]:
    """The first four features as observation entries in [0, 1]: the floor at a quarter per
    target (as the observation's ``decode_pass_vs_itl``), the chunk on a log scale to a
    million tokens, the share as it is, the cache on a log scale to 1,024 targets' worth."""
    return (min(d.decode_floor_vs_itl * 0.25, 1.0),
            min(math.log1p(d.prefill_tokens_per_itl) / math.log1p(MAX_CHUNK), 1.0),
            min(max(d.fixed_share, 0.0), 1.0),
            min(math.log1p(d.kv_prompts) / math.log1p(1024), 1.0) if math.isfinite(d.kv_prompts)
            else 1.0)


# --- the deployments a policy trained across them learns from and is measured on ----------

TRAINING_DEPLOYMENTS = (
    ("h100-sxm", "llama-3-8b"), ("a100-80g", "llama-3-8b"), ("h100-sxm", "mistral-7b"),
    ("h100-sxm", "qwen2.5-32b"), ("a100-80g", "qwen2.5-32b"), ("h100-sxm", "llama-3-70b-tp8"),
    ("a100-80g", "llama-3-70b-tp8"), ("a100-80g", "llama-3-70b-tp4"), ("m5-max", "llama-3-8b-q4"),
)
"""The (hardware, model) presets ``train.py --all-deployments`` trains across: every preset
pair that fits its memory, less the held-out ones."""
MADE_UP_PART = "a100-80g@hbm_bytes_per_s=4.078e12,peak_flops_per_s=156e12"
"""A part no one makes, far from every trained one: the A100's twice its bandwidth and half
its FLOP/s (a ridge point a quarter of the A100's)."""
HELD_OUT_DEPLOYMENTS = (
    ("h200", "llama-3-8b"), ("l40s", "llama-3-8b"), ("h100-sxm", "llama-3-70b-tp4"),
    (MADE_UP_PART, "llama-3-8b"),
)
"""Deployments never drawn in training or model selection, where a policy trained across
deployments is measured: two parts it never saw (h200, l40s, whose hardware appears with
no model in training), a model split it never saw on a part it did, and the made-up part."""
