"""Budget ladders and the mapping from an action to a pass's token budget (pure)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from envs.pricing import state_budget

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

FINE_LADDER = tuple(int(round(64 * 2 ** (k / 4))) for k in range(33))
"""64, 76, 91, 108, 128, 152, ... 13,777, 16,384: every static budget a user might pick (the
hindsight-best static budget is searched on it: DESIGN.md section 5)."""
POWERS_OF_TWO = FINE_LADDER[::4]

MIN_PASS_ITL, MAX_PASS_ITL = FRACTION_LADDER[0], FRACTION_LADDER[-1]
"""The range of an operator's cap on the longest pass, in ITL targets
(``Scenario.max_pass_itl``): the action ladder's ends."""

BUDGET_CAP = 16384
"""The largest budget a time fraction turns into (and the budget with nothing decoding)."""


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


def pass_budget(state, actions: str, value: float, itl_s: float,
                max_pass: float | None = None) -> int:
    """The budget of the next pass in scheduler ``state`` for an action's value: a token
    budget (``actions="tokens"``) or a fraction of the ITL target turned into tokens with
    this pass's decodes (``"time"``, :func:`envs.pricing.time_budget`); either no longer
    than ``max_pass`` times the ITL target while anyone decodes (None: no cap)."""
    if actions == "tokens":
        budget = clamp_budget(int(value), state.running_decodes)
        return budget if max_pass is None else capped_budget(state, budget, max_pass * itl_s)
    if max_pass is not None:
        value = min(value, max_pass)
    return state_budget(state.cost, state, value * itl_s, BUDGET_CAP)


def capped_budget(state, budget: int, max_pass_s: float) -> int:
    """``budget``, cut where a pass of it would be priced over ``max_pass_s`` while anything
    decodes (the operator's stall cap; with nothing decoding no one's tokens wait). The
    price grows with the budget, so a time rule capped so equals the rule at its fraction
    or the cap, whichever is smaller."""
    n = state.running_decodes
    if not n:
        return budget
    return min(budget, state_budget(state.cost, state, max_pass_s, max(budget, n)))


def clamp_budget(budget: int, num_decodes: int) -> int:
    """Never below the running decodes (each must get its token: vLLM would not schedule
    them otherwise, and the simulator refuses it), and at least one token."""
    return max(int(budget), num_decodes, 1)
