"""Train and export the shipped tables: one policy per (hardware, model), each served at
the SLO of the suite's scenarios on that deployment.

    python -m agents.presets                      # every preset, one after another
    python -m agents.presets --only h200__llama-3-8b --total-timesteps 300000

Each preset is a ``train.py`` run in ``runs/presets/HARDWARE__MODEL`` followed by
``python -m eval export`` to ``tables/HARDWARE__MODEL.json`` (and ``.csv``). The sweeps
inside each (capacities, checks, the final comparison, the table's fidelity) fan out on
Ray as ``--workers`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.cli import parse
from envs.errors import ConfigError, run_cli

# (hardware, model) -> train.py flags of its serving scenario.
PRESETS: dict[tuple[str, str], list[str]] = {
    ("h100-sxm", "llama-3-8b"): [],
    ("h200", "llama-3-8b"): [],
    ("a100-80g", "llama-3-8b"): ["--rate", "2"],
    ("l40s", "llama-3-8b"): ["--rate", "1.5"],
    ("m5-max", "llama-3-8b-q4"): ["--workload", "laptop", "--slo-ttft-s", "10", "--slo-itl-s", "0.2"],
    ("h100-sxm", "llama-3-70b-tp4"): ["--workload", "mooncake", "--slo-ttft-s", "30"],
}


@dataclass(frozen=True)
class PresetArgs:
    """Train and export the table of every (hardware, model) preset."""

    only: str | None = None
    """Comma-separated HARDWARE__MODEL names (default: all of them)."""
    total_timesteps: int = 500_000
    """Training steps per preset."""
    runs: str = "runs/presets"
    """Folder of the training runs."""
    tables: str = "tables"
    """Folder of the exported tables."""
    workers: int | None = None
    """Sweeps on a local Ray instance with this many CPUs (default: all cores)."""
    seed: int = 1
    """Seed of every run."""


def name_of(hardware: str, model: str) -> str:
    return f"{hardware}__{model}"


def main(argv: list[str] | None = None) -> int:
    import train
    from eval.export import main as export_main

    args = parse(PresetArgs, argv, prog="python -m agents.presets")
    chosen = {name_of(*k): (k, v) for k, v in PRESETS.items()}
    names = list(chosen) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in chosen]
    if unknown:
        raise ConfigError(f"only: unknown {', '.join(unknown)}; known: {', '.join(chosen)}")
    workers = [] if args.workers is None else ["--workers", str(args.workers)]
    for name in names:
        (hardware, model), flags = chosen[name]
        run = f"{args.runs}/{name}"
        print(f"== {name}: training in {run}", flush=True)
        code = train.main(["--hardware", hardware, "--model", model, "--run-dir", run,
                           "--total-timesteps", str(args.total_timesteps), "--seed", str(args.seed),
                           "--no-progress-bar", *flags, *workers])
        if code:
            return code
        print(f"== {name}: exporting to {args.tables}/{name}.json", flush=True)
        export_main([run, "--out", f"{args.tables}/{name}.json", "--csv",
                     f"{args.tables}/{name}.csv", *workers])
    return 0


if __name__ == "__main__":
    run_cli(main)
