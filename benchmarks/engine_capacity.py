"""Capacity under the SLO on a real engine, closed loop: vLLM (CPU) serving static budgets,
vLLM's default and chunkpilot tables on the same arrivals in real time, against the
simulator's prediction for the same arrivals with a profile calibrated on this engine.

    .venv-vllm/bin/python benchmarks/engine_capacity.py --out docs/engine_capacity

1. Writes a random-weight Llama (``SHAPE``; no download) and its model profile.
2. Records vLLM's own steps on calibration arrivals (other seeds than the judged ones)
   and fits a hardware profile named ``cpu`` to them, as a user does for their engine:
   ``python -m envs.calibrate --steps STEPS.csv --model MODEL.toml --name cpu``.
3. Exports a table for that deployment from each rule asked for (``python -m eval export
   --rule RULE --hardware cpu.toml --model MODEL.toml ...``): the table a user serves,
   which must start without ``CHUNKPILOT_ALLOW_MISMATCH``.
4. Finds, in the simulator with that profile, each policy's capacity on each stream
   (``eval.capacity.search_load``): the prediction, and where the real search starts.
5. Finds each policy's capacity on vLLM by the same search over real-time replays of the
   same streams, the policies taking turns probe by probe (a slow spell of this shared
   machine falls on all of them), and pairs them stream by stream as ``eval`` does.
6. Writes ``results.json``, ``README.md`` (measured and predicted capacity per policy,
   each against the best static, paired) and ``capacity.png``.

A probe is one replay of a stream at a load factor (the stream's arrivals compressed by
it); it meets the SLO when the replay's p99 TTFT and p99 ITL meet their targets. The
search brackets from the simulator's estimate by ``--step`` and bisects to ``--rel-tol``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere, as a module under tests
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402

CALIBRATION_SEEDS = (7, 8)
"""Streams the engine's steps are recorded on (never judged)."""
STREAM_SEEDS = (100, 101, 102, 103, 104)
"""The judged streams, in order (``--streams`` takes the first)."""
CEILING = 2048
"""The engine's ``max_num_batched_tokens`` under a table: the model's length."""
WORKLOADS = {
    "mixed": "the mixed workload of `benchmarks/sim_vs_vllm.py` (a quarter 900-1,100-token "
             "prompts with 8 output tokens, the rest 48-96-token prompts with 24-40)",
    "azure-conv": "consecutive windows of the Azure LLM inference trace 2023 (conversation; "
                  "`envs/data/azure_conv_2023.csv`), its own arrival gaps scaled to the load, every "
                  "prompt and output a quarter of its length in the trace (prompts then at most 1,536 "
                  "tokens, outputs 512), since the model is a small fraction of an 8B model's cost "
                  "per token and holds 2,048 tokens",
}
"""The streams a run can judge on (``--workload``)."""
TRACE_PROMPT_MAX, TRACE_OUTPUT_MAX = 1536, 512
TRACE_LENGTH_SCALE = 0.25
"""The trace's lengths at this share: at full length its conversations (median 1,020-token
prompts, 129-token outputs) leave this engine a capacity near 1 req/s, replays of minutes."""
SHAPE = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
             head_dim=64, num_hidden_layers=6, vocab_size=8000)
"""A Llama a fifth of ``sim_vs_vllm``'s per token. On the 2-core machine of the tests a
step of a few decodes takes about 6 ms, a 1,000-token prompt in one step about 150 ms (one
and a half ITL targets of 100 ms) and a 2,000-token one about 540 ms, so that the budget
decides whether long prompts stall the decodes, as a few-thousand-token prompt does for an
8B model on an H100 against its 100 ms target; a replay of 200 mixed requests at its
capacity lasts about 15 s (measured with ``benchmarks/sim_vs_vllm.py``'s step recorder)."""


