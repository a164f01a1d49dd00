"""A look-ahead bound: at each decision, fork the simulator, roll every budget of the
ladder forward for a short horizon, keep the one whose rollout scores best by the
environment's own reward. Not deployable (it sees the future arrivals of the stream);
it shows how much any controller could gain over the best static budget."""

from __future__ import annotations

from envs.actions import DEFAULT_LADDER, clamp_budget
from envs.reward import RewardMeter, RewardWeights
from policies.base import BudgetPolicy


class LookaheadPolicy(BudgetPolicy):
    """Every rollout covers the same simulated time (``horizon_s``), whatever the number of
    decisions it takes, so budgets are compared over equal spans."""

    kind = "reference"

    def __init__(self, slo, ladder=DEFAULT_LADDER, horizon_s: float = 1.0, max_decisions: int = 5000,
                 weights: RewardWeights | None = None, name: str = "lookahead (bound)"):
        self.slo = slo
        self.ladder = tuple(ladder)
        self.horizon_s = horizon_s
        self.max_decisions = max_decisions
        self.weights = weights or RewardWeights()
        self.name = name

    def budget(self, state) -> int:
        sim = state.simulator
        mean_out = float(sim.workload.output_tokens.mean()) if len(sim.workload) else 1.0
        best, best_score = self.ladder[-1], None
        end = sim.now + self.horizon_s
        for b in self.ladder:
            f = sim.fork()
            meter = RewardMeter(f, self.slo, mean_out, self.weights)
            score = 0.0
            for _ in range(self.max_decisions):
                f.step(clamp_budget(b, f.num_decodes))
                more = f.advance(until_s=end)
                score += meter.reward(*meter.charges(final=not more and f.done))
                if not more or f.now >= end:
                    break
            if best_score is None or score > best_score:
                best, best_score = b, score
        return best
