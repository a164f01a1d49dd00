"""The simulator against a real engine: the same small workload through vLLM (CPU) and
through chunkpilot's simulator with a profile calibrated on this machine.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/sim_vs_vllm.py --out docs/sim_vs_vllm

1. Writes a randomly initialised Llama-architecture model (transformers; no download).
2. Calibrates a hardware profile for it with ``envs.calibrate`` (plain torch passes).
3. Records vLLM's own steps (shape and wall time) on other arrivals and fits a second
   profile to them (``envs.calibrate --steps``).
4. Replays one mixed workload (short prompts streaming while long prompts arrive, in
   real time) through vLLM's engine at three static budgets, ``--repeats`` times each
   (this machine is shared and real-time replays vary), timing every token.
5. Simulates the same arrivals at the same budgets with both profiles.
6. Reports TTFT p50/p99 and ITL p50/p99/max side by side (vLLM's median over its runs
   and their range), the relative error of each, whether the budgets rank the same way
   on each metric, and plots predicted against measured step time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402

VOCAB = 8000
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, num_hidden_layers=8, vocab_size=VOCAB)


def write_model(path: Path, shape: dict = SHAPE) -> None:
    """A randomly initialised Llama of ``shape`` (Hugging Face format; no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                 **shape)).save_pretrained(path)


def model_profile_toml(path: Path, shape: dict = SHAPE, name: str = "tiny-llama") -> None:
    """The model profile of ``shape`` for the simulator and the export."""
    import types

    from policies.vllm_startup import dense_params

    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    # Counted as the table schedulers count the served model (embeddings included, as the
    # presets count theirs), so that a table built on this profile passes their check; a
    # step-calibrated profile's fit absorbs what the embeddings do not cost per token.
    params = dense_params(types.SimpleNamespace(**shape, tie_word_embeddings=False))
    path.write_text(f'[model]\nname = "{name}"\nlayers = {L}\nhidden_size = {h}\nheads = {heads}\n'
                    f'kv_heads = {kvh}\nhead_dim = {d}\nparams = {float(params)}\n'
                    'bytes_per_weight = 4.0\nbytes_per_kv_element = 4.0\n')


def write_steps(steps, path: Path) -> None:
    lines = ["decode_contexts,chunks,seconds"]
    for (decodes, chunks), t in steps:
        lines.append(f"{';'.join(map(str, decodes))},{';'.join(f'{x}@{q}' for x, q in chunks)},{t:.6g}")
    path.write_text("\n".join(lines) + "\n")


def workload(seed: int = 0, rate: float = 1.0, requests: int = 48):
    """Short prompts streaming while long ones arrive: a quarter are 900-1,100-token
    prompts with 8 output tokens, the rest 48-96-token prompts with 24-40."""
    from envs.workload import Workload

    rng = np.random.default_rng(seed)
    n_long = requests // 4
    n_short = requests - n_long
    kinds = np.array([0] * n_short + [1] * n_long)
    rng.shuffle(kinds)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(kinds)))
    arrivals -= arrivals[0]
    prompts = np.where(kinds == 1, rng.integers(900, 1100, len(kinds)), rng.integers(48, 96, len(kinds)))
    outputs = np.where(kinds == 1, 8, rng.integers(24, 40, len(kinds)))
    return Workload.from_arrays(arrivals, prompts, outputs, name="mixed-cpu")


def attach_step_recorder(engine):
    """Record, for every engine step, the shape vLLM scheduled (each decode's context, each
    chunk's size and prefix) next to the step's wall time."""
    sched = engine.engine_core.engine_core.scheduler
    original = sched.schedule
    shapes = []

    def schedule(*args, **kwargs):
        before = {r.request_id: r.num_computed_tokens for r in list(sched.running) + list(sched.waiting)}
        out = original(*args, **kwargs)
        decodes, chunks = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            done = before.get(rid, 0)
            if n == 1 and done >= req.num_prompt_tokens:
                decodes.append(done)
            else:
                chunks.append((n, done))
        shapes.append((decodes, chunks))
        return out

    sched.schedule = schedule
    return shapes


