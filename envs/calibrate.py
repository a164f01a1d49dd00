"""Fit a hardware profile to measured forward passes (the way Vidur and Sarathi-Serve
profile before they simulate).

    python -m envs.calibrate --device cpu --model llama-3-8b --layers 1 --out profiles/cpu.toml
    python -m envs.calibrate --device cuda --model llama-3-8b --layers 4 --out profiles/h100.toml

1. Builds a randomly initialised decoder of the model preset's shape with torch
   (RMSNorm, grouped-query attention over a KV cache, SwiGLU MLP; no downloads),
   ``--layers`` of them to fit small machines.
2. Times real passes over a grid of shapes: decode batches of several sizes and
   contexts, prefill chunks of several sizes after several prefixes (attending to a
   KV cache, as an engine does), and mixes of both.
3. Fits effective bandwidth, effective FLOP/s and per-pass overhead to those timings
   (least squares on the relative error of DESIGN.md's roofline, with the bytes and
   FLOPs of exactly the layers built), on two thirds of the shapes, and reports the
   error on the third held out: median and p90 absolute percentage error and the
   shapes where the roofline is worst.
4. Writes the hardware profile (TOML) that ``--hardware PATH`` accepts. The fitted
   rates are the device's own and do not depend on depth; the per-pass overhead is
   assumed to grow with depth (kernel launches per layer) and is scaled to the full
   model's layer count.

The fit is for the dtype measured (float32 on CPU, bfloat16 on CUDA by default);
pair the profile with a model profile of that dtype.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from envs.cli import parse
from envs.cost import PassShape, Roofline, pass_bytes, pass_flops
from envs.errors import ConfigError, positive_int, require, run_cli
from envs.profiles import HardwareProfile, get_model, profile_to_toml


@dataclass(frozen=True)
class CalibrateArgs:
    """Time real forward passes and fit a hardware profile to them."""

    device: str = "cpu"
    """cpu or cuda."""
    model: str = "llama-3-8b"
    """Model preset whose layer shape is built."""
    layers: int = 1
    """Layers to build (fewer than the model's on small machines; rates do not depend on it)."""
    dtype: str | None = None
    """float32, bfloat16 or float16 (default: float32 on cpu, bfloat16 on cuda)."""
    repeats: int = 3
    """Timed repetitions per shape (the median is kept), after one warm-up."""
    scale: float = 1.0
    """Multiply the grid's token counts (lower it on slow machines)."""
    name: str | None = None
    """Profile name (default: calibrated-DEVICE)."""
    out: str = "profiles/calibrated.toml"
    """Where to write the hardware profile."""
    csv: str | None = None
    """Also write every measurement (shape, measured and predicted seconds) as CSV."""
    plot: str | None = None
    """Also draw predicted against measured pass time (PNG; needs matplotlib)."""
    steps: str | None = None
    """Fit to an engine's measured steps instead of timing torch passes: a CSV with columns
    decode_contexts (each decode's context, ';'-separated), chunks ('size@prefix;...') and
    seconds. benchmarks/sim_vs_vllm.py records vLLM's steps in this form."""


# (decode contexts, prefill chunks as (size, prefix)) before --scale.
GRID = [
    ([128] * 1, []), ([128] * 8, []), ([1024] * 8, []), ([512] * 32, []), ([2048] * 16, []),
    ([], [(32, 0)]), ([], [(128, 0)]), ([], [(512, 0)]), ([], [(256, 1024)]), ([], [(128, 2048)]),
    ([512] * 8, [(64, 0)]), ([512] * 8, [(256, 512)]), ([1024] * 16, [(128, 1024)]),
    ([256] * 4, [(512, 0)]), ([2048] * 4, [(64, 2048)]),
]


def build_layers(torch, model, layers: int, dtype, device):
    """Weights of ``layers`` decoder layers of ``model``'s shape, randomly initialised."""
    h, heads, kvh, d = model.hidden_size, model.heads, model.kv_heads, model.head_dim
    # The MLP width follows from the preset's parameter count (embeddings aside).
    per_layer = model.params / model.layers
    attn = h * heads * d * 2 + h * kvh * d * 2
    inter = max(int((per_layer - attn) / (3 * h)), 1)
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype=dtype, device=device)

    return [dict(q=w(h, heads * d), k=w(h, kvh * d), v=w(h, kvh * d), o=w(heads * d, h),
                 gate=w(h, inter), up=w(h, inter), down=w(inter, h),
                 n1=torch.ones(h, dtype=dtype, device=device),
                 n2=torch.ones(h, dtype=dtype, device=device)) for _ in range(layers)], inter


