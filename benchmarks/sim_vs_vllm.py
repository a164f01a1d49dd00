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
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, num_hidden_layers=8, vocab_size=8000)


def write_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                 **SHAPE)).save_pretrained(path)


def model_profile_toml(path: Path) -> None:
    h, L = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    heads, kvh, d, inter = (SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"],
                            SHAPE["head_dim"], SHAPE["intermediate_size"])
    # Transformer layers only: vLLM computes logits for sampled positions alone.
    params = L * (h * heads * d * 2 + h * kvh * d * 2 + 3 * h * inter)
    path.write_text(f'[model]\nname = "tiny-llama"\nlayers = {L}\nhidden_size = {h}\nheads = {heads}\n'
                    f'kv_heads = {kvh}\nhead_dim = {d}\nparams = {float(params)}\n'
                    'bytes_per_weight = 4.0\nbytes_per_kv_element = 4.0\n')


def write_steps(steps, path: Path) -> None:
    lines = ["decode_contexts,chunks,seconds"]
    for (decodes, chunks), t in steps:
        lines.append(f"{';'.join(map(str, decodes))},{';'.join(f'{x}@{q}' for x, q in chunks)},{t:.6g}")
    path.write_text("\n".join(lines) + "\n")


def workload(seed: int = 0):
    from envs.workload import Workload

    rng = np.random.default_rng(seed)
    n_short, n_long = 18, 6
    kinds = np.array([0] * n_short + [1] * n_long)
    rng.shuffle(kinds)
    arrivals = np.cumsum(rng.exponential(1.0, len(kinds)))
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


def run_vllm(model: Path, w, budget: int, steps: list | None = None) -> dict:
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
        max_num_batched_tokens=budget, max_num_seqs=16, enforce_eager=True,
        async_scheduling=False, seed=0, enable_prefix_caching=False))
    shapes = attach_step_recorder(engine)
    rng = np.random.default_rng(1)
    pending = list(range(len(w)))
    token_times: dict[str, list[float]] = {}
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and w.arrival_s[pending[0]] <= now:
            i = pending.pop(0)
            ids = rng.integers(3, SHAPE["vocab_size"] - 1, int(w.prompt_tokens[i])).tolist()
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(max_tokens=int(w.output_tokens[i]), temperature=0,
                                              ignore_eos=True))
            token_times[str(i)] = [t0 + float(w.arrival_s[i])]
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, float(w.arrival_s[pending[0]]) - (time.monotonic() - t0)))
            continue
        t_step = time.monotonic()
        n_shapes = len(shapes)
        outs = engine.step()
        t = time.monotonic()
        if steps is not None and len(shapes) > n_shapes and (shapes[-1][0] or shapes[-1][1]):
            steps.append((shapes[-1], t - t_step))
        for o in outs:
            produced = len(o.outputs[0].token_ids) if o.outputs else 0
            times = token_times[o.request_id]
            while len(times) - 1 < produced:
                times.append(t)
    del engine
    ttft = [ts[1] - ts[0] for ts in token_times.values()]
    itl = [b - a for ts in token_times.values() for a, b in zip(ts[1:], ts[2:])]
    return summarize(ttft, itl)


def summarize(ttft, itl) -> dict:
    ttft, itl = np.asarray(ttft), np.asarray(itl)
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(itl, 50)), "itl_p99_s": float(np.percentile(itl, 99)),
            "itl_max_s": float(itl.max())}


def plot_steps(steps_csv: Path, model_toml: Path, hw_toml: Path, png: Path) -> None:
    """Predicted against measured step time, the steps held out of the fit marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from envs.calibrate import held_out, read_steps, shape_parts, unit_roofline
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
    s = sim.run(lambda state: budget).summary()
    return {k: s[k] for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/sim_vs_vllm")
    ap.add_argument("--budgets", default="64,256,2048")
    ap.add_argument("--work", default="/tmp/chunkpilot-sim-vs-vllm")
    ap.add_argument("--repeats", type=int, default=3, help="vLLM runs per budget")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    write_model(model)
    model_toml = work / "tiny-llama.toml"
    model_profile_toml(model_toml)
    hw_toml = out / "cpu-tiny-llama.toml"
    from envs import calibrate

    print("calibrating ...", flush=True)
    import contextlib
    import io

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
    # Profile from the engine's own steps, on other arrivals than the comparison's.
    steps: list = []
    for b in budgets:
        print(f"profiling vLLM steps at budget {b} ...", flush=True)
        run_vllm(model, workload(seed=7), b, steps)
    steps_toml = out / "vllm-steps.toml"
    write_steps(steps, out / "vllm-steps.csv")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        calibrate.main(["--steps", str(out / "vllm-steps.csv"), "--model", str(model_toml),
                        "--name", "vllm-steps", "--out", str(steps_toml)])
    fit_lines = buf.getvalue().splitlines()[:2]
    print(*fit_lines, sep="\n", flush=True)
    plot_steps(out / "vllm-steps.csv", model_toml, steps_toml, out / "steps.png")
    metrics = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s")
    rows = {}
    for b in budgets:
        runs = []
        for rep in range(args.repeats):
            print(f"budget {b}: vLLM run {rep + 1}/{args.repeats} ...", flush=True)
            runs.append(run_vllm(model, w, b))
        real = {m: float(np.median([r[m] for r in runs])) for m in metrics}
        rows[b] = {"vllm": real, "vllm_runs": runs, "sim": run_sim(hw_toml, model_toml, w, b),
                   "sim_steps": run_sim(steps_toml, model_toml, w, b)}
        print(json.dumps(rows[b]), flush=True)
    lines = ["| budget | metric | vLLM, median of runs (range) | sim, torch-calibrated | error "
             "| sim, step-calibrated | error |", "|---:|---|---:|---:|---:|---:|---:|"]
    for b in budgets:
        for m in metrics:
            r, s1, s2 = rows[b]["vllm"][m], rows[b]["sim"][m], rows[b]["sim_steps"][m]
            lo = min(x[m] for x in rows[b]["vllm_runs"]) * 1e3
            hi = max(x[m] for x in rows[b]["vllm_runs"]) * 1e3
            lines.append(f"| {b} | {m} | {r * 1e3:.1f} ms ({lo:.0f}-{hi:.0f}) | {s1 * 1e3:.1f} ms "
                         f"| {(s1 - r) / r:+.0%} | {s2 * 1e3:.1f} ms | {(s2 - r) / r:+.0%} |")
    ranks = []
    for m in metrics:
        orders = {k: sorted(budgets, key=lambda b: rows[b][k][m]) for k in ("vllm", "sim", "sim_steps")}
        ranks.append(f"- {m}: vLLM {orders['vllm']}, torch-calibrated {orders['sim']} "
                     f"({'same' if orders['sim'] == orders['vllm'] else 'DIFFERENT'}), step-calibrated "
                     f"{orders['sim_steps']} ({'same' if orders['sim_steps'] == orders['vllm'] else 'DIFFERENT'})")
    text = "\n".join(["# Simulator against vLLM (CPU)", "",
                      f"Workload: {len(w)} requests ({w.describe()}), Poisson arrivals at 1 req/s; "
                      f"model: random Llama {SHAPE}; vllm-cpu 0.32.0, float32.", "",
                      f"vLLM ran {args.repeats} times per budget on the same arrivals.", "",
                      f"Torch-calibrated profile: {calibration_line}.", "",
                      f"Step-calibrated profile: {fit_lines[0]}. {fit_lines[1]}.", "",
                      *lines, "", "Rankings of the budgets (low to high):", "", *ranks, ""])
    (out / "README.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
