"""Automatic prefix caching over the paged KV pool, with vLLM V1's semantics.

vLLM V1 (``vllm/v1/core/kv_cache_manager.py``, ``vllm/v1/core/block_pool.py``) names every
*full* KV block by a hash of its tokens and of the block before it, so that one hash names
a whole prefix. What this module follows of it:

- **A block is cached once full** (``BlockPool.cache_full_blocks``, called as the scheduler
  allocates a request's slots): the blocks a chunk fills are cached when the chunk is
  scheduled; a partial block never is.
- **A new request reuses the longest run of leading full blocks still in the pool**
  (``KVCacheManager.get_computed_blocks``), at most the blocks before its last token
  (``max_cache_hit_length = num_tokens - 1``: a fully cached prompt still computes its last
  token, to sample from it).
- **Blocks with no running request on them stay cached** in the free queue, and the pool
  takes blocks for new work from the queue's front, evicting whatever was cached there
  (``FreeKVCacheBlockQueue``, ``BlockPool.get_new_blocks``). Blocks that hold nothing
  cached come first: those never used, and freed blocks that were never cached (a
  partial block), which ``BlockPool.free_blocks`` puts at the front; then cached blocks,
  least recently freed first. A request's blocks are freed tail first
  (``KVCacheManager.free``: ``reversed(blocks)``), so a prefix loses its end before its
  start.
- **A hit on a block still in the queue takes it out** (``BlockPool.touch``): it is in
  use again and no longer counts as free; a hit on a block another running request
  holds shares it, at no cost in blocks.
- **A preempted request's blocks are freed as a finished one's**, cached, and its
  recomputation hits whatever of them is still in the pool.

Where this differs from vLLM, on purpose:

- Blocks are named by workload ids (``Workload.block_hashes``), not hashes of token
  values, which a simulator does not have. Ids name ``hash_block_tokens``-token blocks of a
  request from its first token, each naming everything up to its end (vLLM's hashes chain
  the same way, and so do the Mooncake trace's ``hash_ids``). A run of KV blocks with
  consecutive names forms a *unit* (:func:`units_of`: a 512-token trace block holds 32
  16-token KV blocks, and a prompt's new blocks have consecutive ids). A request's full
  blocks past its ids (what its decodes write) form one more unit, named for it alone:
  only the request itself, recomputed after a preemption, can hit it.
- A block computed by a second request while the first copy is cached (two requests
  prefilling the same new prefix side by side) is not cached while the first copy is:
  vLLM caches both under the hash, and frees the second to the queue's back. Here it is
  freed blank, to the front, unless the first copy was evicted by then (the second then
  becomes the cached one). So where requests prefill the same new prefix side by side,
  which blocks leave the queue first can differ; ``tests/engine_vllm/
  test_prefix_agreement.py`` finds no step that differs in 300 random cases.

Bookkeeping by unit, not by block, keeps the cost per request to its units (a 40,000-token
Mooncake prompt whose ids run 0-78 is one unit, against 2,510 blocks). It is exact because the cached blocks of a
unit are always a run from its first: a request holds a unit's blocks from its first, a
unit is extended only by a request holding all of its cached blocks, and its blocks are
freed tail first and evicted in the order freed, so the last cached one leaves first.
Each unit keeps ``n``, its cached blocks, and the holders' counts (running requests
holding its first ``c`` blocks); the queue keeps runs ``[lo, hi)`` of a unit's blocks in
the order freed, and a count of the blank blocks before them.

The pool's block *count* is the simulator's (``Simulator._kv_used``); this module keeps
which blocks are cached and in what order they leave. Allocation in the simulator moves
the count only, and :meth:`PrefixCache.settle` evicts what those allocations took from the
queue before anything reads or frees cached blocks: the same blocks leave as if each
allocation had popped them at once, since allocation always pops from the front and
freeing always appends at the back.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from envs.errors import ConfigError


@dataclass
class PrefixCounts:
    """What prefix caching served in a run (``Simulator.prefix_counts``)."""

    first_admissions: int = 0
    """Requests admitted for the first time."""
    hit_admissions: int = 0
    """Of those, the ones that found a cached prefix."""
    first_prompt_tokens: int = 0
    """Their prompt tokens."""
    first_cached_tokens: int = 0
    """Of those, the ones found cached."""
    cached_tokens: int = 0
    """Tokens found cached at every admission, recomputations after a preemption included:
    prefill not computed again."""


class Units(NamedTuple):
    """A request's units in block order: each one's name, first block and blocks."""

    keys: list
    starts: list
    sizes: list


def units_of(ids: np.ndarray | None, hash_block_tokens: int, covered: int, block_size: int,
             rid: int, blocks: int) -> Units:
    """The units of a request that will fill at most ``blocks`` KV blocks, whose ``ids``
    name its first ``covered`` tokens, ``hash_block_tokens`` a id (module docstring).

    Every KV block inside the covered tokens gets a number. Where an id's block holds
    whole KV blocks, a KV block's number is ``id * (hash_block_tokens / block_size)`` plus
    its place among them; where a KV block spans several ids' blocks, it is the id of the
    last one it reaches. A unit is a run of KV blocks whose numbers go up by one each
    (by ``block_size / hash_block_tokens`` in the second case): a prompt's new blocks,
    whose ids a trace or a generator gives in a row. It is named by its first number.
    Since an id names everything before it, two requests that share a block share every
    block before it, and so the run it is in starts at the same block for both. The
    blocks past the covered tokens form the request's own unit, named ``-1 - rid``."""
    named = min(covered // block_size if ids is not None else 0, blocks)
    keys: list = []
    starts: list = []
    sizes: list = []
    if named and hash_block_tokens % block_size == 0:  # whole KV blocks in each id's block
        # runs break only where the ids do: walk the ids (a few dozen), not the blocks
        per = hash_block_tokens // block_size
        last_id = (named - 1) // per
        ids = ids[:last_id + 1]
        if last_id < 64:  # a few ids: a loop beats numpy's calls
            values = ids.tolist()
            runs = [0, *(j for j in range(1, last_id + 1) if values[j] != values[j - 1] + 1)]
            keys = [values[run] * per for run in runs]
        else:
            runs = [0, *(np.flatnonzero(ids[1:] - ids[:-1] != 1) + 1).tolist()]
            keys = (ids[runs] * per).tolist()
        starts = [run * per for run in runs]
        ends = [*starts[1:], named]
        sizes = [end - start for start, end in zip(starts, ends)]
    elif named:
        k = np.arange(named, dtype=np.int64)
        if block_size % hash_block_tokens == 0:  # a KV block spans ids: named by its last one
            span = block_size // hash_block_tokens
            numbers = ids[(k + 1) * span - 1]
        else:
            check_hash_block_tokens(hash_block_tokens, block_size)
        first = np.concatenate(([0], np.flatnonzero(np.diff(numbers) != span) + 1))
        keys = numbers[first].tolist()
        starts = first.tolist()
        sizes = np.diff(np.append(first, named)).tolist()
    if blocks > named:
        keys.append(-1 - rid)
        starts.append(named)
        sizes.append(blocks - named)
    return Units(keys, starts, sizes)


def check_hash_block_tokens(hash_block_tokens: int, block_size: int) -> None:
    """Block ids name whole KV blocks, or whole runs of them: their blocks' size must be a
    multiple or a divisor of the KV block's."""
    if hash_block_tokens % block_size and block_size % hash_block_tokens:
        raise ConfigError(f"hash_block_tokens: got {hash_block_tokens}, must be a multiple or a divisor "
                          f"of the KV block size ({block_size} tokens)")


class PrefixCache:
    """Which of the pool's blocks are cached, unit by unit, and the free queue's order
    (see the module docstring)."""

    __slots__ = ("total", "units", "queue", "queued", "blank", "_entries", "evicted")

    def __init__(self, total_blocks: int):
        self.total = total_blocks
        self.units: dict = {}
        """Cached units: name -> [n cached blocks, {held count c: holders}, its queue
        entries' ids, oldest first]."""
        self.queue: OrderedDict = OrderedDict()
        """The free queue's cached blocks, front first: entry id -> [unit name, lo, hi],
        blocks [lo, hi) of the unit."""
        self.queued = 0
        """Blocks in :attr:`queue`."""
        self.blank = total_blocks
        """Free blocks that hold nothing cached, at the queue's front."""
        self._entries = 0
        self.evicted = 0
        """Cached blocks evicted so far."""

    def copy(self) -> "PrefixCache":
        return copy.deepcopy(self)

    def cached_blocks(self) -> int:
        """Blocks cached, in use or free."""
        return sum(u[0] for u in self.units.values())

    # --- the pool -----------------------------------------------------------------------

    def settle(self, used: int) -> None:
        """Evict from the queue's front what allocations took since the last call: after
        it, the blank and queued blocks are the pool's ``total - used`` free ones."""
        excess = self.blank + self.queued - (self.total - used)
        if excess <= 0:
            return
        take = min(excess, self.blank)
        self.blank -= take
        excess -= take
        self.queued -= excess
        queue, units = self.queue, self.units
        while excess:
            eid, entry = queue.popitem(last=False)
            key, lo, hi = entry
            if hi - lo > excess:  # the entry's top leaves; the rest stays at the front
                entry[2] = hi - excess
                queue[eid] = entry
                queue.move_to_end(eid, last=False)
                units[key][0] -= excess
                self.evicted += excess
                break
            excess -= hi - lo
            unit = units[key]  # the unit's last cached blocks leave
            unit[0] = lo
            self.evicted += hi - lo
            unit[2].pop(0)
            if not lo:
                del units[key]

    def _push(self, key, lo: int, hi: int) -> None:
        """Blocks [lo, hi) of unit ``key`` join the queue's back."""
        self._entries += 1
        self.queue[self._entries] = [key, lo, hi]
        self.queued += hi - lo
        self.units[key][2].append(self._entries)

    # --- a request ------------------------------------------------------------------------

    def hits(self, units: Units, limit: int) -> tuple[int, int]:
        """The leading blocks of a request cached (at most ``limit``), and how many of those
        sit in the queue (a hit on them takes a free block)."""
        cached = self.units
        hit = from_queue = 0
        for key, start, size in zip(*units):
            unit = cached.get(key)
            if unit is None:
                break
            h = min(unit[0], size, limit - start)
            if h <= 0:
                break
            hit += h
            in_use = max(unit[1]) if unit[1] else 0
            from_queue += max(0, h - in_use)
            if h < size:
                break
        return hit, from_queue

    def acquire(self, units: Units, hit: int, held: list, filled: list) -> None:
        """A request takes its first ``hit`` blocks, found cached by :meth:`hits`; ``held``
        and ``filled`` (empty) become its cached and filled blocks per unit."""
        for key, start, size in zip(*units):
            if start >= hit:
                break
            unit = self.units[key]
            h = min(unit[0], size, hit - start)
            in_use = max(unit[1]) if unit[1] else 0
            if h > in_use:
                self._touch(key, unit, h)
            unit[1][h] = unit[1].get(h, 0) + 1
            held.append(h)
            filled.append(h)

    def _touch(self, key, unit: list, h: int) -> None:
        """Take unit ``key``'s queued blocks below ``h`` out of the queue: the lowest queued
        blocks, freed last, in its newest entries."""
        queue, entries = self.queue, unit[2]
        while entries:
            entry = queue[entries[-1]]
            lo, hi = entry[1], entry[2]
            if lo >= h:
                break
            if hi <= h:
                del queue[entries.pop()]
                self.queued -= hi - lo
            else:
                entry[1] = h
                self.queued -= h - lo
                break

    def fill(self, units: Units, held: list, filled: list, upto: int) -> None:
        """A request's blocks up to ``upto`` are full (scheduled to be): cache them unit by
        unit where the unit's cached blocks end where its own cached ones do (it holds all
        of them, or the others' were evicted down to its), or the unit is not cached; there
        its earlier copies become the cached blocks too. Elsewhere its blocks are copies of
        cached ones, kept uncached. Call it after :meth:`settle`: vLLM allocates a chunk's
        blocks, evicting, before it caches them."""
        cached = self.units
        keys, starts, sizes = units
        j = max(len(filled) - 1, 0)
        if j == len(filled):  # its first blocks: new units whole, in bulk while none is cached
            while j < len(keys) and starts[j] + sizes[j] <= upto and keys[j] not in cached:
                size = sizes[j]
                cached[keys[j]] = [size, {size: 1}, []]
                held.append(size)
                filled.append(size)
                j += 1
            j = max(j - 1, 0)
        for j in range(j, len(keys)):
            start = starts[j]
            if start >= upto:
                break
            if j == len(filled):
                held.append(0)
                filled.append(0)
            want = max(min(sizes[j], upto - start), filled[j])
            filled[j] = want
            c = held[j]
            if want <= c:
                continue
            key = keys[j]
            unit = cached.get(key)
            if unit is None:  # nothing of it cached (so it held none)
                cached[key] = [want, {want: 1}, []]
                held[j] = want
            elif unit[0] == c:  # its cached blocks end where the unit's do: extend the unit
                unit[0] = want
                hold = unit[1]
                if c:
                    hold[c] -= 1
                    if not hold[c]:
                        del hold[c]
                hold[want] = hold.get(want, 0) + 1
                held[j] = want

    def release(self, units: Units, held: list, filled: list, full: int, blocks: int) -> int:
        """A request frees its ``blocks`` blocks, its first ``full`` full (its decodes'
        blocks are cached now, as :meth:`fill` would have): those with nothing cached to the
        queue's front, its cached ones tail first to its back. Returns the blocks freed
        (those another request still holds are not). Call it after :meth:`settle`."""
        self.fill(units, held, filled, full)
        # its blocks with nothing cached (a partial one, copies) go to the front, blank
        self.blank += blocks - sum(held)
        shared = 0
        for j in range(len(filled) - 1, -1, -1):
            c = held[j]
            if not c:
                continue
            key = units.keys[j]
            unit = self.units[key]
            hold = unit[1]
            hold[c] -= 1
            if not hold[c]:
                del hold[c]
            in_use = max(hold) if hold else 0
            shared += min(c, in_use)
            if c > in_use:
                self._push(key, in_use, c)
        held.clear()
        filled.clear()
        return blocks - shared

    # --- checking ---------------------------------------------------------------------------

    def shared_blocks(self) -> int:
        """Blocks counted by more than one holder: every holder counts a unit's blocks it
        holds, and the pool holds each once."""
        return sum(c * k for u in self.units.values() for c, k in u[1].items()) - sum(
            max(u[1]) for u in self.units.values() if u[1])

    def check(self, used: int) -> None:
        """The invariants (for tests, after :meth:`settle`): the free blocks are the
        blank and queued ones; each unit's cached blocks are a run from its first, those
        in use below those queued, and its queue entries its queued blocks from the top
        down, in the order freed."""
        assert self.blank >= 0 and self.queued >= 0
        assert self.blank + self.queued == self.total - used, (self.blank, self.queued, used)
        assert self.queued == sum(hi - lo for _, lo, hi in self.queue.values())
        for key, (n, hold, entries) in self.units.items():
            in_use = max(hold) if hold else 0
            assert 0 < n and in_use <= n, (key, n, hold)
            assert all(k > 0 for k in hold.values()), (key, hold)
            top = n
            for eid in entries:
                k, lo, hi = self.queue[eid]
                assert k == key and hi == top and lo < hi, (key, n, lo, hi, top)
                top = lo
            assert top == in_use, (key, n, in_use, top)
        assert sum(len(u[2]) for u in self.units.values()) == len(self.queue)
