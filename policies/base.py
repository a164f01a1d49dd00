"""One interface for everything that picks a pass's token budget.

A policy is called with the simulator's :class:`~envs.engine.SchedulerState` and
returns a budget in tokens (``policy(state) -> int``), so :meth:`Simulator.run`
and the evaluation harness run any of them on the same arrivals. Policies also
offer stable-baselines3's ``predict(observation, state, episode_start,
deterministic) -> (action, state)`` over the environment's observations, so SB3's
own evaluation code runs them too.

A policy knows itself: its class declares the spec a user types for it (``spec``), the
parameters the spec takes (``params``, each with its default and range), what kind of
policy it is, whether it acts in time and whether it is a diagnostic rather than a
policy to serve; its ``name`` is its spec as a user would type it (``time-budget-slack:16``,
``static:2048``). Reports, pairings and exports read these, never a parsed name.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple, Sequence

import numpy as np

from envs.actions import DEFAULT_LADDER, capped_budget, clamp_budget
from envs.errors import MAX_TOKENS, ConfigError, show
from envs.observation import ObservedState


class Param(NamedTuple):
    """One parameter of a policy's spec: ``spec:VALUE``, in the order declared."""

    name: str
    """The attribute the policy keeps it in."""
    kind: type
    """int or float."""
    default: float | int | None
    """None: the spec needs it."""
    low: float
    """Values must exceed this..."""
    high: float
    """...and be at most this."""
    what: str
    """How the error names it (``TOP multiple of the ITL target``)."""

    def text(self) -> str:
        """The parameter as the spec listing shows it: ``TOP`` of ``TOP multiple ...``."""
        return self.what.split()[0]

    def parse(self, spec: str, text: str):
        """``text`` as this parameter, or one line naming the spec and the range."""
        if self.kind is int:
            high = min(self.high, MAX_TOKENS)
            try:
                v = int(text)
            except ValueError:
                v = None
            if v is None or not self.low < v <= high:
                raise ConfigError(f"policy: got {show(spec)}, {self.what} must be an integer in "
                                  f"[{int(self.low) + 1}, {int(high)}]")
            return v
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not self.low < v <= self.high:  # NaN fails too
            raise ConfigError(f"policy: got {show(spec)}, {self.what} must lie in "
                              f"({self.low:g}, {self.high:g}]")
        return v


def tighter(a: float | None, b: float | None) -> float | None:
    """The smaller of two caps, either None for no cap."""
    return b if a is None else a if b is None else min(a, b)


