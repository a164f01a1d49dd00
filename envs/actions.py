"""Budget ladders and the mapping from an action to a pass's token budget (pure)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

DEFAULT_LADDER = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""The environment's discrete actions: log-spaced budgets, 64 to 16,384 tokens."""

STATIC_LADDER = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""Static budgets every comparison runs for reference (those >= max_num_seqs)."""


def budget_from_action(action, ladder: Sequence[int], action_type: str = "discrete") -> int:
    """Tokens for an action: a ladder index, or a value in [-1, 1] mapped linearly to
    log2 of the budget between the ladder's ends."""
    if action_type == "discrete":
        if isinstance(action, (int, np.integer)):  # the common case, without numpy overhead
            return ladder[int(action)]
        return ladder[int(np.asarray(action).reshape(-1)[0])]
    a = float(np.clip(np.asarray(action, dtype=np.float64).reshape(-1)[0], -1.0, 1.0))
    lo, hi = math.log2(ladder[0]), math.log2(ladder[-1])
    return int(round(2 ** (lo + (a + 1) / 2 * (hi - lo))))


def clamp_budget(budget: int, num_decodes: int) -> int:
    """Never below the running decodes (each must get its token: vLLM would not schedule
    them otherwise, and the simulator refuses it), and at least one token."""
    return max(int(budget), num_decodes, 1)