def run_pass(torch, weights, model, contexts, chunks, caches, dtype, device):
    """One forward pass over decodes (one token each, attending to its cache) and
    prefill chunks (attending causally to their prefix and themselves)."""
    F = torch.nn.functional
    h, heads, kvh, d = model.hidden_size, model.heads, model.kv_heads, model.head_dim
    n_tok = len(contexts) + sum(x for x, _ in chunks)
    x = torch.randn(n_tok, h, dtype=dtype, device=device) * 0.1
    rep = heads // kvh
    for layer, cache in zip(weights, caches):
        y = F.rms_norm(x, (h,), layer["n1"])
        q, k, v = y @ layer["q"], y @ layer["k"], y @ layer["v"]
        outs = []
        i = 0
        if contexts:
            n = len(contexts)
            c = max(contexts)
            kc = cache["k"][:n, :, :c]  # the decodes' cached keys and values
            vc = cache["v"][:n, :, :c]
            qq = q[:n].view(n, heads, 1, d)
            kk = torch.cat([kc, k[:n].view(n, kvh, 1, d)], dim=2).repeat_interleave(rep, dim=1)
            vv = torch.cat([vc, v[:n].view(n, kvh, 1, d)], dim=2).repeat_interleave(rep, dim=1)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv).reshape(n, heads * d))
            i = n
        for size, prefix in chunks:
            qq = q[i:i + size].view(1, size, heads, d).transpose(1, 2)
            kk = torch.cat([cache["k"][:1, :, :prefix], k[i:i + size].view(1, size, kvh, d)
                            .transpose(1, 2)], dim=2).repeat_interleave(rep, dim=1)
            vv = torch.cat([cache["v"][:1, :, :prefix], v[i:i + size].view(1, size, kvh, d)
                            .transpose(1, 2)], dim=2).repeat_interleave(rep, dim=1)
            # Causal within the chunk, full against the prefix.
            mask = torch.ones(size, prefix + size, dtype=torch.bool, device=device).tril(prefix)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
                        .transpose(1, 2).reshape(size, heads * d))
            i += size
        x = x + torch.cat(outs) @ layer["o"]
        y = F.rms_norm(x, (h,), layer["n2"])
        x = x + (F.silu(y @ layer["gate"]) * (y @ layer["up"])) @ layer["down"]
    return x


def fit_roofline(nbytes: np.ndarray, flops: np.ndarray, seconds: np.ndarray):
    """(bytes/s, FLOP/s, overhead s) minimising the squared relative error of
    max(bytes/B, flops/F) + o. A log grid over B and F, with o solved in closed form for
    each, then a finer grid around the best."""

    def best_o(pred):
        # minimise sum(((pred + o) / t - 1)^2) over o >= 0
        w = 1 / seconds**2
        o = float(np.sum(w * (seconds - pred)) / np.sum(w))
        return max(o, 0.0)

    def loss(B, F):
        pred = np.maximum(nbytes / B, flops / F)
        o = best_o(pred)
        return float(np.sum(((pred + o) / seconds - 1) ** 2)), o

    b_est = np.max(nbytes / seconds)
    f_est = np.max(flops / seconds)
    lo_b, hi_b = np.log10(b_est) - 1, np.log10(b_est) + 1.5
    lo_f, hi_f = np.log10(f_est) - 1, np.log10(f_est) + 1.5
    best = (math.inf, None)
    for _ in range(3):
        for lb in np.linspace(lo_b, hi_b, 41):
            for lf in np.linspace(lo_f, hi_f, 41):
                value, o = loss(10 ** lb, 10 ** lf)
                if value < best[0]:
                    best = (value, (10 ** lb, 10 ** lf, o))
        B, F, _ = best[1]
        span_b, span_f = (hi_b - lo_b) / 8, (hi_f - lo_f) / 8
        lo_b, hi_b = np.log10(B) - span_b, np.log10(B) + span_b
        lo_f, hi_f = np.log10(F) - span_f, np.log10(F) + span_f
    return best[1]


