"""Policy specs, as the command lines name them: ``static:2048``, ``table:PATH``, ...

================================  ==========================================================
``static:N``                      the same budget every pass
``vllm-default[:offline]``        vLLM's default for the hardware (server entry point unless
                                  ``:offline``)
``queue-depth[:BASE]``            the queue-depth heuristic (base chunk 512)
``no-decode-boost[:LOW:HIGH]``    HIGH with nothing decoding, else LOW (2048:16384)
``sarathi-slo``                   Sarathi-Serve's static budget for the ITL target
``free-ride[:FLOOR:CAP]``         running decodes + this pass's free ride (256:16384)
``model:RUN_DIR``                 a model trained by train.py
``table:PATH``                    an exported lookup table
================================  ==========================================================
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from envs.engine import check_static_budget
from envs.errors import ConfigError
from envs.scenario import Scenario
from policies.base import BudgetPolicy

KNOWN = ("static:N", "vllm-default[:offline]", "queue-depth[:BASE]", "no-decode-boost[:LOW:HIGH]",
         "sarathi-slo", "free-ride[:FLOOR:CAP]", "model:RUN_DIR", "table:PATH")


def _ints(spec: str, args: list[str], count: tuple[int, ...]) -> list[int]:
    if len(args) not in count:
        raise ConfigError(f"policy: got {spec!r}, wrong number of arguments; known specs: "
                          f"{', '.join(KNOWN)}")
    try:
        vals = [int(a) for a in args]
    except ValueError:
        raise ConfigError(f"policy: got {spec!r}, arguments must be integers") from None
    if any(v <= 0 for v in vals):
        raise ConfigError(f"policy: got {spec!r}, arguments must be > 0")
    return vals


def load_run(run_dir: str | Path, slo=None, name: str | None = None):
    """The policy of a train.py run directory (its best model when it kept one)."""
    from agents.setup import load_model
    from envs.metrics import SLO
    from policies.learned import ModelPolicy

    run = Path(run_dir)
    config_path = run / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"model: {str(run)!r} is not a train.py run directory (no config.json)")
    config = json.loads(config_path.read_text())
    model_path = run / "best_model.zip" if (run / "best_model.zip").exists() else run / "model.zip"
    if not model_path.exists():
        raise ConfigError(f"model: no model.zip in {str(run)!r}; is training finished?")
    algo = config["args"]["algo"]
    if slo is None:
        sc = config["scenario"]
        slo = SLO(sc["slo_ttft_s"], sc["slo_itl_s"])
    policy = ModelPolicy(load_model(algo, model_path), slo, tuple(config["ladder"]),
                         config["action_type"], name=name or f"model:{run}")
    policy.config = config
    return policy


def load_table_policy(path: str, scenario: Scenario | None = None, name: str | None = None,
                      allow_mismatch: bool = False):
    """A table as a policy. A table built for other hardware, another model shape or another
    SLO than ``scenario``'s is refused (``allow_mismatch``: warned about on stderr)."""
    from policies.table import BudgetTable, TableError, hardware_provenance, model_provenance
    from policies.table_policy import TablePolicy

    try:
        table = BudgetTable.load(path)
    except TableError as err:
        raise ConfigError(f"table: {err}") from None
    if scenario is not None:
        reason = table.mismatch(hardware_provenance(scenario.hardware_profile()),
                                model_provenance(scenario.model_profile()),
                                {"ttft_s": scenario.slo_ttft_s, "itl_s": scenario.slo_itl_s})
        if reason and not allow_mismatch:
            raise ConfigError(f"table: {reason}; pass --allow-table-mismatch to evaluate it anyway")
        if reason:
            print(f"warning: {reason}", file=sys.stderr)
    return TablePolicy(table, name=name or f"table:{path}")


def make_policy(spec: str, scenario: Scenario, allow_table_mismatch: bool = False) -> BudgetPolicy:
    """Build the policy a spec names, for a scenario (some rules read its profiles)."""
    from policies.baselines import (FreeRidePolicy, NoDecodeBoostPolicy, QueueDepthPolicy,
                                    SarathiSLOPolicy, StaticPolicy, VllmDefaultPolicy)

    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    if kind == "static":
        (n,) = _ints(spec, args, (1,))
        check_static_budget(n, scenario.engine_config())
        return StaticPolicy(n)
    if kind == "vllm-default":
        entry = args[0] if args else "server"
        if entry not in ("server", "offline"):
            raise ConfigError(f"policy: got {spec!r}, vllm-default takes :server or :offline")
        return VllmDefaultPolicy(scenario.hardware_profile(), entry)
    if kind == "queue-depth":
        return QueueDepthPolicy(*_ints(spec, args, (0, 1)))
    if kind == "no-decode-boost":
        return NoDecodeBoostPolicy(*_ints(spec, args, (0, 2)))
    if kind == "sarathi-slo" and not args:
        return SarathiSLOPolicy.fit(scenario)
    if kind == "free-ride":
        return FreeRidePolicy(*_ints(spec, args, (0, 2)))
    if kind == "model" and rest:
        return load_run(rest, scenario.slo(), name=spec)
    if kind == "table" and rest:
        return load_table_policy(rest, scenario, name=spec, allow_mismatch=allow_table_mismatch)
    raise ConfigError(f"policy: unknown spec {spec!r}; known: {', '.join(KNOWN)}")


def make_policies(specs: str, scenario: Scenario,
                  allow_table_mismatch: bool = False) -> list[BudgetPolicy]:
    """Comma-separated specs; names must be distinct."""
    policies = [make_policy(s, scenario, allow_table_mismatch) for s in specs.split(",")
                if s.strip()]
    if not policies:
        raise ConfigError(f"policies: got {specs!r}, name at least one; known: {', '.join(KNOWN)}")
    names = [p.name for p in policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"policies: {', '.join(dup)} named twice")
    return policies
