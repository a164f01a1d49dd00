"""One interface for everything that picks a pass's token budget.

A policy is called with the simulator's :class:`~envs.engine.SchedulerState` and
returns a budget in tokens (``policy(state) -> int``), so :meth:`Simulator.run`
and the evaluation harness run any of them on the same arrivals. Policies also
offer stable-baselines3's ``predict(observation, state, episode_start,
deterministic) -> (action, state)`` over the environment's observations, so SB3's
own evaluation code runs them too.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from envs.actions import DEFAULT_LADDER, clamp_budget
from envs.observation import ObservedState


class BudgetPolicy:
    """Base class: subclasses implement :meth:`budget`."""

    name = "policy"
    kind = "rule"
    """What the policy is, for reports: static (one budget), rule (hand-written, adaptive),
    learned (a trained model), table (an exported lookup table) or reference (not
    deployable: it sees the future)."""
    ladder: Sequence[int] = DEFAULT_LADDER
    max_num_seqs = 256

    def budget(self, state) -> int:
        """Tokens for the next pass, given the scheduler's state."""
        raise NotImplementedError

    def __call__(self, state) -> int:
        return clamp_budget(self.budget(state), state.running_decodes)

    def reset(self) -> None:
        """Forget anything remembered from an earlier run."""

    # --- stable-baselines3 protocol -----------------------------------------------------

    def action_for_budget(self, budget: int) -> int:
        """The ladder index nearest to ``budget`` in log scale."""
        logs = np.log2(np.asarray(self.ladder, dtype=float))
        return int(np.argmin(np.abs(logs - math.log2(max(budget, 1)))))

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        """SB3's protocol over the environment's observations: the scheduler counts are
        recovered from the observation and the rule maps them to the nearest ladder rung.
        ``max_num_seqs`` must match the environment's (it scales running decodes)."""
        obs = np.asarray(observation, dtype=np.float64)
        rows = obs.reshape(-1, obs.shape[-1])
        actions = np.array([self.action_for_budget(self(ObservedState(row, self.max_num_seqs)))
                            for row in rows], dtype=np.int64)
        return (actions if obs.ndim > 1 else actions[0]), state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
