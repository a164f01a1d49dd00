"""Fit a hardware profile to measured forward passes (the way Vidur and Sarathi-Serve
profile before they simulate).

    python -m envs.calibrate --device cpu --model llama-3-8b --layers 1 --out profiles/cpu.toml
    python -m envs.calibrate --device cuda --model llama-3-8b --layers 4 --out profiles/h100.toml
    python -m envs.calibrate --steps steps.csv --model MODEL.toml [--hardware DEVICE.toml] --out P.toml

1. Builds a randomly initialised decoder of the model preset's shape with torch
   (RMSNorm, grouped-query attention over a KV cache, SwiGLU MLP; no downloads),
   ``--layers`` of them to fit small machines.
2. Times real passes over a grid of shapes: decode batches of several sizes and
   contexts, prefill chunks of several sizes after several prefixes (attending to a
   KV cache, as an engine does), and mixes of both.
3. Measures the per-pass overhead apart (the same operations on a 64-wide model), then
   fits effective bandwidth and FLOP/s, the attention kernels' rates and the overlap of
   memory with compute (envs.cost) to those timings: least squares on the relative
   error, with the bytes and FLOPs of exactly the layers built, on two thirds of the
   shapes. Reports the error on the third held out (median and p90 absolute percentage
   error, the worst shapes) next to the plain roofline's fitted the same way.
4. Writes the hardware profile (TOML) that ``--hardware PATH`` accepts. The fitted
   rates are the device's own and do not depend on depth; the per-pass overhead is
   assumed to grow with depth (kernel launches per layer) and is scaled to the full
   model's layer count.

5. ``--steps`` fits the same cost model to an engine's own measured steps instead;
   with ``--hardware`` it keeps that profile's device figures and fits only the
   per-step overhead, i.e. what the engine adds to the forward pass.

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
from envs.cost import PassShape, Roofline, pass_parts
from envs.errors import ConfigError, positive_int, require, run_cli
from envs.profiles import HardwareProfile, get_hardware, get_model, profile_to_toml


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
    """Timed rounds over the grid (each shape keeps its fastest), after one warm-up round."""
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
    hardware: str | None = None
    """With --steps: keep this profile's device figures (say, one fitted to torch passes)
    and fit only the per-pass overhead, which is then the engine's own cost per step."""
    form: str = "refined"
    """Cost model to fit: refined (attention rates and overlap too, see envs.cost) or
    roofline (bandwidth, FLOP/s and overhead only)."""
    steps: str | None = None
    """Fit to an engine's measured steps instead of timing torch passes: a CSV with columns
    decode_contexts (each decode's context, ';'-separated), chunks ('size@prefix;...') and
    seconds. benchmarks/sim_vs_vllm.py records vLLM's steps in this form."""


# (decode contexts, prefill chunks as (size, prefix)) before --scale: decode batches from
# 1 to 64 requests, prompt chunks from 32 to 1,024 tokens after prefixes up to 4,096,
# and mixed passes of both, as a chunked-prefill engine schedules them.
GRID = [
    *[([512] * n, []) for n in (1, 2, 4, 8, 16, 32, 64)],
    ([128] * 8, []), ([2048] * 8, []), ([2048] * 32, []), ([1024] * 64, []),
    *[([], [(x, 0)]) for x in (32, 64, 128, 256, 512, 1024)],
    ([], [(128, 1024)]), ([], [(128, 2048)]), ([], [(512, 1024)]), ([], [(32, 4096)]),
    ([512] * 8, [(64, 0)]), ([512] * 8, [(256, 512)]), ([1024] * 16, [(128, 1024)]),
    ([256] * 4, [(512, 0)]), ([2048] * 4, [(64, 2048)]), ([512] * 32, [(32, 0)]),
    ([1024] * 32, [(512, 0)]), ([256] * 64, [(256, 1024)]),
]