class BudgetPolicy:
    """Base class: subclasses implement :meth:`budget` and declare who they are."""

    spec: ClassVar[str] = ""
    """The spec's first part (``time-budget-deadline``); empty for a policy no spec names."""
    params: ClassVar[tuple[Param, ...]] = ()
    kind: ClassVar[str] = "rule"
    """What the policy is, for reports: static (one budget), default (an engine's default),
    rule (hand-written, adaptive), learned (a trained model), table (an exported lookup
    table) or reference (not deployable: it sees the future)."""
    summary: ClassVar[str] = ""
    """One line for the spec listing (``python -m eval --help``)."""
    acts_in_time: ClassVar[bool] = False
    """Whether each pass's budget is a fraction of the ITL target (a teacher the learned
    policy, which acts in time, can clone)."""
    diagnostic: ClassVar[bool] = False
    """A measuring device, not a policy to serve (a table's flat twin, the reference)."""
    exact: ClassVar[bool | None] = None
    """For a time rule, whether a lookup table holds it exactly (its ``exact_table()``): True
    where its fraction is chosen by thresholds on quantities an engine has, False where it
    moves continuously; None for a policy that is not a time rule."""
    ladder: Sequence[int] = DEFAULT_LADDER
    max_num_seqs = 256
    max_pass_s: float | None = None
    """The longest pass this controller makes while anyone decodes, seconds (None: no
    cap): the operator's stall cap (``Scenario.max_pass_itl``, set by :meth:`limit_pass`)."""

    def budget(self, state) -> int:
        """Tokens for the next pass, given the scheduler's state."""
        raise NotImplementedError

    def serving(self) -> tuple[str, str] | None:
        """How a real engine serves this policy: ``("budget", N)`` a fixed
        ``--max-num-batched-tokens N``; ``("default", N)`` the engine's own default, N;
        ``("rule", SPEC)`` a time rule through its exact table (``eval export --rule``);
        ``("model", RUN_DIR)`` a trained run exported as a table (``eval export RUN_DIR``);
        ``("table", PATH)`` a table file. None where no engine can serve it as it is: a
        diagnostic, or a rule whose fraction moves continuously (no table holds it)."""
        if self.diagnostic or not self.exact:
            return None
        return "rule", self.name

    def __call__(self, state) -> int:
        budget = self.budget(state)
        if self.max_pass_s is not None:
            budget = capped_budget(state, budget, self.max_pass_s)
        return clamp_budget(budget, state.running_decodes)

    def limit_pass(self, scenario) -> "BudgetPolicy":
        """This policy under ``scenario``'s cap on the longest pass (``max_pass_itl``): every
        adaptive policy honours it; a static budget, the engine's own setting, does not."""
        self.max_pass_s = tighter(self.max_pass_s, scenario.max_pass_s())
        return self

    def reset(self) -> None:
        """Forget anything remembered from an earlier run."""

    # --- identity -------------------------------------------------------------------------

    def param_values(self) -> tuple:
        """The declared parameters' values, in order."""
        return tuple(getattr(self, p.name) for p in self.params)

    @property
    def name(self) -> str:
        """The spec a user types for this policy: its parameters, where one differs from
        its default (all of them then, in order: a spec's arguments are positional); a
        policy named by a path (a table, a model) keeps the spec as it was typed."""
        given = self.__dict__.get("_name")
        if given:
            return given
        values = self.param_values()
        if all(v == p.default for v, p in zip(values, self.params)):
            return self.spec
        return ":".join([self.spec, *(f"{v:g}" if isinstance(v, float) else str(v) for v in values)])

    @name.setter
    def name(self, value: str) -> None:
        self.__dict__["_name"] = value

    @classmethod
    def usage(cls) -> str:
        """The spec's form: ``time-budget-slack[:TOP]``, ``static:N``."""
        required = [p.text() for p in cls.params if p.default is None]
        optional = [p.text() for p in cls.params if p.default is not None]
        head = ":".join([cls.spec, *required])
        return head + ("[:" + ":".join(optional) + "]" if optional else "")

    @classmethod
    def parse_params(cls, spec: str, args: list[str]) -> list:
        """The spec's arguments as its declared parameters, checked (one line naming the
        spec otherwise): the required ones, and the optional ones all or none (defaults
        fill them), as :meth:`usage` shows them."""
        required = sum(p.default is None for p in cls.params)
        if len(args) not in (required, len(cls.params)):  # the optional ones all, or none
            if len(cls.params) == 1 and not required:
                raise ConfigError(f"policy: got {show(spec)}, takes one {cls.params[0].what}")
            raise ConfigError(f"policy: got {show(spec)}, wrong number of arguments: {cls.usage()}")
        values = []
        for p, text in zip(cls.params, args + [None] * (len(cls.params) - len(args))):
            if text is None:
                values.append(p.default)
                continue
            values.append(p.parse(spec, text))
        return values

    @classmethod
    def from_spec(cls, spec: str, args: list[str], scenario, options: dict):
        """The policy ``spec`` names (``args``: its parts after the first) for ``scenario``."""
        return cls(*cls.parse_params(spec, args))

    # --- what a teacher does, read from observations --------------------------------------

    def observed_fractions(self, observations: np.ndarray, max_num_seqs: int = 256) -> np.ndarray:
        """The fraction of the ITL target this rule picks in each raw observation (rows of
        ``envs.observation.observe``): what a learned policy acting in time clones."""
        raise ConfigError(f"teacher: {self.name} does not act in time (a fraction of the ITL "
                          "target per pass); a learned policy cannot clone it")

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