class SloWatch:
    """Whether a replay has already failed its SLO, whatever the rest of it does: p99 TTFT
    and p99 ITL (``np.percentile``'s linear interpolation over every request's TTFT and
    every gap) exceed their targets as soon as the order statistic p99 starts from does,
    that is once ``n - floor(0.99 (n - 1))`` of the ``n`` values to come are over the
    target. A request still waiting for its first token, or a running one waiting for its
    next, longer than the target is one of them already. Sound, not complete: a replay it
    lets finish may still fail by the interpolation."""

    def __init__(self, output_tokens, slo_ttft_s: float, slo_itl_s: float):
        self.ttft_s, self.itl_s = slo_ttft_s, slo_itl_s
        outputs = np.asarray(output_tokens, dtype=int)
        self.need_ttft = self._need(len(outputs))
        self.need_itl = self._need(int(np.maximum(outputs - 1, 0).sum()))
        self.over_ttft = self.over_itl = 0
        self.open: dict[str, tuple[list, int]] = {}  # request: (token times, outputs to come)

    @staticmethod
    def _need(n: int) -> float:
        return n - int(np.floor(0.99 * (n - 1))) if n else math.inf

    def add(self, rid: str, times: list, outputs: int) -> None:
        """A request arrived; ``times`` (its arrival, then each token's time) grows as it runs."""
        self.open[rid] = (times, outputs)

    def tokens(self, rid: str, before: int, finished: bool = False) -> None:
        """``rid``'s ``times`` grew from ``before`` entries: count the new TTFT and gaps
        (``finished``: the engine is done with it, all its outputs given or not)."""
        times, outputs = self.open[rid]
        for k in range(max(before, 1), len(times)):
            if k == 1:
                self.over_ttft += times[1] - times[0] > self.ttft_s
            else:
                self.over_itl += times[k] - times[k - 1] > self.itl_s
        if finished or len(times) - 1 >= outputs:
            del self.open[rid]

    def failed(self, now: float) -> bool:
        ttft, itl = self.over_ttft, self.over_itl
        for times, _ in self.open.values():
            if len(times) == 1:
                ttft += now - times[0] > self.ttft_s
            else:
                itl += now - times[-1] > self.itl_s
        return ttft >= self.need_ttft or itl >= self.need_itl


def run_vllm(model: Path, w, budget: int | None, steps: list | None = None,
             served: list | None = None, slo: tuple[float, float] | None = None,
             prompts: list | None = None, **engine_args) -> dict:
    """Replay ``w`` in real time through vLLM at a static ``budget`` (None: vLLM's
    default; ``engine_args``: more of ``EngineArgs``, a ``scheduler_cls`` say), timing every
    token; ``steps``, where given, collects every step's shape and wall time; ``served``,
    under a table's scheduler, every step's (state read, budget set, shape, wall time,
    time it ended on ``time.monotonic``). With ``slo`` (p99 TTFT and ITL targets) the
    replay stops as soon as it cannot meet them (:class:`SloWatch`); its summary then has
    ``gave_up_s``, the replay's time at that point, and describes what was served so far.
    ``prompts``: each request's token ids (default: random ones); prefix caching is off
    unless ``engine_args`` turn it on (``enable_prefix_caching=True``)."""
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    if budget is not None:
        engine_args["max_num_batched_tokens"] = budget
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
        max_num_seqs=16, enforce_eager=True, async_scheduling=False, seed=0,
        **{"enable_prefix_caching": False, **engine_args}))
    shapes = attach_step_recorder(engine)
    scheduler = engine.engine_core.engine_core.scheduler
    rng = np.random.default_rng(1)
    pending = list(range(len(w)))
    token_times: dict[str, list[float]] = {}
    watch = SloWatch(w.output_tokens, *slo) if slo is not None else None
    gave_up = None
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        if watch is not None and watch.failed(t0 + now):
            gave_up = now
            break
        while pending and w.arrival_s[pending[0]] <= now:
            i = pending.pop(0)
            ids = (prompts[i] if prompts is not None
                   else rng.integers(3, VOCAB - 1, int(w.prompt_tokens[i])).tolist())
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(max_tokens=int(w.output_tokens[i]), temperature=0,
                                              ignore_eos=True))
            token_times[str(i)] = [t0 + float(w.arrival_s[i])]
            if watch is not None:
                watch.add(str(i), token_times[str(i)], int(w.output_tokens[i]))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, float(w.arrival_s[pending[0]]) - (time.monotonic() - t0)))
            continue
        t_step = time.monotonic()
        n_shapes = len(shapes)
        outs = engine.step()
        t = time.monotonic()
        if steps is not None and len(shapes) > n_shapes and (shapes[-1][0] or shapes[-1][1]):
            steps.append((shapes[-1], t - t_step))
        if served is not None and len(shapes) > n_shapes and (shapes[-1][0] or shapes[-1][1]):
            served.append((*scheduler.chunkpilot_history[-1], shapes[-1], t - t_step, t))
        for o in outs:
            produced = len(o.outputs[0].token_ids) if o.outputs else 0
            times = token_times[o.request_id]
            before = len(times)
            while len(times) - 1 < produced:
                times.append(t)
            if watch is not None and o.request_id in watch.open:
                watch.tokens(o.request_id, before, o.finished)
    speed = getattr(scheduler, "chunkpilot_speed", None)
    del engine
    ttft = [ts[1] - ts[0] for ts in token_times.values() if len(ts) > 1]
    itl = [b - a for ts in token_times.values() for a, b in zip(ts[1:], ts[2:])]
    return {**summarize(ttft, itl), **({"speed_scale": speed.value} if speed is not None else {}),
            **({"gave_up_s": gave_up} if gave_up is not None else {})}


