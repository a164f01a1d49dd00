"""Workloads whose prompts share prefixes (envs/sharing.py): conversations resend
themselves, agents share instructions, and the simulator's cache finds what an
independent count of repeated leading blocks finds."""

from __future__ import annotations

import numpy as np
import pytest

from envs.engine import EngineConfig, Simulator
from envs.errors import ConfigError
from envs.scenario import Scenario
from envs.sharing import HASH_BLOCK_TOKENS, parse_sharing, repeated_share
from envs.workload import SyntheticSpec


def build(sharing: str, n: int = 200, seed: int = 0, **kw):
    spec = SyntheticSpec(rate=2.0, num_requests=n, prompt="uniform:20:300",
                         output="uniform:5:120", sharing=sharing, **kw)
    return spec.build(seed)


def test_each_turn_resends_the_conversation_so_far():
    w = build("conversation:3", n=30)
    k = 10  # 30 requests, 3 turns: 10 conversations at a time, a turn every 10th arrival
    for i in range(k):
        first, second, third = i, i + k, i + 2 * k
        # turn 2's prompt: turn 1's prompt and answer, then its own text
        assert w.prompt_tokens[second] > w.prompt_tokens[first] + w.output_tokens[first]
        assert w.prompt_tokens[third] > w.prompt_tokens[second] + w.output_tokens[second]
        # its ids start with every full block of turn 1's prompt and answer
        shared = (int(w.prompt_tokens[first] + w.output_tokens[first])) // HASH_BLOCK_TOKENS
        assert np.array_equal(w.block_hashes[second][:shared], w.block_hashes[first][:shared])
        # then a block no request named before: turn 1's last partial block with new text
        assert w.block_hashes[second][shared] not in set(w.block_hashes[first].tolist())
    assert w.hashes_cover_output
    # the ids go on into each answer: ceil((prompt + output) / 16) of them
    assert all(len(ids) == -(-int(p + o) // HASH_BLOCK_TOKENS)
               for ids, p, o in zip(w.block_hashes, w.prompt_tokens, w.output_tokens))


def test_conversations_take_turns_in_arrival_order():
    own = build("none", n=12)
    w = build("conversation:2", n=12)  # 6 at a time: arrivals 0-5 first turns, 6-11 second
    assert np.array_equal(w.prompt_tokens[:6], own.prompt_tokens[:6])
    assert np.array_equal(w.prompt_tokens[6:], own.prompt_tokens[:6] + own.output_tokens[:6]
                          + own.prompt_tokens[6:])
    one = build("conversation:1", n=8)
    assert np.array_equal(one.prompt_tokens, build("none", n=8).prompt_tokens)
    assert repeated_share(one) == 0.0  # one turn: nothing repeats


def test_users_start_new_conversations_after_their_turns():
    own = build("none", n=8)
    w = build("conversation:2:2", n=8)  # 2 users: 0-1 first turns, 2-3 second, 4-5 first again
    assert np.array_equal(w.prompt_tokens[[0, 1, 4, 5]], own.prompt_tokens[[0, 1, 4, 5]])
    assert np.array_equal(w.prompt_tokens[[2, 3, 6, 7]], own.prompt_tokens[[0, 1, 4, 5]]
                          + own.output_tokens[[0, 1, 4, 5]] + own.prompt_tokens[[2, 3, 6, 7]])
    first_round = set(np.concatenate(w.block_hashes[:4]).tolist())
    assert not first_round & set(w.block_hashes[4].tolist())  # a new conversation shares nothing
    # The default: every conversation at once, as many as the stream has room for.
    assert np.array_equal(build("conversation:2", n=12).prompt_tokens,
                          build("conversation:2:6", n=12).prompt_tokens)
    # With the users fixed, a turn follows its user's last one 10 arrivals on, however long
    # the stream; the default spreads them over it.
    for n in (200, 2000):
        w = build("conversation:4:10", n=n)
        for i in range(0, n - 10):
            shares = w.block_hashes[i + 10][0] == w.block_hashes[i][0]
            assert shares == ((i // 10) % 4 != 3), (n, i)  # a fourth turn ends a conversation
    spread = build("conversation:4", n=2000)  # 500 users: the next turn 500 arrivals on
    assert spread.block_hashes[500][0] == spread.block_hashes[0][0]
    assert spread.block_hashes[10][0] != spread.block_hashes[0][0]


def test_an_agent_prefix_is_the_share_hit_of_the_prompt_on_average():
    own = build("none", n=400)
    for hit in (0.5, 0.9):
        w = build(f"agent:{hit}:4", n=400)
        prefix = int(w.prompt_tokens[0] - own.prompt_tokens[0])
        assert np.all(w.prompt_tokens - own.prompt_tokens == prefix)  # the same own texts
        assert prefix / w.prompt_tokens.mean() == pytest.approx(hit, abs=0.01)
        # four prefixes: the first request of each misses, then each repeats its prefix's
        # full blocks
        assert repeated_share(w) == pytest.approx(
            hit * (prefix // HASH_BLOCK_TOKENS * HASH_BLOCK_TOKENS) / prefix, abs=0.02)
    nothing = build("agent:0:3", n=50)  # no prefix: nothing repeats
    assert repeated_share(nothing) == 0.0


@pytest.mark.parametrize("sharing", ["conversation:4", "agent:0.7:3"])
def test_an_unbounded_cache_hits_what_repeats(sharing):
    """With a pool that never evicts, and arrivals far apart (every earlier request has
    finished, its blocks cached), the simulated hit rate is the independent count."""
    w = build(sharing, n=120)
    spread = type(w)(w.arrival_s * 1000, w.prompt_tokens, w.output_tokens, w.name, w.block_hashes,
                     w.hash_block_tokens, w.hashes_cover_output)
    sim = Simulator("h100-sxm", "llama-3-8b", spread, EngineConfig(num_kv_blocks=10**6))
    s = sim.run(lambda state: 2048).summary()
    assert s["prefix_hit_rate_tokens"] == pytest.approx(repeated_share(w),
                                                        abs=1e-12)


def test_the_same_seed_draws_the_same_workload_and_the_same_arrivals_as_without_sharing():
    a, b = build("conversation:3"), build("conversation:3")
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert all(np.array_equal(x, y) for x, y in zip(a.block_hashes, b.block_hashes))
    plain = build("none")
    assert plain.block_hashes is None
    assert np.array_equal(plain.arrival_s, a.arrival_s)  # sharing draws after the arrivals


@pytest.mark.parametrize("bad", ["conversation", "conversation:0", "conversation:2:0", "conversation:2:3:4",
                                 "agent:1.5", "agent:0.5:0",
                                 "agent:x", "chat:3", "none:1", ""])
def test_a_bad_spec_is_one_line_naming_the_field(bad):
    with pytest.raises(ConfigError, match="^sharing: got"):
        parse_sharing(bad)
    with pytest.raises(ConfigError, match="^sharing: got"):
        Scenario(sharing=bad)
