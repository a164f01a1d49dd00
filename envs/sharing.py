"""Synthetic workloads whose prompts share prefixes: conversations and agents.

A request's tokens are segments of text, each with an identity (a conversation's turns and
answers; an agent's shared instructions and a request's own text). Its block ids
(``Workload.block_hashes``, one per ``HASH_BLOCK_TOKENS`` tokens) name each block by everything up
to its end, as vLLM's chained block hashes do: two blocks get the same id exactly when the
segments up to their ends are the same. ``envs.prefix_cache`` reads them.

- ``conversation:TURNS[:USERS]``: multi-turn chats of TURNS turns. Turn k's prompt is turn
  k-1's prompt and answer, then new text; the new text's length is drawn from the prompt
  spec, each answer's from the output spec. USERS conversations run at a time, each
  taking every USERS-th arrival, so the previous turn has usually finished when the next
  one arrives, as a user reads an answer before replying; a user whose conversation has
  had its TURNS turns starts a new one. USERS defaults to ceil(requests / TURNS), every
  conversation at once; set it to keep the gap between turns, in arrivals, apart from
  the stream's length (with more users in flight, more of their histories compete for
  the cache). A stream of USERS requests or fewer holds first turns only: nothing
  repeats. The ids go on into the answer, which the next turn resends.
- ``agent:HIT[:PREFIXES]``: each prompt is one of PREFIXES (default 1) shared prefixes
  (an agent's instructions and tool descriptions), then the request's own text drawn from
  the prompt spec. The prefix is sized so that it is the share HIT of the prompt tokens
  on average: HIT / (1 - HIT) times the own text's mean length.

The share of prompt tokens a prefix cache can serve is what a request repeats of earlier
ones (:func:`repeated_share`, an independent count of leading blocks seen before);
eviction and timing decide how much of it an engine hits.
"""

from __future__ import annotations

import math

import numpy as np

from envs.errors import MAX_TOKENS, ConfigError, show

HASH_BLOCK_TOKENS = 16
"""Tokens per block id: vLLM's default KV block, so that every KV block is named."""
SHARING_FORMS = "none, conversation:TURNS[:USERS], agent:HIT[:PREFIXES]"
MAX_TURNS = 1000
MAX_USERS = 10**6
MAX_PREFIXES = 10**6
MAX_HIT = 0.99


def parse_sharing(spec: str) -> tuple[str, tuple]:
    """``spec`` checked: (kind, parameters). One clear line for anything else."""
    kind, _, rest = str(spec).partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind == "none" and not args:
            return "none", ()
        if kind == "conversation" and len(args) in (1, 2):
            turns = int(args[0])
            users = int(args[1]) if len(args) == 2 else None
            if 1 <= turns <= MAX_TURNS and (users is None or 1 <= users <= MAX_USERS):
                return kind, (turns, users)
        if kind == "agent" and len(args) in (1, 2):
            hit = float(args[0])
            prefixes = int(args[1]) if len(args) == 2 else 1
            if 0 <= hit <= MAX_HIT and 1 <= prefixes <= MAX_PREFIXES:
                return kind, (hit, prefixes)
    except ValueError:
        pass
    raise ConfigError(f"sharing: got {show(spec)}, must be {SHARING_FORMS} (TURNS 1-{MAX_TURNS}, "
                      f"USERS 1-{MAX_USERS:,}, HIT 0-{MAX_HIT}, PREFIXES 1-{MAX_PREFIXES:,})")


def share_prefixes(spec: str, rng: np.random.Generator, own: np.ndarray, outputs: np.ndarray
                   ) -> tuple[np.ndarray, tuple | None, bool]:
    """The prompts and their block ids for ``spec``, from each request's own new text
    (``own`` tokens) and its answer (``outputs``): (prompt tokens, ids per request or None,
    whether the ids go on into the answers)."""
    kind, params = parse_sharing(spec)
    if kind == "none":
        return own, None, False
    namer = _Namer()
    if kind == "conversation":
        prompts, ids = _conversations(*params, own, outputs, namer)
        return prompts, ids, True
    hit, prefixes = params
    prefix = int(round(hit / (1 - hit) * float(own.mean()))) if hit else 0
    group = rng.integers(0, prefixes, size=len(own))
    prompts = own + prefix
    if int(prompts.max(initial=0)) > MAX_TOKENS:
        raise ConfigError(f"sharing: got {show(spec)}, its prefix of {prefix} tokens makes prompts "
                          f"over {MAX_TOKENS} tokens")
    ids = tuple(namer.name([(("agent", int(g)), prefix), (("own", i), int(n))], int(n) + prefix)
                for i, (g, n) in enumerate(zip(group, own)))
    return prompts, ids, False


