"""The engine state a budget policy may read: one vocabulary for the simulator, the table
runtime and the vLLM adapter (standard library only).

Every quantity is named once, here (:data:`QUANTITIES`), with its unit, its meaning and
exactly how it is counted from a request's counters. The counters are vLLM V1's
(``vllm/v1/request.py``), which the simulator's requests mirror:

- ``prompt``: prompt tokens (vLLM ``num_prompt_tokens``); ``output``: tokens sampled so
  far (``num_output_tokens``); ``tokens = prompt + output`` (``num_tokens``); ``computed``:
  tokens whose KV is in the cache (``num_computed_tokens``); ``arrival_s``. A step still
  in flight counts as done (:func:`counters`: vLLM's async scheduler advances
  ``num_computed_tokens`` when it schedules a step, and holds the tokens it will sample
  as ``num_output_placeholders``), so a request whose last token a step in flight samples
  has finished.
- *waiting*: not admitted: new requests, and preempted ones (which restart with nothing
  computed and must recompute their prompt and output). vLLM's ``waiting`` queue.
- *in prefill*: running, with its prefill or recomputation not yet complete: computed
  < tokens - 1, or no output yet, or its last scheduled work was a chunk that left its
  last token to compute (vLLM ``is_prefill_chunk``: a recomputation cut one token short
  of its end is a prefill still, though its counters read as a decode's).
- *decoding*: running and not in prefill: every token but the last sampled one is in the
  cache, and the next pass takes one token from it.
- *to prefill*: ``tokens - computed`` of a waiting or in-prefill request (a
  recomputation counts its output tokens too).
- *the head*: the request next in line for prefill: the first in-prefill running request
  in admission order (vLLM's ``running`` list keeps it), else the first waiting one.
- *cached*, with prefix caching: the tokens of a request's leading full blocks the cache
  holds, looked up as vLLM's admission looks them up
  (``KVCacheManager.get_computed_blocks``, which takes and frees no block). A request's
  *cached now*: what its admission would find now (read for a waiting head). Its *cached
  on joining*: what was cached when it joined the waiting queue, looked up once, on
  arrival or after the pass that preempted it (a lookup of the whole queue every pass
  would cost what admitting it does). Its *cached at admission*: what its first admission
  found (vLLM's prefill stats, ``num_local_cached_tokens``).

The simulator's :class:`~envs.engine.SchedulerState` offers every name below (its fast
running sums), the slack counts through ``itl_slack(itl_s)`` (they depend on a target); :func:`read_requests` counts the engine-side ones from vLLM's request
objects, as the vLLM adapter does every step; ``policies.table`` buckets the names in
:data:`TABLE_INPUTS` and :data:`DERIVED`. ``tests/test_state.py`` drives the simulator
into preemptions, partial prefills and idle spells and checks that :func:`read_requests`
over the simulator's requests, as vLLM would hold them, gives what the simulator says.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple


class Quantity(NamedTuple):
    name: str
    unit: str
    meaning: str
    counting: str
    """Exactly how it is counted (the module docstring's terms)."""
    vllm: str = ""
    """vLLM's own metric or field for it, where it has one."""


NEXT_PREFILLS = 16
"""The most requests ``next_prefills`` lists: a pass rarely reaches more (an agent's
suffixes of a few hundred tokens under a budget of a few thousand), and past them the
price adds no prefix."""

QUANTITIES: tuple[Quantity, ...] = (
    Quantity("running_decodes", "requests", "requests decoding (one token each per pass)",
             "running requests not in prefill"),
    Quantity("waiting_requests", "requests", "requests not admitted",
             "the waiting queue: new requests and preempted ones", "vllm:num_requests_waiting"),
    Quantity("waiting_prefill_tokens", "tokens", "tokens still to prefill (prompts, and the "
             "output a recomputation redoes), less what the prefix cache holds of them",
             "sum of tokens - computed over waiting and in-prefill requests (a recomputation's "
             "output tokens included), less each waiting request's cached on joining"),
    Quantity("kv_usage", "fraction", "share of the KV cache's blocks in use",
             "blocks held by running requests / all blocks", "vllm:kv_cache_usage_perc"),
    Quantity("decode_context_tokens", "tokens", "KV-cache tokens the decodes' attention reads",
             "sum of computed over decoding requests"),
    Quantity("head_prefilled_tokens", "tokens", "the head's tokens already in the KV cache, "
             "which its next chunk reads as its prefix",
             "computed of an in-prefill head; a waiting head's cached now (0 without prefix "
             "caching); 0 without a head"),
    Quantity("head_remaining_tokens", "tokens", "the head's tokens still to prefill",
             "tokens - head_prefilled_tokens of the head; 0 without one"),
    Quantity("oldest_wait_s", "seconds", "how long the oldest request without a first token has waited",
             "now - arrival_s of the earliest-arrived waiting or in-prefill request with no "
             "output token (a preempted request has one: its TTFT is behind it); 0 without one"),
    Quantity("last_step_s", "seconds", "how long the last completed pass took",
             "from its scheduling (or the previous pass's output, when it was scheduled "
             "before that, as async scheduling does) to its output; the time an idle engine "
             "waits between passes is not in it; 0 before the first pass"),
    Quantity("itl_slow_tokens", "tokens", "decode tokens whose gap exceeded the ITL target, lately",
             "each completed pass adds its decodes when their gap, from the previous pass's "
             "output to its own, exceeded the ITL target (in the simulator passes run back to "
             "back and the gap is the pass); "
             "the passes completed since the last reading are dated at this reading, and the "
             "count decays with a time constant of envs.slack.SLACK_TAU_S (300 s)"),
    Quantity("itl_decode_tokens", "tokens", "decode tokens, lately",
             "each completed pass adds its decodes, dated and decayed as itl_slow_tokens"),
    Quantity("running_requests", "requests", "requests admitted and not finished",
             "decoding and in-prefill requests", "vllm:num_requests_running"),
    Quantity("prefilling_requests", "requests", "requests in prefill", "in-prefill running requests"),
    Quantity("kv_used_blocks", "blocks", "KV-cache blocks in use", "blocks held by running requests"),
    Quantity("kv_total_blocks", "blocks", "KV-cache blocks in all", "the engine's block pool"),
    Quantity("max_num_seqs", "requests", "most requests running at once", "the engine's setting",
             "max_num_seqs"),
    Quantity("now_s", "seconds", "the engine's clock", "seconds since the engine started"),
    Quantity("head_cached_tokens", "tokens", "the head's prompt tokens the prefix cache serves",
             "an in-prefill head's cached at admission; a waiting head's cached now; 0 without a "
             "head or without prefix caching"),
    Quantity("next_prefills", "(tokens, tokens) per request",
             "with prefix caching, the prefills a pass takes after the head's: each one's cached "
             "prefix and its tokens still to prefill, which a time budget prices the pass with",
             f"in the order the scheduler takes them, at most {NEXT_PREFILLS}: the in-prefill "
             "running requests after the head (computed, tokens - computed), then the waiting "
             "ones after it (cached on joining, tokens - computed - cached on joining: a "
             "lookup per waiting request every pass would cost what admitting it does); empty "
             "without prefix caching"),
    Quantity("free_ride_tokens", "tokens", "about the largest chunk that keeps this pass memory-bound",
             "envs.pricing.free_ride_root over the decodes and the head's prefix, rounded down"),
)
BY_NAME = {q.name: q for q in QUANTITIES}

TABLE_INPUTS = ("running_decodes", "waiting_requests", "waiting_prefill_tokens", "kv_usage",
                "decode_context_tokens", "head_prefilled_tokens", "head_remaining_tokens",
                "oldest_wait_s", "last_step_s", "itl_slow_tokens", "itl_decode_tokens",
                "head_cached_tokens")
"""What a serving engine provides to a table before each pass (``policies.table``)."""

SLACK_COUNTS = ("itl_slow_tokens", "itl_decode_tokens")
"""Decayed counts, the inputs of ``itl_slack_passes``; a table does not bucket them alone."""

DERIVED = {
    "decode_pass_s": ("running_decodes", "decode_context_tokens"),
    "itl_slack_passes": ("running_decodes", "itl_slow_tokens", "itl_decode_tokens"),
    "prefill_due_s": ("running_decodes", "decode_context_tokens", "head_prefilled_tokens",
                      "waiting_prefill_tokens", "oldest_wait_s"),
}
"""Quantities a time-fraction table derives from the inputs with its cost model and ITL
target: the price of a decode-only pass (``envs.pricing.decode_pass_s``); the passes over
the target the decodes could still take (``envs.slack.slack_passes``); when the prefill
queue would be done at passes within the target (``envs.pricing.prefill_due_s``)."""

QUEUE_INPUTS = frozenset({"waiting_prefill_tokens", "oldest_wait_s"})
"""The inputs that need a pass over the waiting queue (an engine walks its running
requests every pass anyway: the decodes bound every budget from below)."""


def counters(request) -> tuple[int, int, int]:
    """(computed, tokens, output) of a vLLM request, its in-flight step counted as done.

    vLLM's async scheduler schedules a step before the previous one's output arrives: it
    adds the scheduled tokens to ``num_computed_tokens`` at once, and a placeholder
    (``num_output_placeholders``) for each token the step will sample. Counting those
    placeholders as sampled tokens gives the counters the next pass sees, as the
    synchronous scheduler (whose placeholders are always 0) and the simulator have them."""
    pending = getattr(request, "num_output_placeholders", 0)
    return (request.num_computed_tokens, request.num_tokens + pending,
            request.num_output_tokens + pending)


HEAD_INPUTS = frozenset({"head_prefilled_tokens", "head_remaining_tokens", "head_cached_tokens"})


def read_requests(running: Iterable, waiting, wall_now_s: float,
                  needs: Iterable[str] = TABLE_INPUTS, cached=None) -> dict:
    """The request-counted quantities among ``needs`` (and always ``running_decodes``, which
    bounds every budget) from vLLM V1 request objects, as the module docstring defines
    them: ``running`` in admission order; ``waiting`` a sized queue, iterated in the order
    the scheduler takes it; arrivals on the clock of ``wall_now_s`` (vLLM's
    ``arrival_time`` is ``time.time()``). The engine supplies the rest itself:
    ``kv_usage`` from its cache, ``last_step_s`` and the slack counts from its passes
    (``envs.slack.StepSlack``). ``cached(request, when)``, with prefix caching, gives a
    request's cached tokens as the module docstring's *cached* counts them, ``when`` one
    of ``"now"``, ``"on joining"`` and ``"at admission"``; None: no prefix caching."""
    needs = frozenset(needs)
    decodes = context = to_prefill = 0
    head = None
    oldest = math.inf
    later = []  # next_prefills' running part
    for r in running:
        computed, tokens, output = counters(r)
        if output >= getattr(r, "max_tokens", math.inf):
            continue  # its last token is being sampled by a step in flight: it has finished
        if not (output == 0 or computed < tokens - 1 or getattr(r, "is_prefill_chunk", False)):
            decodes += 1  # not in prefill, as the module docstring defines it
            context += computed
            continue
        to_prefill += tokens - computed
        if head is None:
            head = r
        elif len(later) < NEXT_PREFILLS:
            later.append((computed, tokens - computed))
        if output == 0 and r.arrival_time < oldest:
            oldest = r.arrival_time
    running_head = head is not None  # else the head is the first waiting request
    state = {"running_decodes": decodes}
    if "decode_context_tokens" in needs:
        state["decode_context_tokens"] = context
    if "waiting_requests" in needs:
        state["waiting_requests"] = len(waiting)
    if needs & QUEUE_INPUTS:
        for r in waiting:
            computed, tokens, output = counters(r)
            to_prefill += tokens - computed - (cached(r, "on joining") if cached is not None else 0)
            if output == 0 and r.arrival_time < oldest:
                oldest = r.arrival_time
        state["waiting_prefill_tokens"] = to_prefill
        state["oldest_wait_s"] = wall_now_s - oldest if oldest < math.inf else 0.0
    if needs & HEAD_INPUTS:
        if head is None and len(waiting):  # the request the scheduler takes next
            head = waiting.peek_request() if hasattr(waiting, "peek_request") else next(iter(waiting))
        computed, tokens, _ = counters(head) if head is not None else (0, 0, 0)
        hit = (cached(head, "at admission" if running_head else "now")
               if cached is not None and head is not None else 0)
        if head is not None and not running_head:
            computed = hit  # what its first chunk will find in the cache
        state["head_prefilled_tokens"] = computed
        state["head_remaining_tokens"] = tokens - computed
        state["head_cached_tokens"] = hit
    if "next_prefills" in needs:
        if cached is None:
            later = []
        else:  # the waiting requests after the head, in the order the scheduler takes them
            skip = 0 if running_head else 1
            for r in waiting:
                if len(later) >= NEXT_PREFILLS:
                    break
                if skip:
                    skip -= 1
                    continue
                computed, tokens, _ = counters(r)
                joined = cached(r, "on joining")
                later.append((joined, tokens - computed - joined))
        state["next_prefills"] = tuple(later)
    return {k: v for k, v in state.items() if k in needs or k == "running_decodes"}


def markdown(names: Iterable[str] = TABLE_INPUTS) -> str:
    """A Markdown table of the quantities ``names`` (docs/serving.md's; regenerate it with
    ``python -m envs.state``)."""
    rows = ["| name | unit | meaning | how it is counted |", "|---|---|---|---|"]
    for name in names:
        q = BY_NAME[name]
        rows.append(f"| `{q.name}` | {q.unit} | {q.meaning} | {q.counting} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
