"""A plain roofline loop: an independent, minimal serving simulator, pass by pass, to time
chunkpilot's against (``benchmarks/bench_simulator.py``) and to check it by
(``tests/test_reference_loop.py``).

The semantics of ``envs.engine.Simulator`` where the KV cache never runs out and no chunk
is capped: every pass the running decodes take one token each, then partially prefilled
requests in admission order and waiting ones in arrival order share what is left of a
static budget, at most ``max_num_seqs`` running. Each pass is priced by the contract's
formula (``envs.pricing``), written out here again on purpose: this loop must not share the
code it checks. It keeps what the metrics need: each request's first-token and finish
times, and every pass's duration and decodes.
"""

from __future__ import annotations

import math
from collections import deque


def simulate(arrival_s, prompt_tokens, output_tokens, cost, budget: int, max_num_seqs: int = 256):
    """(first-token times, finish times, pass durations, decodes per pass) of a static
    budget over the requests (lists), with a cost model's seven coefficients."""
    w, kv, tok, pair, e, fixed, serial = cost
    n_req = len(arrival_s)
    first, finish = [math.nan] * n_req, [math.nan] * n_req
    durations, decodes_of = [], []
    waiting: deque[int] = deque()
    partial: list[list[int]] = []  # [request, tokens computed], in admission order
    ends: dict[int, list[int]] = {}  # pass -> the decodes whose last token it makes
    n = offsets = 0  # decodes, and the sum of their offsets: a decode's context is offset + pass
    offset_of: dict[int, int] = {}
    now, p, nxt = 0.0, 0, 0
    while nxt < n_req or waiting or partial or n:
        while nxt < n_req and arrival_s[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        x_all = q_all = pairs = 0  # the pass's prefill tokens, their prefixes, their pairs
        done = []
        if partial or (waiting and n + len(partial) < max_num_seqs):
            left = budget - n
            for item in partial:
                if left <= 0:
                    break
                r, q = item
                x = min(prompt_tokens[r] - q, left)
                item[1] += x
                x_all, q_all, pairs, left = x_all + x, q_all + q, pairs + x * q + x * (x + 1) // 2, left - x
                if item[1] == prompt_tokens[r]:
                    done.append(item)
            while waiting and left > 0 and n + len(partial) < max_num_seqs:
                r = waiting.popleft()
                x = min(prompt_tokens[r], left)
                item = [r, x]
                partial.append(item)
                x_all, pairs, left = x_all + x, pairs + x * (x + 1) // 2, left - x
                if x == prompt_tokens[r]:
                    done.append(item)
        elif not n:  # idle until the next arrival
            now = max(now, arrival_s[nxt])
            continue
        ctx = offsets + n * p
        m = w + kv * (ctx + q_all + n + x_all)
        c = tok * (n + x_all) + pair * (ctx + n + pairs)
        dt = (m + e * c if m > c else c + e * m) + fixed + serial * (n + x_all)
        now += dt
        durations.append(dt)
        decodes_of.append(n)
        ending = ends.pop(p, ())
        p += 1
        for item in done:  # a prompt done samples its first token, then decodes
            partial.remove(item)
            r = item[0]
            first[r] = now
            if output_tokens[r] == 1:
                finish[r] = now
                continue
            offset_of[r] = prompt_tokens[r] - p
            n, offsets = n + 1, offsets + offset_of[r]
            ends.setdefault(p - 1 + output_tokens[r] - 1, []).append(r)
        for r in ending:
            n, offsets = n - 1, offsets - offset_of[r]
            finish[r] = now
    return first, finish, durations, decodes_of
