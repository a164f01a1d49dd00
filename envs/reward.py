"""The environment's reward, kept apart from it (pure: no gymnasium) so that look-ahead
controllers score their rollouts by exactly the same objective."""

from __future__ import annotations

from dataclasses import dataclass

from envs.metrics import SLO


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the per-step reward's three charges (see the env docstring)."""

    ttft_miss: float = 1.0
    """Per request whose wait crosses the TTFT target without a first token."""
    ttft_wait: float = 0.05
    """Per TTFT-target's worth of waiting accrued by requests without a first token."""
    itl_excess: float = 1.0
    """Per mean-output-length's worth of decode tokens, times each one's excess gap over
    the ITL target in units of that target."""


class DeadlineClock:
    """TTFT deadlines as they pass: each request is judged once, when its deadline (arrival +
    TTFT target) is behind the simulator's clock, so a charge lands on the passes that
    caused it, not on the one that finally serves the request."""

    def __init__(self, sim, ttft_s: float):
        self.sim, self.ttft_s = sim, ttft_s
        # Requests whose deadline has already passed were judged before this clock.
        reqs, j = sim.requests, 0
        while j < len(reqs) and reqs[j].arrival + ttft_s <= sim.now:
            j += 1
        self.pos = j

    def missed(self, final: bool = False) -> int:
        """Deadlines that passed since the last call without a first token (``final``: every
        request left, the run being over)."""
        reqs, j, now, target = self.sim.requests, self.pos, self.sim.now, self.ttft_s
        miss = 0
        while j < len(reqs) and (reqs[j].arrival + target <= now or final):
            r = reqs[j]
            if not r.warm and not (r.first_token_s <= r.arrival + target):
                miss += 1
            j += 1
        self.pos = j
        return miss


class SLOMeter:
    """SLO violations of the passes a simulator ran since the last call: TTFT deadlines
    missed, and decode tokens whose gap exceeded the ITL target (the two things a p99
    target counts)."""

    def __init__(self, sim, slo: SLO):
        self.sim, self.slo = sim, slo
        self.clock = DeadlineClock(sim, slo.ttft_s)
        self.log_mark = sim.log.position()

    def charges(self, final: bool = False) -> tuple[int, int]:
        """(TTFT deadlines missed, decode tokens over the ITL target)."""
        slow, self.log_mark = self.sim.log.tokens_over_since(self.log_mark, self.slo.itl_s)
        return self.clock.missed(final), slow


class RewardMeter:
    """Charges of the passes a simulator ran since the last call (the env's reward)."""

    def __init__(self, sim, slo: SLO, mean_output: float, weights: RewardWeights | None = None):
        self.sim, self.slo, self.weights = sim, slo, weights or RewardWeights()
        self.mean_output = max(mean_output, 1.0)
        self.log_mark = sim.log.position()
        self.clock = DeadlineClock(sim, slo.ttft_s)
        self.ttft_accrued = sim.ttft_accrued()

    def reward(self, miss: float, wait: float, itl: float) -> float:
        w = self.weights
        return -(w.ttft_miss * miss + w.ttft_wait * wait + w.itl_excess * itl)

    def charges(self, final: bool = False) -> tuple[int, float, float]:
        """(TTFT deadlines missed, accrued wait / TTFT target, ITL excess / mean output)."""
        sim, slo = self.sim, self.slo
        miss = self.clock.missed(final)
        target = slo.ttft_s
        accrued = sim.ttft_accrued()
        wait = (accrued - self.ttft_accrued) / target
        self.ttft_accrued = accrued
        # Decode tokens of the passes simulated since, by their excess gap.
        excess, self.log_mark = sim.log.itl_excess_since(self.log_mark, slo.itl_s)
        return miss, wait, excess / slo.itl_s / self.mean_output