@dataclass
class Policy:
    """One served arm: a static budget (None: vLLM's default) or a table's path."""

    name: str
    budget: int | None = None
    table: str | None = None
    rule: str | None = None

    def engine_args(self) -> dict:
        if self.table is None:
            return {}
        return {"scheduler_cls": "policies.vllm_scheduler.TableScheduler"}

    def sim_spec(self, default_budget: int) -> str:
        if self.table is not None:
            return f"table:{self.table}"
        if self.rule is not None:  # the rule itself, in the simulator only
            return self.rule
        return f"static:{self.budget if self.budget is not None else default_budget}"


def stream(kind: str, seed: int, rate: float, requests: int):
    """Judged stream ``seed`` of a workload at ``rate`` req/s: for ``mixed`` drawn with that
    seed; for ``azure-conv`` the trace's ``k``-th window of ``requests`` consecutive
    requests (``k`` the seed's place in ``STREAM_SEEDS``), its arrival times rebased and
    scaled so that the window's mean rate is ``rate``, its lengths scaled by
    ``TRACE_LENGTH_SCALE``."""
    from benchmarks.sim_vs_vllm import workload
    from envs.workload import Workload, load_trace

    if kind == "mixed":
        return workload(seed, rate, requests)
    trace = load_trace("azure_conv_2023")
    lo = STREAM_SEEDS.index(seed) * requests
    arrival = trace.arrival_s[lo:lo + requests] - trace.arrival_s[lo]
    arrival = arrival * (len(arrival) / rate) / arrival[-1]
    def scaled(tokens, top):
        return np.clip(np.rint(tokens[lo:lo + requests] * TRACE_LENGTH_SCALE), 1, top).astype(int)

    return Workload.from_arrays(arrival, scaled(trace.prompt_tokens, TRACE_PROMPT_MAX),
                                scaled(trace.output_tokens, TRACE_OUTPUT_MAX),
                                name=f"azure-conv[{lo}:{lo + requests}]")


def replay_meets(summary: dict, ttft_s: float, itl_s: float) -> bool:
    """Whether a replay's p99 TTFT and p99 ITL meet the targets (never one given up as
    failed before its end)."""
    from eval.harness import meets_p99

    return "gave_up_s" not in summary and meets_p99(summary["ttft_p99_s"], summary["itl_p99_s"], ttft_s, itl_s)


def round_robin(searches: dict, probe, step: float, rel_tol: float, max_probes: int,
                low: float = 0.0) -> dict:
    """Every search to its end, one probe of each in turn (``eval.capacity.load_probes``):
    ``searches`` maps a key (policy, stream) to the factor its search starts at;
    ``probe(key, factor)`` replays and returns whether the SLO was met; no search probes
    below ``low`` (0 where the SLO fails even there). Returns {key: (capacity factor,
    [(factor, met), ...])}."""
    from eval.capacity import load_probes

    live = {k: load_probes(start, step, rel_tol, max_probes, low=low) for k, start in searches.items()}
    asked = {k: next(gen) for k, gen in live.items()}
    tried: dict = {k: [] for k in searches}
    out = {}
    while live:
        for k in list(live):
            met = probe(k, asked[k])
            tried[k].append((asked[k], met))
            try:
                asked[k] = live[k].send(met)
            except StopIteration as end:
                out[k] = (end.value, tried[k])
                del live[k]
    return out


def calibrate(model: Path, model_toml: Path, out: Path, requests: int) -> str:
    """Record vLLM's steps on the calibration streams at three budgets and fit the ``cpu``
    profile to them; returns the fit's summary line."""
    from benchmarks.sim_vs_vllm import run_vllm, workload, write_steps

    steps: list = []
    for seed, rate in zip(CALIBRATION_SEEDS, (1.5, 3.0)):
        for budget in (64, 256, CEILING):
            print(f"recording vLLM's steps: budget {budget}, {rate:g} req/s ...", flush=True)
            run_vllm(model, workload(seed, rate, requests), budget, steps)
    write_steps(steps, out / "vllm-steps.csv")
    return fit_profile(out, model_toml)