def build_layers(torch, model, layers: int, dtype, device):
    """Weights of ``layers`` decoder layers of ``model``'s shape, randomly initialised,
    stored (out, in) as ``torch.nn.Linear`` and engines keep them."""
    h, heads, kvh, d = model.hidden_size, model.heads, model.kv_heads, model.head_dim
    # The MLP width follows from the preset's parameter count (embeddings aside).
    per_layer = model.params / model.layers
    attn = h * heads * d * 2 + h * kvh * d * 2
    inter = max(int((per_layer - attn) / (3 * h)), 1)
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype=dtype, device=device)

    return [dict(q=w(heads * d, h), k=w(kvh * d, h), v=w(kvh * d, h), o=w(h, heads * d),
                 gate=w(inter, h), up=w(inter, h), down=w(h, inter),
                 n1=torch.ones(h, dtype=dtype, device=device),
                 n2=torch.ones(h, dtype=dtype, device=device)) for _ in range(layers)], inter


def linear_kernel(torch, device: str):
    """The matrix product an engine runs: on CPU, oneDNN's (what vLLM's CPU backend
    calls; torch's default BLAS path runs small batches as several vector products and
    is several times slower there), elsewhere ``torch.nn.functional.linear``."""
    F = torch.nn.functional
    if device == "cpu" and torch.backends.mkldnn.is_available():
        try:
            onednn = torch.ops.mkldnn._linear_pointwise
            x, w = torch.ones(2, 4), torch.ones(3, 4)
            if torch.allclose(onednn(x, w, None, "none", [], ""), F.linear(x, w)):
                return lambda a, b: onednn(a, b, None, "none", [], "")
        except (AttributeError, RuntimeError):
            pass
    return F.linear


def run_pass(torch, weights, model, contexts, chunks, caches, x, linear):
    """One forward pass over decodes (one token each) and prefill chunks, as an engine
    runs it: each new token's key and value are written into the KV cache in place,
    then its query attends to the cache (grouped-query attention, no copies); a chunk
    attends to its prefix in full and to itself causally."""
    F = torch.nn.functional
    h, heads, kvh, d = model.hidden_size, model.heads, model.kv_heads, model.head_dim
    n = len(contexts)
    for layer, cache in zip(weights, caches):
        y = F.rms_norm(x, (h,), layer["n1"])
        q, k, v = linear(y, layer["q"]), linear(y, layer["k"]), linear(y, layer["v"])
        outs = []
        # Decodes, grouped by context length (the grid's batches share one).
        i = 0
        for c in sorted(set(contexts)):
            m = contexts.count(c)
            kc, vc = cache["k"][i:i + m], cache["v"][i:i + m]
            kc[:, :, c] = k[i:i + m].view(m, kvh, d)
            vc[:, :, c] = v[i:i + m].view(m, kvh, d)
            outs.append(F.scaled_dot_product_attention(
                q[i:i + m].view(m, heads, 1, d), kc[:, :, :c + 1], vc[:, :, :c + 1],
                enable_gqa=True).reshape(m, heads * d))
            i += m
        for size, prefix in chunks:
            kc, vc = cache["k"][n:n + 1], cache["v"][n:n + 1]
            kc[0, :, prefix:prefix + size] = k[i:i + size].view(size, kvh, d).transpose(0, 1)
            vc[0, :, prefix:prefix + size] = v[i:i + size].view(size, kvh, d).transpose(0, 1)
            qq = q[i:i + size].view(1, size, heads, d).transpose(1, 2)
            kk, vv = kc[:, :, :prefix + size], vc[:, :, :prefix + size]
            if prefix:  # causal within the chunk, full against the prefix
                mask = torch.ones(size, prefix + size, dtype=torch.bool, device=x.device).tril(prefix)
                att = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
            else:
                att = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            outs.append(att.transpose(1, 2).reshape(size, heads * d))
            i += size
        x = x + linear(torch.cat(outs), layer["o"])
        y = F.rms_norm(x, (h,), layer["n2"])
        x = x + linear(F.silu(linear(y, layer["gate"])) * linear(y, layer["up"]), layer["down"])
    return x


