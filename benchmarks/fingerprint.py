"""Fingerprints of what the project computes, to show that a change of code kept them.

    python benchmarks/fingerprint.py --out /tmp/fp-before [--quick]
    ... change the code ...
    python benchmarks/fingerprint.py --out /tmp/fp-after --against /tmp/fp-before

Each item is a JSON document written to ``--out/NAME.json`` and hashed (sha256 of its
canonical text, run times left out); ``--against`` prints, per item, "same" or the first
keys where the two documents differ. The items:

- ``simulate-*``: ``python -m envs.simulate --json`` on the Azure hour and on a synthetic
  stream under KV pressure (preemptions) with a chunk cap;
- ``rules-*``: every rule and shipped table run on streams with preemption, idle spells
  and partial prefills (summaries, and each pass's budget);
- ``compare``, ``capacity``: ``python -m eval compare/capacity --json`` on two streams;
- ``tables``: every shipped table's budget on a fixed grid of engine states;
- ``train`` (not with ``--quick``): a short ``train.py`` run's ``summary.json`` and the
  checks in its ``config.json`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMING_KEYS = {"wall_s", "passes_per_s", "train_s", "commit", "exported", "run_dir"}


def scrub(x):
    """``x`` without its timings and paths (which differ between any two runs)."""
    if isinstance(x, dict):
        return {k: scrub(v) for k, v in x.items() if k not in TIMING_KEYS}
    if isinstance(x, list):
        return [scrub(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


def run_json(*argv: str) -> dict:
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def simulate_items() -> dict:
    return {
        "simulate-azure": run_json("-m", "envs.simulate", "--trace", "azure_conv_2023",
                                   "--budget", "2048", "--json"),
        "simulate-pressure": run_json("-m", "envs.simulate", "--rate", "6", "--arrival", "gamma",
                                      "--burstiness", "0.5", "--num-requests", "400",
                                      "--num-kv-blocks", "3000", "--long-prefill-token-threshold",
                                      "1024", "--budget", "1536", "--json"),
    }


RULES = ("vllm-default", "queue-depth", "no-decode-boost", "free-ride", "sarathi-slo",
         "time-budget", "time-budget-kv", "time-budget-few", "time-budget-slack",
         "time-budget-slack-kv", "time-budget-deadline", "time-budget-deadline-kv:16",
         "time-budget-deadline:16")


def rule_items() -> dict:
    """Rules and tables on streams with preemptions, idle spells and partial prefills."""
    from envs.scenario import Scenario
    from policies.specs import make_policy

    scenarios = {
        "pressure": Scenario(rate=7, arrival="gamma", burstiness=0.5, num_requests=300,
                             num_kv_blocks=2500, per_pass_overhead_s=0.002),
        "moderate": Scenario(rate=4, arrival="gamma", burstiness=0.5, num_requests=300,
                             num_kv_blocks=6000),
        "onoff": Scenario(rate=5, arrival="onoff", on_s=5, off_s=15, num_requests=250),
        "a100-long": Scenario(hardware="a100-80g", rate=0.3, num_requests=100,
                              prompt="empirical:mooncake_synthetic",
                              output="empirical:mooncake_synthetic:output_tokens",
                              slo_ttft_s=30.0),
    }
    out = {}
    for label, sc in scenarios.items():
        doc = {}
        for spec in RULES + ("table:tables/h100-sxm__llama-3-8b.json",
                             "table:tables/h200__llama-3-8b.json"):
            if spec.startswith("table") and sc.hardware != "h100-sxm":
                continue
            policy = make_policy(spec, sc, allow_table_mismatch=True)
            budgets = []

            def record(state, policy=policy, budgets=budgets):
                b = policy(state)
                budgets.append(b)
                return b

            sim = sc.simulator()
            summary = sim.run(record).summary(sc.slo())
            doc[spec] = {"summary": summary, "budgets": hashlib.sha256(
                json.dumps(budgets).encode()).hexdigest()[:16], "decisions": len(budgets)}
        out[f"rules-{label}"] = doc
    return out


def eval_items() -> dict:
    common = ("--seeds", "2", "--requests", "200", "--workers", "1", "--json")
    with tempfile.TemporaryDirectory() as tmp:
        return {
            "compare": run_json("-m", "eval", "compare", "--policies",
                                "static:2048,vllm-default,time-budget,time-budget-deadline-kv,table:auto",
                                "--rate", "6", "--out", f"{tmp}/compare", *common),
            "capacity": run_json("-m", "eval", "capacity", "--policies",
                                 "time-budget,time-budget-deadline-kv:16,table:auto",
                                 "--num-kv-blocks", "4000", "--out", f"{tmp}/capacity", *common),
        }


def table_states():
    """A fixed grid of engine states covering every quantity a table may read."""
    grid = itertools.product((0, 1, 7, 40, 200), (0, 3, 30), (0, 5000, 60000), (0.1, 0.7, 0.97),
                             (0, 2000, 9000), (0.0, 1.5, 9.0), (0.0, 0.03, 0.4), (0.0, 3.0))
    for n, waiting, wtok, kv, prefix, oldest, last, slow in grid:
        yield {"running_decodes": n, "waiting_requests": waiting, "waiting_prefill_tokens": wtok,
               "kv_usage": kv, "decode_context_tokens": n * 1500, "head_prefilled_tokens": prefix,
               "head_remaining_tokens": 3000, "oldest_wait_s": oldest, "last_step_s": last,
               "itl_slow_tokens": slow, "itl_decode_tokens": 2000.0}


def table_items() -> dict:
    from policies.table import BudgetTable

    doc = {}
    for path in sorted((ROOT / "tables").glob("*.json")):
        table = BudgetTable.load(str(path))
        budgets = [table.budget(s) for s in table_states()]
        doc[path.name] = hashlib.sha256(json.dumps(budgets).encode()).hexdigest()
    return {"tables": doc}


def train_items() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "train.py", "--total-timesteps", "1024", "--n-envs", "2",
                        "--n-steps", "128", "--conditions", "4", "--episode-s", "20",
                        "--eval-every", "512", "--eval-episodes", "3", "--final-seeds", "2",
                        "--final-requests", "100", "--workers", "1", "--no-progress-bar",
                        "--run-dir", str(run)], cwd=ROOT, check=True, capture_output=True)
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
        return {"train": {"summary": summary, "checks": config["checks"],
                          "conditions": config["conditions"]}}


def digest(doc) -> str:
    return hashlib.sha256(json.dumps(scrub(doc), sort_keys=True, default=str).encode()).hexdigest()


def first_difference(a, b, path="") -> str | None:
    if type(a) is not type(b):
        return f"{path or '.'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'after' if k in a else 'before'}"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the items' JSON documents")
    ap.add_argument("--against", help="a folder written by an earlier run, to compare with")
    ap.add_argument("--quick", action="store_true", help="leave out the training run")
    ap.add_argument("--only", help="comma-separated groups: simulate,rules,eval,tables,train")
    args = ap.parse_args()
    groups = {"simulate": simulate_items, "rules": rule_items, "eval": eval_items,
              "tables": table_items, "train": train_items}
    chosen = args.only.split(",") if args.only else [g for g in groups if not (args.quick and g == "train")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    differ = 0
    for group in chosen:
        for name, doc in groups[group]().items():
            doc = scrub(doc)
            (out / f"{name}.json").write_text(json.dumps(doc, sort_keys=True, indent=1, default=str))
            line = f"{name:<20} {digest(doc)[:16]}"
            if args.against:
                old_path = Path(args.against) / f"{name}.json"
                if not old_path.exists():
                    line += "  (not in --against)"
                else:
                    old = json.loads(old_path.read_text())
                    new = json.loads((out / f"{name}.json").read_text())
                    d = first_difference(new, old)
                    line += "  same" if d is None else f"  DIFFERS at {d}"
                    differ += d is not None
            print(line, flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
