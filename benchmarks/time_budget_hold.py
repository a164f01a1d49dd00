"""Do a time-budget table's passes take their time budgets on a real engine? vLLM (CPU)
serves a rule's table exported for the engine's profile, with that profile as fitted, 2x
too slow and 2x too fast, each with the table's online speed correction and without it,
on the same arrivals; every step's time is set against its time budget.

    .venv-vllm/bin/python benchmarks/time_budget_hold.py --out docs/engine_capacity

It reuses the deployment of ``benchmarks/engine_capacity.py`` (its model shape, the
profile it fitted to this engine and the model profile, under ``--out``). A profile "2x
too slow" prices every step at twice what the fitted one does (bandwidth and FLOP/s
halved, every fixed overhead doubled), as one fitted on a slower day or machine would.

A step is judged where its time budget decided it: decodes were running, a prompt was
being prefilled and the step carried exactly the budget's tokens (fewer means the queue
ran out first; none decoding means the table allowed the ceiling). Its ratio is the gap
its decodes saw (from the previous step's end to its own: the step, ``LLMEngine.step``,
and the serving loop around it) over its time budget (the cell's fraction of the ITL
target). The first :data:`policies.table.correction.WINDOW` such steps of a replay are
left out, with or without the correction: the scale is learnt from them (it moves after
``WARMUP`` of them and has seen a full window after these). Writes ``time_budgets.json``
and ``time_budgets.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402

TIME_FIELDS = ("per_pass_overhead_s", "per_layer_overhead_s", "allreduce_latency_s")
RATE_FIELDS = ("hbm_bytes_per_s", "peak_flops_per_s")


def scaled_profile(src: Path, dst: Path, factor: float) -> None:
    """``src``'s hardware profile pricing every step ``factor`` times as long."""
    hw = tomllib.loads(src.read_text())["hardware"]
    for f in RATE_FIELDS:
        hw[f] = hw[f] / factor
    for f in TIME_FIELDS:
        hw[f] = hw.get(f, 0.0) * factor
    lines = [f"# {src.name} pricing every step {factor:g}x as long (benchmarks/time_budget_hold.py)",
             "[hardware]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in hw.items()]
    dst.write_text("\n".join(lines) + "\n")


def judged(served: list, table, ceiling: int, skip: int) -> list[float]:
    """Each budget-bound prefill step's gap over its time budget, after the first ``skip``
    of them (module docstring)."""
    out = []
    for i, (state, budget, (decodes, chunks), _, end) in enumerate(served):
        if i == 0 or not decodes or not chunks or budget >= ceiling:
            continue
        if len(decodes) + sum(n for n, _ in chunks) != budget:
            continue
        out.append((end - served[i - 1][4]) / (table.action.fraction(state) * table.itl_s))
    return out[skip:]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/engine_capacity",
                    help="engine_capacity's output: its cpu.toml and small-llama.toml are read")
    ap.add_argument("--work", default="/tmp/chunkpilot-engine-capacity")
    ap.add_argument("--rule", default="time-budget")
    ap.add_argument("--factors", default="1,2,0.5", help="profile price over the fitted one")
    ap.add_argument("--load", type=float, default=18.0, help="req/s of the mixed stream")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.1)
    ap.add_argument("--chunkpilot-python", default="python",
                    help="the Python with chunkpilot's dependencies, for the export")
    args = ap.parse_args(argv)
    if not 20 <= args.requests <= 3000:
        ap.error(f"--requests: got {args.requests}, must be in [20, 3000]")
    if not 0 < args.load <= 1000:
        ap.error(f"--load: got {args.load:g}, must be in (0, 1000] req/s")
    try:
        args.factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        ap.error(f"--factors: got {args.factors!r}; must be comma-separated numbers in [0.25, 4]")
    if not all(0.25 <= f <= 4 for f in args.factors):
        ap.error(f"--factors: got {args.factors}; each must be in [0.25, 4] (the correction's bounds)")
    for name in ("cpu.toml", "small-llama.toml"):
        if not (Path(args.out) / name).is_file():
            ap.error(f"--out: {args.out} holds no {name}; run benchmarks/engine_capacity.py first")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from benchmarks.engine_capacity import CEILING, SHAPE, stream
    from benchmarks.sim_vs_vllm import run_vllm, write_model
    from policies.table import BudgetTable
    from policies.table.correction import WINDOW

    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "small-llama"
    write_model(model, SHAPE)
    w = stream("mixed", args.seed, args.load, args.requests)
    rows = []
    t0 = time.monotonic()
    for factor in args.factors:
        profile = work / f"cpu-x{factor:g}.toml"
        scaled_profile(out / "cpu.toml", profile, factor)
        table_path = work / f"{args.rule.replace(':', '-')}-x{factor:g}.json"
        subprocess.run([args.chunkpilot_python, "-m", "eval", "export", "--rule", args.rule,
                        "--hardware", str(profile), "--model", str(out / "small-llama.toml"),
                        "--max-num-seqs", "16", "--slo-ttft-s", f"{args.slo_ttft_s:g}",
                        "--slo-itl-s", f"{args.slo_itl_s:g}", "--out", str(table_path)],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       stdout=subprocess.DEVNULL)
        table = BudgetTable.load(str(table_path))
        for correct in (True, False):
            os.environ.pop("CHUNKPILOT_ALLOW_MISMATCH", None)
            os.environ["CHUNKPILOT_TABLE"] = str(table_path)
            os.environ["CHUNKPILOT_CORRECT_SPEED"] = "1" if correct else "0"
            served: list = []
            s = run_vllm(model, w, CEILING, served=served,
                         scheduler_cls="policies.vllm_scheduler.TableScheduler")
            ratios = np.array(judged(served, table, CEILING, WINDOW))
            row = {"factor": factor, "corrected": correct, "steps": len(served),
                   "judged": int(ratios.size), "speed_scale": s.get("speed_scale"),
                   "itl_p99_s": s["itl_p99_s"], "ttft_p99_s": s["ttft_p99_s"]}
            if ratios.size:
                row.update(median=float(np.median(ratios)), p10=float(np.percentile(ratios, 10)),
                           p90=float(np.percentile(ratios, 90)),
                           within_10pct=float(np.mean(np.abs(ratios - 1) <= 0.10)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = "  ".join([".venv-vllm/bin/python benchmarks/time_budget_hold.py"] + (argv or sys.argv[1:]))
    meta = {"rule": args.rule, "load": args.load, "requests": args.requests, "seed": args.seed,
            "slo": [args.slo_ttft_s, args.slo_itl_s], "wall_s": time.monotonic() - t0,
            "command": " ".join(command.split())}
    (out / "time_budgets.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "time_budgets.md").write_text(report(meta, rows))
    print(report(meta, rows))
    return 0


def report(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Time budgets on the engine they run on", "",
        f"Regenerate with `{meta['command']}`.", "",
        f"The `{meta['rule']}` table, exported for this engine's fitted profile (`cpu.toml`), "
        "for that profile priced 2x too slow and 2x too fast, served by vLLM's "
        "`TableScheduler` with its online speed correction (`CHUNKPILOT_CORRECT_SPEED`, on by "
        "default) and without it, on one stream of the mixed workload "
        f"({meta['requests']} requests at {meta['load']:g} req/s, seed {meta['seed']}; SLO "
        f"{meta['slo'][0]:g} s / {meta['slo'][1] * 1e3:g} ms). Each budget-bound prefill step's "
        "gap (from the previous step's end to its own) over its time budget (see the script's "
        "docstring for which steps); the "
        "learnt scale is the engine's time per second the table's cost model prices, at the "
        "end of the replay:", "",
        "| profile's price | correction | judged steps | median | p10-p90 | within 10% | "
        "learnt scale | p99 ITL |",
        "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if not r["judged"]:  # every budget above what was left to prefill, or the ceiling
            lines.append(f"| {r['factor']:g}x | {'on' if r['corrected'] else 'off'} | 0: no "
                         f"step filled its budget | | | | - | {r['itl_p99_s'] * 1e3:.0f} ms |")
            continue
        scale = f"{r['speed_scale']:.2f}" if r.get("speed_scale") is not None else "-"
        lines.append(f"| {r['factor']:g}x | {'on' if r['corrected'] else 'off'} | {r['judged']} | "
                     f"{r['median']:.2f} | {r['p10']:.2f}-{r['p90']:.2f} | "
                     f"{100 * r['within_10pct']:.0f}% | {scale} | {r['itl_p99_s'] * 1e3:.0f} ms |")
    lines += ["", f"{meta['wall_s'] / 60:.0f} minutes in all.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
