"""Budget ladders and the mapping from an action to a pass's token budget (pure)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

DEFAULT_LADDER = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""The environment's discrete actions: log-spaced budgets, 64 to 16,384 tokens."""

STATIC_LADDER = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""Static budgets every comparison runs for reference (those >= max_num_seqs)."""

FRACTION_LADDER = (tuple(round(2 ** (k / 4), 4) for k in range(-8, -4))
                   + tuple(round(2 ** (k / 8), 4) for k in range(-8, 1))
                   + (1.4142, 2.0, 4.0, 8.0, 16.0))
"""The environment's default actions: a pass's time budget as a fraction of the ITL
target, 0.25 to 0.5 in steps of 2^(1/4), then to 1 in steps of 2^(1/8), fine where the
p99 cliff is; and a few beyond it, up to 16. A pass priced over the target makes every
decode token in it slow, which a p99 target tolerates for 1% of tokens only, so a
constant above 1 is ruinous (a constant 1.19 loses 20 times the return of a constant 1);
but while the slack lasts (the observation's ``itl_slack``), a long pass prefills a long
prompt in fewer, cheaper passes (on an A100 with bursty long prompts, up to 4x the target
while under 0.8% of decode tokens run slow ties the best static budget, where the
fraction 1 loses a fifth; an L40S wants up to 16x), which only a state-dependent policy
can use."""

BUDGET_CAP = 16384
"""The largest budget a time fraction turns into (and the budget with nothing decoding)."""


def time_budget(roofline, num_decodes: int, decode_context_tokens: int, prefix_tokens: int,
                seconds: float, cap: int = BUDGET_CAP) -> int:
    """Tokens for a pass whose priced duration must stay within ``seconds``: the running
    decodes plus the largest chunk after the head request's ``prefix_tokens`` that fits
    (``envs.cost.chunk_within``). With nothing decoding no one's ITL is at stake and
    chunking only delays the prompt, so it is the cap."""
    from envs.cost import chunk_within

    n = num_decodes
    if n == 0:
        return cap
    return n + chunk_within(roofline, n, decode_context_tokens, seconds, prefix_tokens,
                            cap=max(cap - n, 0))


def action_value(action, ladder: Sequence[float], action_type: str = "discrete") -> float:
    """An action's value: a ladder index (discrete), or a value in [-1, 1] mapped linearly
    to the log of the value between the ladder's ends (continuous)."""
    if action_type == "discrete":
        if isinstance(action, (int, np.integer)):  # the common case, without numpy overhead
            return ladder[int(action)]
        return ladder[int(np.asarray(action).reshape(-1)[0])]
    a = float(np.clip(np.asarray(action, dtype=np.float64).reshape(-1)[0], -1.0, 1.0))
    lo, hi = math.log(ladder[0]), math.log(ladder[-1])
    return math.exp(lo + (a + 1) / 2 * (hi - lo))


def budget_from_action(action, ladder: Sequence[int], action_type: str = "discrete") -> int:
    """Tokens for an action on a token ladder (see :func:`action_value`)."""
    return int(round(action_value(action, ladder, action_type)))


def pass_budget(sim, actions: str, value: float, itl_s: float) -> int:
    """The budget of ``sim``'s next pass for an action's value: a token budget
    (``actions="tokens"``) or a fraction of the ITL target turned into tokens with this
    pass's decodes (``"time"``, :func:`time_budget`)."""
    if actions == "tokens":
        return clamp_budget(int(value), sim.num_decodes)
    head = sim.head()
    return time_budget(sim.roofline, sim.num_decodes, sim.decode_context_tokens,
                       head.computed if head else 0, value * itl_s)


def clamp_budget(budget: int, num_decodes: int) -> int:
    """Never below the running decodes (each must get its token: vLLM would not schedule
    them otherwise, and the simulator refuses it), and at least one token."""
    return max(int(budget), num_decodes, 1)