def fit_profile(out: Path, model_toml: Path) -> str:
    """Fit the ``cpu`` profile (its step spread included) to the steps recorded in
    ``out/vllm-steps.csv``; returns the fit's summary lines, joined."""
    from envs.calibrate import __main__ as calibrate_cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        calibrate_cli.main(["--steps", str(out / "vllm-steps.csv"), "--model", str(model_toml),
                            "--name", "cpu", "--out", str(out / "cpu.toml")])
    return "; ".join(buf.getvalue().splitlines()[:-1])


def replay_jitter(steps: list, out: Path, model_toml: Path) -> str:
    """The calibrated profile with the jitter of the steps the replays served (their own
    shapes, loads and budgets, the machine as it was while they ran), written to
    ``cpu-replays.toml``; returns the jitter's summary line."""
    from dataclasses import replace

    from envs.calibrate.fit import fit_of, shape_parts, unit_roofline
    from envs.calibrate.steps import jitter_line, step_jitter
    from envs.cost import PassShape
    from envs.profiles import get_hardware, get_model, profile_to_toml

    hw, model = get_hardware(str(out / "cpu.toml")), get_model(str(model_toml))
    chunked = [(d, c, t) for (d, c), t in steps if c]
    if chunked:
        parts = shape_parts(unit_roofline(model), [PassShape.of(d, c) for d, c, _ in chunked])
        z, a, b = step_jitter(fit_of(hw).predict(parts), np.array([t for *_, t in chunked]))
    else:
        z, a, b = (), 0.0, 0.0
    line = jitter_line((z, a, b), len(chunked))
    (out / "cpu-replays.toml").write_text(
        f"# cpu.toml with the jitter of {len(steps)} steps the replays served: {line}.\n"
        + profile_to_toml(replace(hw, step_jitter=z, step_jitter_s=a, step_jitter_share=b)))
    return line


def export_tables(rules: list[str], out: Path, model_toml: Path, args) -> dict[str, str]:
    """Each rule's table for this deployment, exported as a user exports one (with the
    chunkpilot environment's Python: the export draws its checks' figures)."""
    tables = {}
    for rule in rules:
        path = out / "tables" / f"{rule.replace(':', '-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [args.chunkpilot_python, "-m", "eval", "export", "--rule", rule, "--hardware",
               str(out / "cpu.toml"), "--model", str(model_toml), "--max-num-seqs", "16",
               "--slo-ttft-s", f"{args.slo_ttft_s:g}", "--slo-itl-s", f"{args.slo_itl_s:g}",
               "--out", str(path)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       stdout=subprocess.DEVNULL)
        tables[rule] = str(path)
    return tables


def vllm_default_budget(model: Path) -> int:
    """The budget vLLM picks when none is given, for this model on this machine."""
    from vllm import EngineArgs

    config = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=2048, max_num_seqs=16, enforce_eager=True,
                        async_scheduling=False).create_engine_config()
    return int(config.scheduler_config.max_num_batched_tokens)


def predict(policies: list[Policy], scenario, default_budget: int, args) -> dict:
    """The simulator's capacity factor of each policy on each judged stream."""
    from eval.capacity import search_load
    from policies.specs import make_policy

    out = {}
    for p in policies:
        policy = make_policy(p.sim_spec(default_budget), scenario)
        for seed in STREAM_SEEDS[:args.streams]:
            def meets(factor: float) -> bool:
                policy.reset()
                w = stream(args.workload, seed, args.base_rate * factor, args.requests)
                s = scenario.simulator(w).run(policy).summary(scenario.slo())
                return replay_meets(s, args.slo_ttft_s, args.slo_itl_s)

            out[(p.name, seed)] = search_load(meets, 1.0, 2.0, 0.02)
    return out


def without_jitter(scenario):
    """The scenario with its profile's passes priced exactly (no step jitter)."""
    return replace(scenario, hardware=replace(scenario.hardware_profile(), step_jitter=()))


def best_static(predicted: dict, streams: list[int], floor: int = 16) -> int:
    """The fine ladder's rung of highest mean predicted capacity (keys ``static:B``)."""
    rungs = {int(name.split(":")[1]) for name, _ in predicted if name.startswith("static:")}
    return max(sorted(rungs), key=lambda b: np.mean([predicted[(f"static:{b}", s)] for s in streams]))


