"""``python -m policies.table``: check a budget table against hardware, a model and an SLO,
or show it in one line (see the table runtime, ``policies/table/__init__.py``)."""

from __future__ import annotations

import argparse
import re
import sys

from envs.cli import close_flags
from envs.errors import MAX_SLO_ITL_S, MAX_SLO_TTFT_S, ConfigError, slo_seconds
from envs.profiles import get_hardware, get_model
from envs.scenario import Scenario
from policies.table import BudgetTable, TableError, hardware_provenance, model_provenance


def _served(args) -> tuple[dict | None, dict | None, dict | None]:
    """The provenance blocks that the command line describes (presets or profile files)."""
    hardware = model = None
    if args.hardware or args.model:
        try:
            hardware = hardware_provenance(get_hardware(args.hardware)) if args.hardware else None
            model = model_provenance(get_model(args.model)) if args.model else None
        except ConfigError as err:
            raise TableError(str(err)) from None
    slo = None
    if args.slo_ttft_s is not None or args.slo_itl_s is not None:
        for flag, v, high in (("--slo-ttft-s", args.slo_ttft_s, MAX_SLO_TTFT_S),
                              ("--slo-itl-s", args.slo_itl_s, MAX_SLO_ITL_S)):
            if v is not None:
                try:
                    slo_seconds(flag, v, high)
                except ConfigError as err:
                    raise TableError(str(err)) from None
        slo = {"ttft_s": args.slo_ttft_s, "itl_s": args.slo_itl_s}
    return hardware, model, slo


def fidelity_lines(fid: dict) -> list[str]:
    """What the export recorded the table does (its ``fidelity``), a line per measure:
    capacity and goodput against its model, against its flat twin, the rule check."""
    lines = []
    for key, what, sign in (("capacity", "capacity against its model", -1),
                            ("goodput", "goodput at load against its model", -1),
                            ("against_flat", "capacity against its flat twin", 1)):
        rows = fid.get(key, {})
        rows = rows.get("scenarios", {}) if key == "against_flat" else rows
        parts = []
        for name, f in rows.items():
            value, half = (f.get("loss"), f.get("loss_ci95")) if sign < 0 else (f.get("gain"), f.get("gain_ci95"))
            if value is None:
                continue
            parts.append(f"{name} {sign * value:+.1%}" + (f" ± {half:.1%}" if half else "")
                         + f" ({f.get('verdict', 'not judged')})")
        if parts:
            twin = (f" ({fid['against_flat']['fraction']:g} of the ITL target in every cell)"
                    if key == "against_flat" else "")
            lines.append(f"{what}{twin}: " + "; ".join(parts))
    check = fid.get("rule_check")
    if check:
        lines.append(f"checked against the rule at {check['passes']:,} passes: {check['differ']} differ")
    return lines or ["no fidelity recorded"]


def main(argv: list[str] | None = None) -> int:
    class _Parser(argparse.ArgumentParser):
        def __init__(self, *args, **kwargs):  # flags whole: --slo-i is no --slo-itl-s
            super().__init__(*args, **{"allow_abbrev": False, **kwargs})

        def error(self, message):  # one line naming the field and exit 2, as every chunkpilot command
            m = re.match(r"argument (--[\w-]+)(?:/[^:]*)?: (.*)", message, re.S)
            if m:
                message = f"{m[1][2:].replace('-', '_')}: {m[2]}"
            print(f"error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
            sys.exit(2)

    ap = _Parser(prog="python -m policies.table",
                 description="Check a budget table against hardware, a model and an SLO.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = sub.add_parser("check", help="exit 0 if TABLE fits, else 2 with the reason")
    check.add_argument("table")
    check.add_argument("--hardware", help="preset name or .toml/.json profile (envs/profiles.py)")
    check.add_argument("--model", help="preset name or .toml/.json profile")
    check.add_argument("--slo-ttft-s", type=float, help="TTFT target, seconds")
    check.add_argument("--slo-itl-s", type=float, help="ITL target, seconds")
    show = sub.add_parser("show", help="what the table is, what built it, its recorded fidelity")
    show.add_argument("table")
    args, extra = ap.parse_known_args(argv)
    if extra:  # named against the subcommand's own flags, which its --help lists
        sp = sub.choices[args.command]
        near = close_flags(extra, [o for a in sp._actions for o in a.option_strings])
        sp.error(f"unrecognized arguments: {' '.join(extra)}"
                 + (f"; did you mean {near}?" if near else ""))
    try:
        table = BudgetTable.load(args.table)
        if args.command == "show":
            print(table.describe())
            print(f"what it is: {table.origin()}")
            for line in fidelity_lines(table.fidelity or {}):
                print(line)
            print(table.room_text() or "room beyond the best rule: not measured (python -m "
                  "agents.presets --room measures it for a preset's table)")
            return 0
        served = _served(args)
        if table.deployment_range is not None:
            return _check_carries(table, args)
        reason = table.mismatch(*served)
    except TableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if reason:
        print(f"mismatch: {reason}", file=sys.stderr)
        return 2
    compared = [x for x, given in (("hardware " + str(args.hardware), args.hardware),
                                   ("model " + str(args.model), args.model),
                                   ("SLO", args.slo_ttft_s or args.slo_itl_s)) if given]
    print(f"ok: {args.table} fits " + (", ".join(compared) if compared else "(nothing compared; "
                                       "the table is valid)"))
    return 0


def _check_carries(table: BudgetTable, args) -> int:
    """The check of a table that carries: re-priced for the deployment the command line
    names (hardware and model; the SLO its own unless given), it must lie within the
    range of deployments the table was trained over."""
    if not (args.hardware or args.model):
        print(f"ok: {args.table} is valid and carries to other deployments (give --hardware and "
              "--model to check one)")
        return 0
    if not (args.hardware and args.model):
        raise TableError(f"{args.table}: carries to other deployments: give both --hardware and "
                         "--model (and the SLO served, if not its own) to check one")
    slo = table.provenance["slo"]
    try:
        sc = Scenario(hardware=args.hardware, model=args.model,
                      slo_ttft_s=args.slo_ttft_s or slo["ttft_s"], slo_itl_s=args.slo_itl_s or slo["itl_s"])
        d = sc.deployment()
    except ConfigError as err:
        raise TableError(str(err)) from None
    priced, reason = table.for_deployment(sc.simulator_cost(), d.slo_ttft_s, d.slo_itl_s,
                                          sc.kv_tokens())
    if reason:
        print(f"mismatch: {reason}", file=sys.stderr)
        return 2
    print(f"ok: {args.table} carries to hardware {args.hardware}, model {args.model}, SLO TTFT "
          f"{d.slo_ttft_s:g} s / ITL {d.slo_itl_s:g} s: re-priced for it "
          f"({', '.join(f'{k} {v:.3g}' for k, v in d.as_dict().items() if not k.startswith('slo'))}"
          f"; {len(priced.action.cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