def total_memory_bytes(torch, device: str) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def read_steps(path: str) -> list[tuple[list[int], list[tuple[int, int]], float]]:
    import csv

    rows = []
    try:
        fh = open(path, newline="")
    except OSError as err:
        raise ConfigError(f"steps: cannot read {path!r} ({err.strerror})") from None
    with fh:
        reader = csv.DictReader(fh)
        need = {"decode_contexts", "chunks", "seconds"}
        if not need <= set(reader.fieldnames or ()):
            raise ConfigError(f"steps: {path!r} needs columns {', '.join(sorted(need))}")
        for row in reader:
            try:
                contexts = [int(c) for c in row["decode_contexts"].split(";") if c]
                chunks = [(int(a), int(b)) for a, b in (c.split("@") for c in row["chunks"].split(";") if c)]
                seconds = float(row["seconds"])
            except ValueError:
                raise ConfigError(f"steps: {path!r} line {reader.line_num}: bad numbers") from None
            if seconds > 0 and (contexts or chunks):
                rows.append((contexts, chunks, seconds))
    if len(rows) < 6:
        raise ConfigError(f"steps: {path!r} holds {len(rows)} usable steps, need at least 6")
    return rows


def fit_steps(steps, model, name: str, memory_bytes: float):
    """Fit on two thirds of measured steps; (profile, held-out APE array, all APE)."""
    unit = HardwareProfile("unit", hbm_bytes_per_s=1.0, peak_flops_per_s=1.0, memory_bytes=1.0,
                           bandwidth_fraction=1.0, flops_fraction=1.0)
    rf = Roofline.of(unit, model)
    shapes = [PassShape.of(c, k) for c, k, _ in steps]
    nbytes = np.array([pass_bytes(rf, sh) for sh in shapes])
    flops = np.array([pass_flops(rf, sh) for sh in shapes])
    secs = np.array([t for _, _, t in steps])
    held = np.arange(len(steps)) % 3 == 2
    B, F, o = fit_roofline(nbytes[~held], flops[~held], secs[~held])
    ape = np.abs(np.maximum(nbytes / B, flops / F) + o - secs) / secs
    profile = HardwareProfile(name, float(B), float(F), memory_bytes, bandwidth_fraction=1.0,
                              flops_fraction=1.0, per_pass_overhead_s=float(o))
    return profile, ape[held], ape