def summarize(ttft, itl) -> dict:
    """Means, medians and p99s of TTFT and ITL (NaN where there is none, as in a replay
    given up before a first token)."""
    ttft, itl = np.asarray(ttft, dtype=float), np.asarray(itl, dtype=float)

    def stat(x, f, *a):
        return float(f(x, *a)) if len(x) else math.nan

    return {"ttft_mean_s": stat(ttft, np.mean), "ttft_p50_s": stat(ttft, np.percentile, 50),
            "ttft_p99_s": stat(ttft, np.percentile, 99), "itl_mean_s": stat(itl, np.mean),
            "itl_p50_s": stat(itl, np.percentile, 50), "itl_p99_s": stat(itl, np.percentile, 99),
            "itl_max_s": stat(itl, np.max), "ttft_s": [round(float(t), 5) for t in ttft]}


def plot_steps(steps_csv: Path, model_toml: Path, hw_toml: Path, png: Path) -> None:
    """Predicted against measured step time, the steps held out of the fit marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from envs.calibrate.fit import held_out, shape_parts, unit_roofline
    from envs.calibrate.steps import read_steps
    from envs.cost import PassShape, Roofline, price
    from envs.profiles import get_hardware, get_model

    steps = read_steps(str(steps_csv))
    rf = Roofline.of(get_hardware(str(hw_toml)), get_model(str(model_toml)))
    measured = np.array([t for _, _, t in steps]) * 1e3
    predicted = np.array([price(rf, PassShape.of(c, k)).total_s for c, k, _ in steps]) * 1e3
    prefill = shape_parts(unit_roofline(get_model(str(model_toml))),
                          [PassShape.of([], k) for _, k, _ in steps])[:, 2] > 0
    held = held_out(len(steps))
    fig, ax = plt.subplots(figsize=(5, 5))
    for mask, label, marker in ((held & ~prefill, "held out, decode-only", "o"),
                                (held & prefill, "held out, with prefill", "s"),
                                (~held, "fitted", ".")):
        ax.scatter(measured[mask], predicted[mask], s=12 if marker == "." else 18, marker=marker,
                   label=label, alpha=0.5 if marker == "." else 0.9)
    lim = [min(measured.min(), predicted.min()) * 0.8, max(measured.max(), predicted.max()) * 1.2]
    ax.plot(lim, lim, color="0.5", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vLLM step, measured (ms)")
    ax.set_ylabel("simulator pass, predicted (ms)")
    ax.set_title("vllm-cpu 0.32.0 steps against the step-calibrated profile", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def run_sim(hw_path: Path, model_path: Path, w, budget: int) -> dict:
    from envs.engine import EngineConfig, Simulator

    sim = Simulator(str(hw_path), str(model_path), w, EngineConfig(max_num_seqs=16))
    res = sim.run(lambda state: budget)
    s = res.summary()
    out = {k: s[k] for k in METRICS}
    out["ttft_s"] = [round(float(t), 5) for t in res.ttft_s]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/sim_vs_vllm")
    ap.add_argument("--budgets", default="64,256,2048")
    ap.add_argument("--work", default="/tmp/chunkpilot-sim-vs-vllm")
    ap.add_argument("--repeats", type=int, default=3, help="vLLM runs per budget")
    ap.add_argument("--report-only", action="store_true", help="re-render RESULTS.md from results.json")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    if args.report_only:
        print(report(out))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    write_model(model)
    model_toml = out / "tiny-llama.toml"
    model_profile_toml(model_toml)
    hw_toml = out / "cpu-tiny-llama.toml"
    from envs.calibrate import __main__ as calibrate

    print("calibrating ...", flush=True)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        calibrate.main(["--model", str(model_toml), "--layers", str(SHAPE["num_hidden_layers"]),
                        "--scale", "0.5", "--repeats", "3", "--name", "cpu-tiny-llama", "--out",
                        str(hw_toml), "--csv", str(out / "calibration.csv")])
    print(buf.getvalue(), flush=True)
    calibration_line = "; ".join(line for line in buf.getvalue().splitlines()
                                 if line.startswith(("fit (", "held-out shapes", "plain roofline")))
    w = workload()
    budgets = [int(b) for b in args.budgets.split(",")]
    # Profile from the engine's own steps, on other arrivals than the comparison's, at
    # the comparison's load and at twice it, so that the steps cover the batch sizes a
    # queue builds up at the smallest budget.
    steps: list = []
    for seed, rate in ((7, 1.0), (8, 2.0)):
        for b in budgets:
            print(f"profiling vLLM steps at budget {b}, {rate:g} req/s ...", flush=True)
            run_vllm(model, workload(seed=seed, rate=rate), b, steps)
    steps_toml = out / "vllm-steps.toml"
    overhead_toml = out / "vllm-overhead.toml"
    write_steps(steps, out / "vllm-steps.csv")
    fit_lines = []
    for extra, path, name in (((), steps_toml, "vllm-steps"),
                              (("--hardware", str(hw_toml)), overhead_toml, "cpu-tiny-llama+vllm")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            calibrate.main(["--steps", str(out / "vllm-steps.csv"), "--model", str(model_toml),
                            "--name", name, "--out", str(path), *extra])
        fit_lines.append("; ".join(buf.getvalue().splitlines()[:-1]))
        print(fit_lines[-1], flush=True)
    # Runs go round the budgets in turn, so that a slow spell of this shared machine
    # does not fall on one budget's runs alone.
    runs: dict[int, list] = {b: [] for b in budgets}
    for rep in range(args.repeats):
        for b in budgets:
            print(f"budget {b}: vLLM run {rep + 1}/{args.repeats} ...", flush=True)
            runs[b].append(run_vllm(model, w, b))
    rows = {}
    for b in budgets:
        runs_b = runs[b]
        rows[b] = {"vllm": {m: float(np.median([r[m] for r in runs_b])) for m in METRICS},
                   "vllm_runs": runs_b, **{key: run_sim(path, model_toml, w, b) for key, path in
                                         (("sim", hw_toml), ("sim_overhead", overhead_toml),
                                          ("sim_steps", steps_toml))}}
        print(json.dumps(rows[b]), flush=True)
    meta = {"workload": f"{len(w)} requests ({w.describe()}), Poisson arrivals at 1 req/s: a quarter are "
                        f"900-1,100-token prompts with 8 output tokens, the rest 48-96-token prompts "
                        f"with 24-40",
            "model": f"random Llama {SHAPE}", "repeats": args.repeats,
            "torch_fit": calibration_line, "step_fit": fit_lines[0], "overhead_fit": fit_lines[1]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "budgets": rows}, indent=2))
    plot_steps(out / "vllm-steps.csv", model_toml, steps_toml, out / "steps.png")
    print(report(out))


METRICS = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "itl_mean_s", "itl_p50_s", "itl_p99_s", "itl_max_s")
MEDIANS = ("ttft_p50_s", "itl_p50_s")
PROFILES = (("sim", "torch-calibrated"), ("sim_overhead", "torch + vLLM step overhead"),
            ("sim_steps", "step-calibrated"))


def ranking(rows: dict, budgets: list[int], key: str, metric: str) -> str:
    """'same' when the simulator orders the budgets as vLLM's medians do; 'same where
    vLLM separates them' when it differs only between budgets whose vLLM runs overlap;
    else 'DIFFERENT'."""
    order = sorted(budgets, key=lambda b: rows[b][key][metric])
    if order == sorted(budgets, key=lambda b: rows[b]["vllm"][metric]):
        return f"{order} (same)"
    for i, a in enumerate(budgets):
        for b in budgets[i + 1:]:
            ra = [r[metric] for r in rows[a]["vllm_runs"]]
            rb = [r[metric] for r in rows[b]["vllm_runs"]]
            separated = max(ra) < min(rb) or max(rb) < min(ra)
            sim_says = rows[a][key][metric] < rows[b][key][metric]
            if separated and sim_says != (max(ra) < min(rb)):
                return f"{order} (DIFFERENT)"
    return f"{order} (same where vLLM's runs separate the budgets)"


def step_excess(out: Path, model_toml: Path) -> str:
    """How much longer vLLM's steps take than the torch-calibrated price of their shapes."""
    from envs.calibrate.steps import read_steps
    from envs.cost import PassShape, Roofline, price
    from envs.profiles import get_hardware, get_model

    steps = read_steps(str(out / "vllm-steps.csv"))
    rf = Roofline.of(get_hardware(str(out / "cpu-tiny-llama.toml")), get_model(str(model_toml)))
    excess = np.array([t - price(rf, PassShape.of(c, k)).total_s for c, k, t in steps])
    decode = np.array([not k for _, k, _ in steps])
    return (f"vLLM's steps take {np.median(excess[decode]) * 1e3:.1f} ms longer (median) than the "
            f"torch-calibrated price of their shapes when they only decode "
            f"({int(decode.sum())} steps), {np.median(excess[~decode]) * 1e3:.1f} ms longer when "
            f"they carry prompt chunks ({int((~decode).sum())} steps)")