def _conversations(turns: int, users: int | None, own: np.ndarray, outputs: np.ndarray,
                   namer: "_Namer"):
    n = len(own)
    k = users or max(1, math.ceil(n / turns))
    prompts = np.empty(n, dtype=np.int64)
    ids = []
    history: dict[int, list] = {}
    for i in range(n):
        c = i % k
        if (i // k) % turns == 0:  # the user starts a conversation
            history[c] = []
        segments = history[c]
        segments.append((("user", i), int(own[i])))
        prompt = sum(length for _, length in segments)
        if prompt + int(outputs[i]) > MAX_TOKENS:
            raise ConfigError(f"sharing: conversation:{turns} makes a prompt of {prompt} tokens "
                              f"(request {i}), over {MAX_TOKENS}: fewer turns or shorter texts")
        prompts[i] = prompt
        with_answer = segments + [(("answer", i), int(outputs[i]))]
        ids.append(namer.name(with_answer, prompt + int(outputs[i])))
        segments.append((("answer", i), int(outputs[i])))
    return prompts, tuple(ids)


class _Namer:
    """Block ids for segment sequences: one id per distinct sequence of segments up to a
    block's end (a segment's identity and the offset reached in it name that prefix,
    given the segments before it, which the id of the block before already names)."""

    def __init__(self) -> None:
        self._ids: dict = {}

    def name(self, segments: list, tokens: int) -> np.ndarray:
        """The ids of the ceil(tokens / HASH_BLOCK_TOKENS) blocks of these segments' tokens."""
        out = np.empty(-(-tokens // HASH_BLOCK_TOKENS), dtype=np.int64)
        ids = self._ids
        seg, start = 0, 0  # the segment holding a block's last token, and where it starts
        previous = -1
        for j in range(len(out)):
            end = min((j + 1) * HASH_BLOCK_TOKENS, tokens)
            while start + segments[seg][1] < end:
                start += segments[seg][1]
                seg += 1
            key = (previous, segments[seg][0], end - start)
            previous = out[j] = ids.setdefault(key, len(ids))
        out.setflags(write=False)
        return out


def token_block_ids(prompts: list, block_tokens: int = HASH_BLOCK_TOKENS) -> tuple:
    """Block ids of prompts given as token ids, one per ``block_tokens`` tokens: a block's
    id names its tokens and the id before it, as vLLM's chained block hashes do (numbers in
    order of first appearance, so a prompt's new blocks get consecutive ones)."""
    names: dict = {}
    out = []
    for tokens in prompts:
        ids, previous = [], -1
        for j in range(0, len(tokens), block_tokens):
            previous = names.setdefault((previous, tuple(tokens[j:j + block_tokens])), len(names))
            ids.append(previous)
        out.append(np.array(ids, dtype=np.int64))
    return tuple(out)


def repeated_share(w) -> float:
    """The share of a workload's prompt tokens that a request's leading blocks repeat of
    earlier requests' (``w.block_hashes``, in arrival order): what a prefix cache that
    never evicts can serve. Counted as an engine counts them: a request's full blocks
    before its last token (which it computes to sample from), against the blocks earlier
    requests left full (their prompts, and their answers where the ids go on into them:
    all but the last token sampled)."""
    seen: set = set()
    hit = 0
    bt = w.hash_block_tokens
    for p, o, row in zip(w.prompt_tokens.tolist(), w.output_tokens.tolist(), w.block_hashes):
        row = row.tolist()
        full = min(len(row), (p - 1) // bt)
        run = 0
        while run < full and row[run] in seen:
            run += 1
        hit += run * bt
        seen.update(row[:(p + o - 1 if w.hashes_cover_output else p) // bt])
    total = int(w.prompt_tokens.sum())
    return hit / total if total else math.nan