def main(argv: list[str] | None = None) -> int:
    args = parse(CalibrateArgs, argv, prog="python -m envs.calibrate")
    if args.steps:
        model = get_model(args.model)
        steps = read_steps(args.steps)
        profile, held, ape = fit_steps(steps, model, args.name or "calibrated-steps",
                                       float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Fitted to {len(steps)} measured engine steps ({args.steps}) with model "
                       f"{model.name}; held-out median error {np.median(held):.1%}.\n"
                       + profile_to_toml(profile))
        print(f"fit to {len(steps)} steps: {profile.hbm_bytes_per_s / 1e9:.1f} GB/s, "
              f"{profile.peak_flops_per_s / 1e9:.1f} GFLOP/s, {profile.per_pass_overhead_s * 1e3:.1f} ms "
              f"per step; held-out steps ({len(held)}): median APE {np.median(held):.1%}, p90 "
              f"{np.percentile(held, 90):.1%}")
        print(f"profile written to {out}; use it with --hardware {out}")
        return 0
    require(args.device in ("cpu", "cuda"), "device", args.device, "must be cpu or cuda")
    positive_int("layers", args.layers)
    positive_int("repeats", args.repeats)
    require(args.scale > 0, "scale", args.scale, "must be > 0")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: got 'cuda', but torch sees no CUDA device here")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dname = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    require(dname in dtypes, "dtype", dname, f"must be one of {', '.join(dtypes)}")
    dtype = dtypes[dname]
    full = get_model(args.model)
    weights, inter = build_layers(torch, full, args.layers, dtype, args.device)
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer_params = sum(w.numel() for k, w in weights[0].items() if k not in ("n1", "n2"))
    built = replace(full, name=f"{full.name}-x{args.layers}", layers=args.layers,
                    params=float(per_layer_params * args.layers), bytes_per_weight=float(elem),
                    bytes_per_kv_element=float(elem), tensor_parallel=1)
    unit = HardwareProfile("unit", hbm_bytes_per_s=1.0, peak_flops_per_s=1.0, memory_bytes=1.0,
                           bandwidth_fraction=1.0, flops_fraction=1.0)
    rf = Roofline.of(unit, built)

    grid = []
    for contexts, chunks in GRID:
        cs = [max(int(c * args.scale), 1) for c in contexts]
        ks = [(max(int(x * args.scale), 1), int(p * args.scale)) for x, p in chunks]
        grid.append((cs, ks))
    max_ctx = max([max(c) if c else 0 for c, _ in grid] + [p for _, k in grid for _, p in k]) + 1
    max_n = max(len(c) for c, _ in grid) or 1
    caches = [{"k": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=args.device) * 0.1,
               "v": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=args.device) * 0.1} for _ in range(args.layers)]

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    rows = []
    t_start = time.perf_counter()
    with torch.inference_mode():
        for contexts, chunks in grid:
            run_pass(torch, weights, full, contexts, chunks, caches, dtype, args.device)
            sync()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run_pass(torch, weights, full, contexts, chunks, caches, dtype, args.device)
                sync()
                times.append(time.perf_counter() - t0)
            shape = PassShape.of(contexts, chunks)
            rows.append((contexts, chunks, float(np.median(times)), pass_bytes(rf, shape),
                         pass_flops(rf, shape)))
            print(f"  {len(contexts):3d} decodes @ {max(contexts) if contexts else 0:5d} ctx, chunks "
                  f"{chunks or '-'}: {rows[-1][2] * 1e3:8.2f} ms", flush=True)
    measure_s = time.perf_counter() - t_start
    seconds = np.array([r[2] for r in rows])
    nbytes = np.array([r[3] for r in rows])
    flops = np.array([r[4] for r in rows])
    held = np.arange(len(rows)) % 3 == 2  # every third shape is held out of the fit
    B, F, o = fit_roofline(nbytes[~held], flops[~held], seconds[~held])
    pred = np.maximum(nbytes / B, flops / F) + o
    ape = np.abs(pred - seconds) / seconds
    overhead_full = o * full.layers / args.layers
    name = args.name or f"calibrated-{args.device}"
    profile = HardwareProfile(name=name, hbm_bytes_per_s=float(B), peak_flops_per_s=float(F),
                              memory_bytes=total_memory_bytes(torch, args.device),
                              bandwidth_fraction=1.0, flops_fraction=1.0,
                              per_pass_overhead_s=float(overhead_full))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Fitted by python -m envs.calibrate --device {args.device} --model {args.model} "
              f"--layers {args.layers} ({dname}), {time.strftime('%Y-%m-%d')}.\n"
              f"# Rates are effective (fractions 1.0); held-out error: median "
              f"{np.median(ape[held]):.1%}, p90 {np.percentile(ape[held], 90):.1%}.\n")
    out.write_text(header + profile_to_toml(profile))
    worst = np.argsort(-ape)[:3]
    print(f"\nmeasured {len(rows)} shapes in {measure_s:.0f} s on {args.device} ({dname}, "
          f"{args.layers} of {full.layers} layers of {full.name}, MLP width {inter})")
    print(f"fit: {B / 1e9:.1f} GB/s, {F / 1e12:.3f} TFLOP/s, {o * 1e3:.2f} ms per pass "
          f"({overhead_full * 1e3:.2f} ms scaled to {full.layers} layers)")
    print(f"held-out shapes ({int(held.sum())}): median APE {np.median(ape[held]):.1%}, p90 "
          f"{np.percentile(ape[held], 90):.1%}; all shapes: median {np.median(ape):.1%}")
    for i in worst:
        c, k = rows[i][0], rows[i][1]
        print(f"  worst: {len(c)} decodes, chunks {k or '-'}: measured {seconds[i] * 1e3:.2f} ms, "
              f"roofline {pred[i] * 1e3:.2f} ms ({ape[i]:+.0%})")
    print(f"profile written to {out}; use it with --hardware {out}")
    if args.csv:
        lines = ["decodes,decode_context,chunks,measured_s,predicted_s,bytes,flops,held_out"]
        for (c, k, s, b, f), p, h in zip(rows, pred, held):
            chunk_text = ";".join(f"{x}@{q}" for x, q in k)
            lines.append(f"{len(c)},{max(c) if c else 0},{chunk_text},{s:.6g},{p:.6g},{b:.6g},{f:.6g},{int(h)}")
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        Path(args.csv).write_text("\n".join(lines) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(seconds[~held] * 1e3, pred[~held] * 1e3, label="fitted shapes")
        ax.scatter(seconds[held] * 1e3, pred[held] * 1e3, marker="s", label="held-out shapes")
        lim = [min(seconds.min(), pred.min()) * 1e3 * 0.8, max(seconds.max(), pred.max()) * 1e3 * 1.2]
        ax.plot(lim, lim, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured pass (ms)")
        ax.set_ylabel("roofline (ms)")
        ax.set_title(f"{name}: {args.layers} layer(s) of {full.name}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    run_cli(main)