def report(out: Path) -> str:
    """Render README.md from results.json (``--report-only`` redoes just this)."""
    data = json.loads((out / "results.json").read_text())
    meta, rows = data["meta"], {int(b): r for b, r in data["budgets"].items()}
    budgets = sorted(rows)
    model_toml = out / "tiny-llama.toml"
    head = "| budget | metric | vLLM, median of runs (range) | " + " | ".join(
        f"sim, {label} | error" for _, label in PROFILES) + " |"
    lines = [head, "|---:|---|---:|" + "---:|---:|" * len(PROFILES)]
    worst = {key: 0.0 for key, _ in PROFILES}
    for b in budgets:
        for m in METRICS:
            r = rows[b]["vllm"][m]
            lo = min(x[m] for x in rows[b]["vllm_runs"]) * 1e3
            hi = max(x[m] for x in rows[b]["vllm_runs"]) * 1e3
            cells = []
            for key, _ in PROFILES:
                v = rows[b][key][m]
                cells.append(f"{v * 1e3:.1f} ms | {(v - r) / r:+.0%}")
                if m in MEDIANS:
                    worst[key] = max(worst[key], abs(v - r) / r)
            lines.append(f"| {b} | {m} | {r * 1e3:.1f} ms ({lo:.0f}-{hi:.0f}) | " + " | ".join(cells) + " |")
    quant = ["| budget | TTFT p30 / p40 / p50 / p60 / p70 | " + " | ".join(
        label for _, label in PROFILES) + " |", "|---:|---|" + "---|" * len(PROFILES)]
    qs = (30, 40, 50, 60, 70)
    for b in budgets:
        pooled = [t for run in rows[b]["vllm_runs"] for t in run["ttft_s"]]
        cells = [" / ".join(f"{np.percentile(rows[b][key]['ttft_s'], q) * 1e3:.0f}" for q in qs)
                 for key, _ in PROFILES]
        quant.append(f"| {b} | vLLM, all runs: " + " / ".join(
            f"{np.percentile(pooled, q) * 1e3:.0f}" for q in qs) + " ms | " + " | ".join(cells) + " |")
    ranks = []
    for m in METRICS:
        vllm = sorted(budgets, key=lambda b: rows[b]["vllm"][m])
        ranks.append(f"- {m}: vLLM {vllm}; " + "; ".join(
            f"{label} {ranking(rows, budgets, key, m)}" for key, label in PROFILES))
    text = "\n".join([
        "# Simulator against vLLM (CPU): measured figures", "",
        f"Workload: {meta['workload']}; model: {meta['model']}; vllm-cpu 0.32.0, float32. "
        f"vLLM ran {meta['repeats']} times per budget on the same arrivals.", "",
        f"- Torch-calibrated profile: {meta['torch_fit']}.",
        f"- Torch + vLLM step overhead: {meta['overhead_fit']}.",
        f"- Step-calibrated profile: {meta['step_fit']}.",
        f"- {step_excess(out, model_toml)}.", "",
        *lines, "",
        "Largest error on a TTFT or ITL median: " + ", ".join(
            f"{label} {worst[key]:.0%}" for key, label in PROFILES) + ".", "",
        "TTFT quantiles (ms). Short prompts either arrive while only decodes run or queue "
        "behind a long prompt's prefill, so TTFT has two modes and its median can sit in "
        "the gap between them:", "", *quant, "",
        "Rankings of the budgets (low to high):", "", *ranks, ""])
    (out / "RESULTS.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