@dataclass(frozen=True)
class Fit:
    """Fitted device figures: weight-streaming bandwidth, weight-product FLOP/s, the
    attention kernels' rates relative to those, the overlap of memory and compute, and
    the per-pass overhead (see envs.cost)."""

    bytes_per_s: float
    flops_per_s: float
    attention_bandwidth_ratio: float = 1.0
    attention_flops_ratio: float = 1.0
    overlap: float = 1.0
    overhead_s: float = 0.0

    def predict(self, parts: np.ndarray) -> np.ndarray:
        """Pass seconds for rows of (weight bytes, KV bytes, product FLOPs, attention FLOPs)."""
        wb, kvb, lf, af = parts.T
        mem = wb / self.bytes_per_s + kvb / (self.bytes_per_s * self.attention_bandwidth_ratio)
        comp = lf / self.flops_per_s + af / (self.flops_per_s * self.attention_flops_ratio)
        return np.maximum(mem, comp) + (1 - self.overlap) * np.minimum(mem, comp) + self.overhead_s

    def profile(self, name: str, memory_bytes: float, overhead_s: float | None = None) -> HardwareProfile:
        return HardwareProfile(
            name=name, hbm_bytes_per_s=float(self.bytes_per_s), peak_flops_per_s=float(self.flops_per_s),
            memory_bytes=memory_bytes, bandwidth_fraction=1.0, flops_fraction=1.0,
            per_pass_overhead_s=float(self.overhead_s if overhead_s is None else overhead_s),
            attention_bandwidth_ratio=float(self.attention_bandwidth_ratio),
            attention_flops_ratio=float(self.attention_flops_ratio), overlap=float(self.overlap))

    def describe(self) -> str:
        return (f"{self.bytes_per_s / 1e9:.1f} GB/s, {self.flops_per_s / 1e9:.1f} GFLOP/s, attention at "
                f"{self.attention_bandwidth_ratio:.2f}x bandwidth and {self.attention_flops_ratio:.2f}x "
                f"FLOP/s, overlap {self.overlap:.2f}, {self.overhead_s * 1e3:.2f} ms per pass")


RATIO_PRIOR = 0.02
"""Weight of the pull of log attention ratios towards 0 (ratio 1) in the fit."""


def shape_parts(rf: Roofline, shapes) -> np.ndarray:
    """(weight bytes, KV bytes, product FLOPs, attention FLOPs) per pass shape."""
    return np.array([pass_parts(rf, sh) for sh in shapes], dtype=float)