def best_fraction(predicted: dict, streams: list[int]) -> str:
    """The ``time-budget:FRACTION`` of highest mean predicted capacity (the smaller
    fraction on a tie: the safer against a step running long)."""
    names = sorted({name for name, _ in predicted if name.startswith("time-budget:")},
                   key=lambda n: float(n.split(":")[1]))
    return max(names, key=lambda n: np.mean([predicted[(n, s)] for s in streams]))


def replay(model: Path, policy: Policy, seed: int, factor: float, args, steps: list | None = None) -> dict:
    """One real-time replay of a judged stream at a load factor; its latency summary (every
    step's shape and time appended to ``steps``, where given)."""
    from benchmarks.sim_vs_vllm import run_vllm

    os.environ.pop("CHUNKPILOT_ALLOW_MISMATCH", None)  # a deployment's own table must pass its check
    if policy.table is not None:
        os.environ["CHUNKPILOT_TABLE"] = policy.table
    w = stream(args.workload, seed, args.base_rate * factor, args.requests)
    t0 = time.monotonic()
    s = run_vllm(model, w, CEILING if policy.table else policy.budget, steps,
                 slo=(args.slo_ttft_s, args.slo_itl_s), **policy.engine_args())
    s.pop("ttft_s", None)
    return {**s, "wall_s": time.monotonic() - t0}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/engine_capacity")
    ap.add_argument("--work", default="/tmp/chunkpilot-engine-capacity")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.1)
    ap.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS),
                    help="the judged streams: " + "; ".join(f"{k}: {v}" for k, v in WORKLOADS.items()))
    ap.add_argument("--requests", type=int, default=200, help="requests per replay")
    ap.add_argument("--streams", type=int, default=3, help="judged streams (each its own search)")
    ap.add_argument("--calibration-requests", type=int, default=48,
                    help="requests per replay whose steps the profile is fitted to (6 replays)")
    ap.add_argument("--base-rate", type=float, default=1.0, help="req/s at load factor 1")
    ap.add_argument("--rules", default="time-budget",
                    help="rules served as tables exported for this deployment (with the time-budget "
                         "fraction the simulator picks, --fractions); the deadline rules spend the "
                         "p99 ITL slack on passes of 4-16 ITL targets, which this engine's step "
                         "jitter turns into misses (time-budget-deadline-kv:4: 66%% under the best "
                         "static measured, 64%% predicted with the jitter; docs/real_engine.md), so "
                         "they are served only when named")
    ap.add_argument("--fractions", default="0.5,0.6,0.7,0.8,0.9",
                    type=lambda text: [float(x) for x in text.split(",") if x.strip()],
                    help="time-budget fractions the simulator weighs on the fitted profile (its step "
                         "jitter included); the best is served as a table too, as a user picks a rule")
    ap.add_argument("--statics", default="",
                    type=lambda text: sorted({int(x) for x in text.split(",") if x.strip()}),
                    help="static budgets to serve (comma-separated), instead of the simulator's best "
                         "and its --neighbours: a shorter run that compares tables with a known best")
    ap.add_argument("--no-vllm-default", action="store_true",
                    help="do not serve vLLM's default budget (its replays are the longest)")
    ap.add_argument("--neighbours", type=int, default=1,
                    help="static budgets served on each side of the simulator's best (2^(1/2) apart)")
    ap.add_argument("--step", type=float, default=1.25, help="bracketing step from the prediction")
    ap.add_argument("--rel-tol", type=float, default=0.05)
    ap.add_argument("--max-probes", type=int, default=3, help="bisection probes per search")
    ap.add_argument("--longest-replay-s", type=float, default=120.0,
                    help="no load is probed whose replay would last longer (REQUESTS / its rate): a "
                         "policy failing the SLO there is reported as below that rate")
    ap.add_argument("--chunkpilot-python", default="python",
                    help="the Python of chunkpilot's own environment (for the export)")
    ap.add_argument("--report-only", action="store_true", help="re-render README.md from results.json")
    ap.add_argument("--repredict", action="store_true",
                    help="redo the simulator's side only: refit the profile to the recorded steps "
                         "(vllm-steps.csv), predict every policy of results.json again and re-render; "
                         "the engine's measurements are kept (with chunkpilot's Python)")
    args = ap.parse_args(argv)
    for name in ("slo_ttft_s", "slo_itl_s", "base_rate", "rel_tol", "longest_replay_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}, must be > 0")
    if not args.fractions or not all(0 < f <= 2 for f in args.fractions):
        ap.error(f"--fractions: got {args.fractions}, must be fractions in (0, 2]")
    if not all(16 <= b <= CEILING for b in args.statics):
        ap.error(f"--statics: got {args.statics}, each must lie in [16, {CEILING}]")
    if not 1 <= args.streams <= len(STREAM_SEEDS):
        ap.error(f"--streams: got {args.streams}, must lie in [1, {len(STREAM_SEEDS)}]")
    if not 20 <= args.requests <= 3000 or args.step <= 1:
        ap.error(f"--requests: got {args.requests}, must lie in [20, 3000]; --step: got {args.step}, "
                 "must be above 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    if args.report_only:
        print(report(out))
        return 0
    if args.repredict:
        print(repredict(out, args))
        return 0
    from benchmarks.sim_vs_vllm import model_profile_toml, write_model
    from envs.actions import FINE_LADDER
    from envs.scenario import Scenario

    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, model_toml = work / "small-llama", out / "small-llama.toml"
    write_model(model, SHAPE)
    model_profile_toml(model_toml, SHAPE, "small-llama")
    t0 = time.monotonic()
    fit = calibrate(model, model_toml, out, args.calibration_requests)
    print(fit, flush=True)
    default = vllm_default_budget(model)
    scenario = Scenario(hardware=str(out / "cpu.toml"), model=str(model_toml), max_num_seqs=16,
                        slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s)
    # Priced exactly (no jitter): where the searches start and which statics are served. A
    # jitter measured in a noisy spell of the machine would start them far below capacity
    # and serve statics far from the engine's best; the jitter decides the predictions.
    exact = without_jitter(scenario)
    streams = list(STREAM_SEEDS[:args.streams])
    ladder = [b for b in FINE_LADDER if 16 <= b <= CEILING]
    rungs = predict([Policy(f"static:{b}", b) for b in ladder], exact, default, args)
    best = best_static(rungs, streams)
    k = ladder.index(best)
    statics = args.statics or [ladder[i] for i in range(k - 2 * args.neighbours, k + 2 * args.neighbours + 1, 2)
                               if 0 <= i < len(ladder)]
    fractions = predict([Policy(f"time-budget:{f:g}", rule=f"time-budget:{f:g}") for f in args.fractions],
                        scenario, default, args)
    picked = best_fraction(fractions, streams)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    rules += [picked] if picked not in rules and not (picked == "time-budget:0.9" and "time-budget" in rules) else []
    tables = export_tables(rules, out, model_toml, args)
    statics = [b for b in statics if b != default or args.no_vllm_default]  # else served as itself
    policies = ([] if args.no_vllm_default else [Policy("vllm-default", None)])
    policies = (policies + [Policy(f"static:{b}", b) for b in statics]
                + [Policy(f"table:{rule}", table=path, rule=rule) for rule, path in tables.items()])
    predicted = predict(policies, scenario, default, args)
    priced_exactly = predict(policies, exact, default, args)
    results = {"meta": {"slo": [args.slo_ttft_s, args.slo_itl_s], "requests": args.requests,
                        "workload": args.workload,
                        "command": " ".join([".venv-vllm/bin/python benchmarks/engine_capacity.py",
                                             *(argv if argv is not None else sys.argv[1:])]),
                        "streams": streams, "base_rate": args.base_rate, "vllm_default": default,
                        "best_static_predicted": best, "fit": fit, "rules": tables,
                        "fraction_predicted": picked,
                        "search": [args.step, args.rel_tol, args.max_probes]},
               "predicted": {f"{n}|{s}": f for (n, s), f in predicted.items()},
               "predicted_exact": {f"{n}|{s}": f for (n, s), f in priced_exactly.items()},
               "ladder_predicted": {f"{n}|{s}": f for (n, s), f in rungs.items()}, "probes": []}
    by_name = {p.name: p for p in policies}
    replay_steps: list = []

    def probe(key, factor: float) -> bool:
        name, seed = key
        print(f"{name}, stream {seed}: load {factor:.3f} ...", flush=True)
        s = replay(model, by_name[name], seed, factor, args, replay_steps)
        met = replay_meets(s, args.slo_ttft_s, args.slo_itl_s)
        results["probes"].append({"policy": name, "stream": seed, "factor": factor, "met": met, **s})
        (out / "results.json").write_text(json.dumps(results, indent=1))
        return met

    floor = args.requests / (args.base_rate * args.longest_replay_s)
    results["meta"]["floor"] = floor
    starts = {(p.name, s): max(priced_exactly[(p.name, s)], floor) for p in policies for s in streams}
    found = round_robin(starts, probe, args.step, args.rel_tol, args.max_probes, low=floor)
    results["measured"] = {f"{n}|{s}": f for (n, s), (f, _) in found.items()}
    results["meta"]["replay_jitter"] = replay_jitter(replay_steps, out, model_toml)
    replayed = replace(scenario, hardware=str(out / "cpu-replays.toml"))
    results["predicted_replays"] = {f"{n}|{s}": f for (n, s), f in
                                    predict(policies, replayed, default, args).items()}
    results["meta"]["wall_s"] = time.monotonic() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(report(out))
    return 0


def repredict(out: Path, args) -> str:
    """The simulator's side of ``results.json`` again, on a profile refitted to the steps the
    run recorded: for a change to the simulator or the calibration, judged against the same
    measurements without replaying them."""
    from envs.actions import FINE_LADDER
    from envs.profiles import get_hardware
    from envs.scenario import Scenario

    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    args.slo_ttft_s, args.slo_itl_s = meta["slo"]
    args.requests, args.workload, args.base_rate = meta["requests"], meta["workload"], meta["base_rate"]
    args.streams = len(meta["streams"])
    meta["fit"] = fit_profile(out, out / "small-llama.toml")
    print(meta["fit"], flush=True)
    scenario = Scenario(hardware=str(out / "cpu.toml"), model=str(out / "small-llama.toml"),
                        max_num_seqs=16, slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s)
    default = meta["vllm_default"]
    ladder = [b for b in FINE_LADDER if 16 <= b <= CEILING]
    exact = without_jitter(scenario)
    rungs = predict([Policy(f"static:{b}", b) for b in ladder], exact, default, args)
    meta["best_static_predicted"] = best_static(rungs, meta["streams"])
    names = list(dict.fromkeys(k.split("|")[0] for k in data["predicted"]))
    policies = [Policy(n, None) if n == "vllm-default"
                else Policy(n, table=meta["rules"][n[len("table:"):]], rule=n[len("table:"):])
                if n.startswith("table:") else Policy(n, int(n.split(":")[1])) for n in names]
    data["predicted"] = {f"{n}|{s}": f for (n, s), f in predict(policies, scenario, default, args).items()}
    data["predicted_exact"] = {f"{n}|{s}": f for (n, s), f in predict(policies, exact, default, args).items()}
    replays = out / "cpu-replays.toml"
    if replays.exists():  # the replays' jitter on the profile as refitted
        seen = get_hardware(str(replays))
        on = replace(scenario.hardware_profile(), step_jitter=seen.step_jitter,
                     step_jitter_s=seen.step_jitter_s, step_jitter_share=seen.step_jitter_share)
        data["predicted_replays"] = {f"{n}|{s}": f for (n, s), f in
                                     predict(policies, replace(scenario, hardware=on), default, args).items()}
    data["ladder_predicted"] = {f"{n}|{s}": f for (n, s), f in rungs.items()}
    (out / "results.json").write_text(json.dumps(data, indent=1))
    return report(out)


PREDICTIONS = {"predicted": "with the calibration's jitter",
               "predicted_replays": "with the replays' jitter",
               "predicted_exact": "priced exactly"}
"""The simulator's sides of a report: the profile as calibrated (its step jitter from the
calibration replays), with the jitter the judged replays' own steps showed, and without
any jitter."""


def per_stream(block: dict, name: str, streams: list[int], base_rate: float) -> list[float]:
    return [block[f"{name}|{s}"] * base_rate for s in streams]


def ratio_of(top, bottom, floor: float) -> tuple[float, str]:
    """The mean over streams of top / bottom, and "" or the side it bounds: a stream that
    failed at the floor counts at the floor, which makes the ratio a lower bound ('>')
    where it is the bottom's, an upper bound ('<') where it is the top's."""
    if not top or not bottom:
        return float("nan"), ""
    top, bottom = np.asarray(top, dtype=float), np.asarray(bottom, dtype=float)
    mark = ">" if np.any(bottom <= 0) else "<" if np.any(top <= 0) else ""
    if mark and floor <= 0:
        return float("nan"), ""
    return float(np.mean(np.maximum(top, floor) / np.maximum(bottom, floor))), mark


def report(out: Path) -> str:
    """README.md and capacity.png from results.json: measured and predicted capacity per
    policy, each paired stream by stream against its side's best static."""
    from eval.harness import paired_verdict

    data = json.loads((out / "results.json").read_text())
    meta, streams, base = data["meta"], data["meta"]["streams"], data["meta"]["base_rate"]
    floor = meta.get("floor", 0.0) * base
    names = list(dict.fromkeys(k.split("|")[0] for k in data["predicted"]))
    measured = data.get("measured") or {}
    sides = {"measured": measured, **{side: data[side] for side in PREDICTIONS if data.get(side)}}
    caps = {side: {n: per_stream(block, n, streams, base) for n in names
                   if all(f"{n}|{s}" in block for s in streams)} for side, block in sides.items()}
    # vLLM's default is a static budget too (the one vLLM picks)
    best = {side: max((n for n in c if n.startswith("static:") or n == "vllm-default"),
                      key=lambda n: np.mean(c[n]), default=None) for side, c in caps.items()}
    lines = ["| policy | measured on vLLM (req/s) | against the best static measured | "
             + " | ".join(f"predicted, {PREDICTIONS[side]} (req/s) | against the best static so predicted"
                          for side in sides if side != "measured") + " |",
             "|---|---:|---|" + "---:|---|" * (len(sides) - 1)]
    for n in names:
        cells = []
        for side in sides:
            c = caps[side].get(n)
            if c is None or best[side] is None:
                cells += ["not run", ""]
                continue
            v = paired_verdict(c, caps[side][best[side]])
            below = f"<{floor:.2f}"  # failed the SLO at the slowest load probed
            cells += [(below if not np.any(c) else f"{np.mean(c):.2f}")
                      + f" ({', '.join(f'{x:.2f}' if x > 0 else below for x in c)})",
                      "the best static" if n == best[side] else v.cell]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    ratios = []
    pairs = [(f"{n} / best static", n, None) for n in names if n.startswith("table:")]
    if "vllm-default" in names:
        pairs.append(("best static / vLLM's default", None, "vllm-default"))
    for what, top_name, bottom_name in pairs:
        row = []
        for side in sides:
            top, bottom = caps[side].get(top_name or best[side]), caps[side].get(bottom_name or best[side])
            row.append(ratio_of(top, bottom, floor))
        (m, mk), *predictions = row
        ratios.append(f"- {what}: measured {mk}{m:.3f}; predicted " + ", ".join(
            f"{pk}{p:.3f} {PREDICTIONS[side]}" + ("" if mk or pk else f" ({(p - m) * 100:+.1f} points)")
            for side, (p, pk) in zip(list(sides)[1:], predictions)))
    probes = data["probes"]
    wall = sum(p["wall_s"] for p in probes)
    gave_up = sum("gave_up_s" in p for p in probes)
    speed = [p["speed_scale"] for p in probes if "speed_scale" in p]
    text = "\n".join([
        "# Capacity under the SLO on a real engine: vllm-cpu against the simulator", "",
        *([f"Regenerate with `{meta['command']}` (then `--report-only` with chunkpilot's Python "
           "draws `capacity.png`)."] if meta.get("command") else []), "",
        f"SLO: p99 TTFT {meta['slo'][0]:g} s, p99 ITL {meta['slo'][1] * 1e3:g} ms. Each stream is "
        f"{meta['requests']} requests of {WORKLOADS[meta.get('workload', 'mixed')]}, {len(streams)} "
        f"streams ({', '.join(map(str, streams))}); load factor 1 is {base:g} req/s. vLLM's default budget "
        f"here: {meta['vllm_default']} tokens. The simulator's best static on the fine ladder, priced exactly: "
        f"{meta['best_static_predicted']} tokens.", "",
        f"- Profile fitted to this engine's steps in the same sitting: {meta['fit']}.",
        *([f"- The jitter of the steps the replays served (`cpu-replays.toml`): {meta['replay_jitter']}."]
          if meta.get("replay_jitter") else []),
        f"- Tables exported for this deployment: {', '.join(meta['rules'])} (served by "
        "`TableScheduler` without `CHUNKPILOT_ALLOW_MISMATCH`, learning the engine's speed)"
        + (f"; `{meta['fraction_predicted']}` is the time-budget fraction the simulator picks on "
           "the fitted profile, its step jitter included" if meta.get("fraction_predicted") else "") + ".",
        f"- Search per policy and stream: from the simulator's capacity, steps of "
        f"{meta['search'][0]:g}x, then bisection to {meta['search'][1]:.0%} (at most "
        f"{meta['search'][2]} probes); policies take turns probe by probe"
        + (f"; no load below {floor:.2f} req/s is probed (a replay of {meta['requests']} requests "
           f"would last over {meta['requests'] / floor:.0f} s): `<{floor:.2f}` is a policy that "
           "failed the SLO there" if floor > 0 else "") + ".",
        f"- {len(probes)} real-time replays, {wall / 60:.0f} minutes of serving"
        + (f"; {meta['wall_s'] / 60:.0f} minutes in all" if "wall_s" in meta else "")
        + (f". {gave_up} replays stopped as soon as their p99s could no longer meet the SLO"
           if gave_up else "") + ".",
        *([f"- The tables' learnt speed scale at the end of each replay: median "
           f"{np.median(speed):.2f} (range {min(speed):.2f}-{max(speed):.2f}): the engine's steps "
           "against the fitted profile's price."] if speed else []), "",
        "Capacity per policy: the mean over streams (each stream's in brackets), and the verdict "
        "against the best static of the same side, paired stream by stream:", "",
        *lines, "", "Ratios (mean over streams of each stream's ratio):", "", *ratios, ""])
    (out / "README.md").write_text(text)
    plot(caps, out / "capacity.png")
    return text


def plot(caps: dict, png: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # vLLM's environment lacks it: --report-only in chunkpilot's draws it
        print(f"{png}: not drawn (no matplotlib here); run --report-only with chunkpilot's Python")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in caps["predicted"] if n in caps["measured"]]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for n in names:
        m, p = np.asarray(caps["measured"][n]), np.asarray(caps["predicted"][n])
        ax.errorbar(m.mean(), p.mean(), xerr=m.std(), yerr=p.std(), fmt="o", capsize=3, label=n)
    lim = [0, max(max(np.max(caps[s][n]) for n in names) for s in ("measured", "predicted")) * 1.15]
    ax.plot(lim, lim, color="0.6", lw=0.8)
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("capacity measured on vllm-cpu (req/s)")
    ax.set_ylabel("predicted by the simulator, with the calibration's jitter (req/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
