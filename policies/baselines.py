"""Static budgets and hand-written adaptive rules."""

from __future__ import annotations

import numpy as np

from policies.base import BudgetPolicy


class StaticPolicy(BudgetPolicy):
    """The same budget every pass: what engines do today."""

    def __init__(self, tokens: int, name: str | None = None):
        self.tokens = int(tokens)
        self.name = name or f"static:{self.tokens}"

    def budget(self, state) -> int:
        return self.tokens

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        obs = np.asarray(observation)
        action = self.action_for_budget(self.tokens)
        if obs.ndim > 1:  # a batch of observations (vectorised envs)
            return np.full(obs.shape[0], action), state
        return np.int64(action), state


def vllm_default_budget(hardware, entry_point: str = "server") -> int:
    """vLLM's default ``max_num_batched_tokens`` (V1, ``EngineArgs``): 8,192 for the
    OpenAI server and 16,384 for the offline ``LLM`` class on parts with at least 70 GiB
    that are not A100s (H100/H200-class); 2,048 and 8,192 on A100 and smaller parts."""
    large = hardware.memory_bytes >= 70 * 2**30 and "a100" not in hardware.name.lower()
    if entry_point == "server":
        return 8192 if large else 2048
    if entry_point == "offline":
        return 16384 if large else 8192
    from envs.errors import ConfigError
    raise ConfigError(f"entry_point: got {entry_point!r}, must be 'server' or 'offline'")