def fit_passes(parts: np.ndarray, seconds: np.ndarray, *, refined: bool = True,
               overhead_s: float | None = None) -> Fit:
    """Least squares on the relative error of the pass price (envs.cost) over measured
    passes. ``refined=False`` fits the plain roofline (bandwidth, FLOP/s, overhead);
    ``refined`` also fits the attention ratios and the overlap. ``overhead_s`` pins the
    overhead (measured apart), which a fixed model's weight time is otherwise
    indistinguishable from.

    Levenberg-Marquardt from several starts, on log rates, a logistic overlap and a
    bounded overhead, so every fitted figure stays in its allowed range.
    """
    if len(seconds) < (6 if refined else 3):
        raise ConfigError(f"fit: {len(seconds)} measured passes are too few for the "
                          f"{'refined' if refined else 'roofline'} fit")
    parts = np.asarray(parts, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    total_bytes = parts[:, 0] + parts[:, 1]
    total_flops = parts[:, 2] + parts[:, 3]
    o_cap = float(seconds.min())

    def unpack(x: np.ndarray) -> Fit:
        x = np.clip(x, -60.0, 60.0)  # keeps exp() finite while the search wanders
        o = overhead_s if overhead_s is not None else o_cap / (1 + math.exp(-x[2]))
        if not refined:
            return Fit(math.exp(x[0]), math.exp(x[1]), overhead_s=o)
        return Fit(math.exp(x[0]), math.exp(x[1]), math.exp(x[3]), math.exp(x[4]),
                   1 / (1 + math.exp(-x[5])), o)

    def residual(x: np.ndarray) -> np.ndarray:
        rel = unpack(x).predict(parts) / seconds - 1
        if not refined:
            return rel
        # A weak pull of the attention ratios towards 1: where the measured shapes carry
        # too little attention to pin one down, it stays at the plain roofline's value.
        return np.concatenate([rel, RATIO_PRIOR * x[3:5]])

    def solve(x: np.ndarray) -> tuple[float, np.ndarray]:
        lam, r = 1e-2, residual(x)
        loss = float(r @ r)
        for _ in range(200):
            jac = np.empty((len(r), len(x)))
            for j in range(len(x)):
                dx = np.zeros_like(x)
                dx[j] = 1e-6 * max(1.0, abs(x[j]))
                jac[:, j] = (residual(x + dx) - r) / dx[j]
            g, h = jac.T @ r, jac.T @ jac
            while lam < 1e12:
                step = np.linalg.solve(h + lam * (np.diag(np.diag(h)) + 1e-9 * np.eye(len(x))), -g)
                r_new = residual(x + step)
                new = float(r_new @ r_new)
                if np.isfinite(new) and new < loss:
                    break
                lam *= 4
            else:
                break
            improved = loss - new
            x, r, loss, lam = x + step, r_new, new, max(lam / 3, 1e-9)
            if improved < 1e-12 * max(loss, 1e-30):
                break
        return loss, x

    b0 = math.log(float(np.max(total_bytes / seconds)))
    f0 = math.log(float(np.max(total_flops / seconds)))
    starts = []
    for db, df in ((0, 0), (1, 1), (-1, 0), (0, -1)):
        base = [b0 + db, f0 + df, 0.0]
        if refined:
            starts += [np.array(base + [a, a, z]) for a in (0.0, -2.0) for z in (3.0, -3.0)]
        else:
            starts.append(np.array(base))
    best = min((solve(x) for x in starts), key=lambda lx: lx[0])
    return unpack(best[1])


def dispatch_overhead(torch, model, layers: int, dtype, device: str, linear, sync,
                      repeats: int = 20) -> float:
    """Seconds of a pass that moves and computes next to nothing: the same operations on
    a 64-wide model of ``layers`` layers, one decode of one token. What is left is the
    per-pass cost of launching them, which the fit cannot tell from a fixed model's
    weight time."""
    tiny = replace(model, hidden_size=64, heads=1, kv_heads=1, head_dim=64,
                   params=float(model.layers * 7 * 64 * 64))
    weights, _ = build_layers(torch, tiny, layers, dtype, device)
    caches = [{"k": torch.zeros(2, 1, 4, 64, dtype=dtype, device=device),
               "v": torch.zeros(2, 1, 4, 64, dtype=dtype, device=device)} for _ in range(layers)]
    x = torch.zeros(1, 64, dtype=dtype, device=device)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        run_pass(torch, weights, tiny, [1], [], caches, x, linear)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return min(times)


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


def unit_roofline(model) -> Roofline:
    """A roofline whose coefficients are the model's bytes and FLOPs themselves."""
    return Roofline.of(HardwareProfile("unit", hbm_bytes_per_s=1.0, peak_flops_per_s=1.0,
                                       memory_bytes=1.0, bandwidth_fraction=1.0,
                                       flops_fraction=1.0), model)


def held_out(n: int) -> np.ndarray:
    """Every third measurement is held out of the fit."""
    return np.arange(n) % 3 == 2


def ape(fit: Fit, parts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Absolute percentage error of each predicted pass."""
    return np.abs(fit.predict(parts) - seconds) / seconds


def error_line(label: str, err: np.ndarray) -> str:
    return f"{label}: median APE {np.median(err):.1%}, p90 {np.percentile(err, 90):.1%}"


def fit_overhead(base: Fit, parts: np.ndarray, seconds: np.ndarray) -> Fit:
    """``base`` with only its per-pass overhead refitted (least squares on the relative
    error, in closed form; never below 0)."""
    rest = replace(base, overhead_s=0.0).predict(parts)
    w = 1 / seconds**2
    return replace(base, overhead_s=max(float(np.sum(w * (seconds - rest)) / np.sum(w)), 0.0))


def fit_of(profile: HardwareProfile) -> Fit:
    return Fit(profile.effective_bytes_per_s, profile.effective_flops_per_s,
               profile.attention_bandwidth_ratio, profile.attention_flops_ratio, profile.overlap,
               profile.per_pass_overhead_s)


def fit_steps(steps, model, refined: bool = True,
              base: HardwareProfile | None = None) -> tuple[Fit, Fit | None, np.ndarray, np.ndarray]:
    """Fit on two thirds of measured engine steps: (fit, plain-roofline fit, parts, seconds).
    With ``base``, its device figures are kept and only the per-step overhead is fitted
    (no plain fit then: None)."""
    # A tensor-parallel group runs at tp times one device's rates (envs.cost), so each
    # device carries 1/tp of the work and the fitted rates are one device's.
    parts = shape_parts(unit_roofline(model), [PassShape.of(c, k) for c, k, _ in steps]) / model.tensor_parallel
    secs = np.array([t for _, _, t in steps])
    held = held_out(len(steps))
    if base is not None:
        return fit_overhead(fit_of(base), parts[~held], secs[~held]), None, parts, secs
    plain = fit_passes(parts[~held], secs[~held], refined=False)
    fit = fit_passes(parts[~held], secs[~held]) if refined else plain
    return fit, plain, parts, secs


def main(argv: list[str] | None = None) -> int:
    args = parse(CalibrateArgs, argv, prog="python -m envs.calibrate")
    require(args.form in ("refined", "roofline"), "form", args.form, "must be refined or roofline")
    if args.steps:
        model = get_model(args.model)
        steps = read_steps(args.steps)
        base = get_hardware(args.hardware) if args.hardware else None
        fit, plain, parts, secs = fit_steps(steps, model, args.form == "refined", base)
        held = held_out(len(steps))
        err = ape(fit, parts, secs)[held]
        memory = base.memory_bytes if base else float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        profile = fit.profile(args.name or "calibrated-steps", memory)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        what = (f"the per-step overhead on top of {args.hardware}" if base else "")
        out.write_text(f"# Fitted to {len(steps)} measured engine steps ({args.steps}) with model "
                       f"{model.name}{'; ' + what if what else ''}; held-out median error "
                       f"{np.median(err):.1%}.\n" + profile_to_toml(profile))
        print(f"fit to {len(steps)} steps{' (' + what + ')' if what else ''}: {fit.describe()}; "
              + error_line(f"held-out steps ({int(held.sum())})", err))
        if args.form == "refined" and plain is not None:
            print(f"plain roofline ({plain.describe()}): "
                  + error_line("held-out steps", ape(plain, parts, secs)[held]))
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
    rf = unit_roofline(built)

    grid = []
    for contexts, chunks in GRID:
        cs = [max(int(c * args.scale), 1) for c in contexts]
        ks = [(max(int(x * args.scale), 1), int(p * args.scale)) for x, p in chunks]
        grid.append((cs, ks))
    max_ctx = max([max(c) + 1 if c else 0 for c, _ in grid] + [x + p for _, k in grid for x, p in k])
    max_n = max(len(c) for c, _ in grid) + 1  # the decodes' slots and one for a chunk
    caches = [{"k": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=args.device) * 0.1,
               "v": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=args.device) * 0.1} for _ in range(args.layers)]

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    linear = linear_kernel(torch, args.device)
    t_start = time.perf_counter()
    times = [[] for _ in grid]
    with torch.inference_mode():
        inputs = [torch.randn(len(c) + sum(s for s, _ in k), full.hidden_size, dtype=dtype,
                              device=args.device) * 0.1 for c, k in grid]
        # Rounds over the whole grid (the first a warm-up), so that a slow spell of a
        # shared machine spreads over all shapes; each shape keeps its fastest time, as
        # interference only ever adds.
        for rnd in range(args.repeats + 1):
            for i, (contexts, chunks) in enumerate(grid):
                t0 = time.perf_counter()
                run_pass(torch, weights, full, contexts, chunks, caches, inputs[i], linear)
                sync()
                if rnd:
                    times[i].append(time.perf_counter() - t0)
            if rnd:
                print(f"  round {rnd}/{args.repeats}: {time.perf_counter() - t_start:.0f} s", flush=True)
        overhead = dispatch_overhead(torch, full, args.layers, dtype, args.device, linear, sync)
    rows = [(c, k, min(ts)) for (c, k), ts in zip(grid, times)]
    measure_s = time.perf_counter() - t_start
    seconds = np.array([r[2] for r in rows])
    parts = shape_parts(rf, [PassShape.of(c, k) for c, k, _ in rows])
    held = held_out(len(rows))
    plain = fit_passes(parts[~held], seconds[~held], refined=False)
    fit = plain if args.form == "roofline" else fit_passes(parts[~held], seconds[~held],
                                                           overhead_s=overhead)
    pred = fit.predict(parts)
    err = ape(fit, parts, seconds)
    # The overhead is per layer (launches, dispatch); the rates are the device's own.
    overhead_full = fit.overhead_s * full.layers / args.layers
    name = args.name or f"calibrated-{args.device}"
    profile = fit.profile(name, total_memory_bytes(torch, args.device), overhead_full)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Fitted by python -m envs.calibrate --device {args.device} --model {args.model} "
              f"--layers {args.layers} ({dname}, {args.form}), {time.strftime('%Y-%m-%d')}.\n"
              f"# Rates are effective (fractions 1.0); held-out error: median "
              f"{np.median(err[held]):.1%}, p90 {np.percentile(err[held], 90):.1%}.\n")
    out.write_text(header + profile_to_toml(profile))
    print(f"\nmeasured {len(rows)} shapes in {measure_s:.0f} s on {args.device} ({dname}, "
          f"{args.layers} of {full.layers} layers of {full.name}, MLP width {inter}); an empty "
          f"pass costs {overhead * 1e3:.2f} ms")
    print(f"fit ({args.form}): {fit.describe()} ({overhead_full * 1e3:.2f} ms scaled to "
          f"{full.layers} layers)")
    print(error_line(f"held-out shapes ({int(held.sum())})", err[held])
          + f"; all shapes: median {np.median(err):.1%}")
    if args.form == "refined":
        print(f"plain roofline ({plain.describe()}): "
              + error_line("held-out shapes", ape(plain, parts, seconds)[held]))
    for (c, k, sec), p in zip(rows, pred):
        print(f"  {len(c):3d} decodes @ {max(c) if c else 0:5d} ctx, chunks {k or '-'}: measured "
              f"{sec * 1e3:8.2f} ms, model {p * 1e3:8.2f} ms")
    worst = np.argsort(-err)[:3]
    for i in worst:
        c, k = rows[i][0], rows[i][1]
        print(f"  worst: {len(c)} decodes, chunks {k or '-'}: measured {seconds[i] * 1e3:.2f} ms, "
              f"model {pred[i] * 1e3:.2f} ms ({(pred[i] - seconds[i]) / seconds[i]:+.0%})")
    print(f"profile written to {out}; use it with --hardware {out}")
    if args.csv:
        lines = ["decodes,decode_context,chunks,measured_s,predicted_s,plain_roofline_s,weight_bytes,"
                 "kv_bytes,product_flops,attention_flops,held_out"]
        plain_pred = plain.predict(parts)
        for (c, k, sec), p, pp, row, h in zip(rows, pred, plain_pred, parts, held):
            chunk_text = ";".join(f"{x}@{q}" for x, q in k)
            lines.append(f"{len(c)},{max(c) if c else 0},{chunk_text},{sec:.6g},{p:.6g},{pp:.6g},"
                         + ",".join(f"{v:.6g}" for v in row) + f",{int(h)}")
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        Path(args.csv).write_text("\n".join(lines) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(seconds[~held] * 1e3, pred[~held] * 1e3, label=f"{args.form}, fitted shapes")
        ax.scatter(seconds[held] * 1e3, pred[held] * 1e3, marker="s", label=f"{args.form}, held-out shapes")
        if args.form == "refined":
            ax.scatter(seconds * 1e3, plain.predict(parts) * 1e3, marker="x", color="0.55",
                       label="plain roofline, all shapes")
        lim = [min(seconds.min(), pred.min()) * 1e3 * 0.8, max(seconds.max(), pred.max()) * 1e3 * 1.2]
        ax.plot(lim, lim, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured pass (ms)")
        ax.set_ylabel("predicted pass (ms)")
        ax.set_title(f"{name}: {args.layers} layer(s) of {full.name}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    run_cli(main)
