"""Fit a hardware profile to measured passes (the way Vidur and Sarathi-Serve profile
before they simulate).

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

6. ``--vidur`` fits a GPU's figures to measured per-layer operator times (Vidur's
   profiling data, ``envs/data/vidur/``; ``docs/calibration/vidur.md``) as fractions of a
   datasheet profile's peaks, and reports the error on ``--held-out`` files:

       python -m envs.calibrate --vidur envs/data/vidur/h100__Llama-2-7b-hf.csv \
           --held-out envs/data/vidur/h100__internlm-20b.csv --out h100.toml
       python -m envs.calibrate --vidur FILE.csv --hardware h100-sxm --check --json

The fit is for the dtype measured (float32 on CPU, bfloat16 on CUDA by default);
pair the profile with a model profile of that dtype.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from envs.calibrate.fit import (PART_COLUMNS, Fit, ape, error_line, fit_passes, held_out, shape_parts,
                                unit_roofline)
from envs.calibrate.steps import fit_steps, read_steps, jitter_line, step_jitter
from envs.calibrate.vidur import fit_layers, fitted_profile, read_tables
from envs.calibrate.vidur_report import Errors, plot_vidur, report_lines
from envs.cli import parse
from envs.cost import PassShape
from envs.errors import ConfigError, integer, number, require, run_cli
from envs.files import atomic_path, check_distinct, check_output, write_atomic
from envs.profiles import MAX_NAME_CHARS, HardwareProfile, get_hardware, get_model, profile_to_toml

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
FORMS = ("refined", "roofline")
MAX_REPEATS = 1000
MAX_SCALE = 8.0
"""The grid's largest pass (64 decodes at 2,048 tokens, chunks after 4,096) times this
must fit the machine: 8x is a 32K-token prefix."""


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
    """Profile name (default: calibrated-DEVICE; with --steps, --hardware's name, else
    calibrated-steps). A table exported with the profile is served only on a device of this
    name (``cpu``, ``h100-sxm``, ...; ``python -m policies.table check`` says which)."""
    out: str = "profiles/calibrated.toml"
    """Where to write the hardware profile."""
    csv: str | None = None
    """Also write every measurement (shape, measured and predicted seconds) as CSV."""
    plot: str | None = None
    """Also draw predicted against measured pass time (PNG; needs matplotlib)."""
    hardware: str | None = None
    """With --steps: keep this profile's device figures (say, one fitted to torch passes)
    and fit only the per-pass overhead, which is then the engine's own cost per step.
    With --vidur: the datasheet profile whose peaks the fitted figures are fractions of
    (default: h100-sxm-datasheet for h100__*.csv files, a100-80g-datasheet for a100__*);
    with --check, the profile to check."""
    form: str = "refined"
    """Cost model to fit: refined (attention rates and overlap too, see envs.cost) or
    roofline (bandwidth, FLOP/s and overhead only)."""
    steps: str | None = None
    """Fit to an engine's measured steps instead of timing torch passes: a CSV with columns
    decode_contexts (each decode's context, ';'-separated), chunks ('size@prefix;...') and
    seconds. benchmarks/sim_vs_vllm.py records vLLM's steps in this form."""
    vidur: tuple[str, ...] = ()
    """Fit to measured per-layer GPU operator times instead: Vidur profiling CSVs of one
    device (envs/data/vidur/DEVICE__MODEL.csv); several files, or the flag repeated."""
    held_out: tuple[str, ...] = ()
    """With --vidur: files of the same device reported but not fitted."""
    tp: int | None = None
    """With --vidur: only rows of this tensor-parallel degree (default: all)."""
    check: bool = False
    """With --vidur and --hardware: fit nothing; report that profile's error on the files."""
    json: bool = False
    """With --check: print {"rows", "median_abs_pct", "p90_abs_pct"} as one JSON object."""
    cross_validate: bool = False
    """With --vidur: also fit on all files but one, for each file, and report its error."""

    def __post_init__(self) -> None:
        """Every option is checked here, before a profile is read or anything is timed."""
        require(self.device in DEVICES, "device", self.device, f"must be one of {', '.join(DEVICES)}")
        require(self.dtype is None or self.dtype in DTYPES, "dtype", self.dtype,
                f"must be one of {', '.join(DTYPES)}")
        require(self.form in FORMS, "form", self.form, f"must be one of {', '.join(FORMS)}")
        integer("layers", self.layers, 1, 2**20)
        integer("repeats", self.repeats, 1, MAX_REPEATS)
        number("scale", self.scale, 0, MAX_SCALE, low_open=True)
        if self.name is not None:
            require(isinstance(self.name, str) and 0 < len(self.name) <= MAX_NAME_CHARS
                    and self.name.isprintable(), "name", self.name,
                    f"must be 1 to {MAX_NAME_CHARS} printable characters")
        if self.tp is not None:
            integer("tp", self.tp, 1, 1024)
        for name in ("steps", "hardware"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and bool(value.strip())), name, value,
                    "must be a path" + (" or a preset name" if name == "hardware" else ""))
        for name in ("vidur", "held_out"):
            for value in getattr(self, name):
                require(bool(value.strip()), name, value, "must be paths to Vidur CSV files")

    def check_outputs(self) -> None:
        """Refuse outputs that cannot be written before any work: a fit is minutes of timing."""
        check_output("out", self.out)
        for name in ("csv", "plot"):
            if getattr(self, name) is not None:
                check_output(name, getattr(self, name))
        check_distinct(out=self.out, csv=self.csv, plot=self.plot, steps=self.steps,
                       **{f"vidur_{i}": p for i, p in enumerate(self.vidur + self.held_out)})


def machine_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def write_profile(out: Path, header: str, profile) -> None:
    """Write atomically: an engine or a run reading the profile never sees half of it."""
    write_atomic(out, header + profile_to_toml(profile))


# --- fitting an engine's measured steps ---------------------------------------------------


def calibrate_steps(args: CalibrateArgs) -> int:
    model = get_model(args.model)
    steps = read_steps(args.steps)
    base = get_hardware(args.hardware) if args.hardware else None
    fit, plain, parts, secs = fit_steps(steps, model, args.form == "refined", base)
    held = held_out(len(steps))
    err = ape(fit, parts, secs)[held]
    # On top of a device's profile the result is that device serving with this engine: it
    # keeps the device's name, so that a table exported with it passes the provenance check
    # of an engine on that device.
    with_prefill = np.array([bool(chunks) for _, chunks, _ in steps])
    jitter = step_jitter(fit.predict(parts[with_prefill]), secs[with_prefill])
    profile = replace(fit.profile(args.name or (base.name if base else "calibrated-steps"),
                                  base.memory_bytes if base else machine_memory_bytes()),
                      step_jitter=jitter[0], step_jitter_s=jitter[1],
                      step_jitter_share=jitter[2])
    what = f"the per-step overhead on top of {args.hardware}" if base else ""
    write_profile(Path(args.out),
                  f"# Fitted to {len(steps)} measured engine steps ({args.steps}) with model "
                  f"{model.name}{'; ' + what if what else ''}; held-out median error "
                  f"{np.median(err):.1%}; {jitter_line(jitter, int(with_prefill.sum()))}.\n", profile)
    print(f"fit to {len(steps)} steps{' (' + what + ')' if what else ''}: {fit.describe()}; "
          + error_line(f"held-out steps ({int(held.sum())})", err))
    print(jitter_line(jitter, int(with_prefill.sum())))
    if args.form == "refined" and plain is not None:
        print(f"plain roofline ({plain.describe()}): "
              + error_line("held-out steps", ape(plain, parts, secs)[held]))
    print(f"profile written to {args.out}; use it with --hardware {args.out}")
    return 0


# --- timing torch passes ----------------------------------------------------------------


def check_torch_args(args: CalibrateArgs):
    """Validate the torch options before anything is built; (torch, dtype, dtype name)."""
    full = get_model(args.model)
    integer("layers", args.layers, 1, full.layers, f"the layers {full.name} has")
    import torch  # heavy and optional: only --torch measures passes with it

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: got 'cuda', but torch sees no CUDA device here")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dname = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return torch, dtypes[dname], dname


def report_torch_fit(args, rows, fit: Fit, plain: Fit, parts, seconds, held, overhead, built) -> None:
    pred = fit.predict(parts)
    err = ape(fit, parts, seconds)
    full = get_model(args.model)
    print(f"\nmeasured {len(rows)} shapes in {built['measure_s']:.0f} s on {args.device} "
          f"({built['dtype']}, {args.layers} of {full.layers} layers of {full.name}, MLP width "
          f"{built['inter']}); an empty pass costs {overhead * 1e3:.2f} ms")
    print(f"fit ({args.form}): {fit.describe()} ({built['overhead_full'] * 1e3:.2f} ms scaled to "
          f"{full.layers} layers)")
    print(error_line(f"held-out shapes ({int(held.sum())})", err[held])
          + f"; all shapes: median {np.median(err):.1%}")
    if args.form == "refined":
        print(f"plain roofline ({plain.describe()}): "
              + error_line("held-out shapes", ape(plain, parts, seconds)[held]))
    for (c, k, sec), p in zip(rows, pred):
        print(f"  {len(c):3d} decodes @ {max(c) if c else 0:5d} ctx, chunks {k or '-'}: measured "
              f"{sec * 1e3:8.2f} ms, model {p * 1e3:8.2f} ms")
    for i in np.argsort(-err)[:3]:
        c, k = rows[i][0], rows[i][1]
        print(f"  worst: {len(c)} decodes, chunks {k or '-'}: measured {seconds[i] * 1e3:.2f} ms, "
              f"model {pred[i] * 1e3:.2f} ms ({(pred[i] - seconds[i]) / seconds[i]:+.0%})")


def write_measurements_csv(path: str, rows, fit: Fit, plain: Fit, parts, held) -> None:
    lines = ["decodes,decode_context,chunks,measured_s,predicted_s,plain_roofline_s,"
             + ",".join(PART_COLUMNS) + ",held_out"]
    for (c, k, sec), p, pp, row, h in zip(rows, fit.predict(parts), plain.predict(parts), parts, held):
        chunk_text = ";".join(f"{x}@{q}" for x, q in k)
        lines.append(f"{len(c)},{max(c) if c else 0},{chunk_text},{sec:.6g},{p:.6g},{pp:.6g},"
                     + ",".join(f"{v:.6g}" for v in row) + f",{int(h)}")
    write_atomic(path, "\n".join(lines) + "\n")


def plot_fit(path: str, args, name: str, fit: Fit, plain: Fit, parts, seconds, held) -> None:
    import matplotlib  # heavy: only --plot draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    pred = fit.predict(parts)
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
    ax.set_title(f"{name}: {args.layers} layer(s) of {args.model}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


def calibrate_torch(args: CalibrateArgs) -> int:
    from envs.calibrate.torch_passes import measure_grid, total_memory_bytes  # torch: heavy, optional

    torch, dtype, dname = check_torch_args(args)
    full = get_model(args.model)
    try:
        rows, overhead, built = measure_grid(torch, full, args.layers, dtype, args.device,
                                             args.repeats, args.scale)
    except torch.OutOfMemoryError:
        raise ConfigError(f"layers: {args.layers} layers with the grid at scale {args.scale:g} do "
                          f"not fit in {args.device} memory; lower --layers or --scale") from None
    built["dtype"] = dname
    seconds = np.array([r[2] for r in rows])
    parts = shape_parts(unit_roofline(built["model"]), [PassShape.of(c, k) for c, k, _ in rows])
    held = held_out(len(rows))
    plain = fit_passes(parts[~held], seconds[~held], refined=False)
    fit = plain if args.form == "roofline" else fit_passes(parts[~held], seconds[~held],
                                                           overhead_s=overhead)
    err = ape(fit, parts, seconds)
    # The overhead is per layer (launches, dispatch); the rates are the device's own.
    built["overhead_full"] = fit.overhead_s * full.layers / args.layers
    name = args.name or f"calibrated-{args.device}"
    profile = fit.profile(name, total_memory_bytes(torch, args.device), built["overhead_full"])
    write_profile(Path(args.out),
                  f"# Fitted by python -m envs.calibrate --device {args.device} --model {args.model} "
                  f"--layers {args.layers} ({dname}, {args.form}), {time.strftime('%Y-%m-%d')}.\n"
                  f"# Rates are effective (fractions 1.0); held-out error: median "
                  f"{np.median(err[held]):.1%}, p90 {np.percentile(err[held], 90):.1%}.\n", profile)
    report_torch_fit(args, rows, fit, plain, parts, seconds, held, overhead, built)
    print(f"profile written to {args.out}; use it with --hardware {args.out}")
    if args.csv:
        write_measurements_csv(args.csv, rows, fit, plain, parts, held)
    if args.plot:
        plot_fit(args.plot, args, name, fit, plain, parts, seconds, held)
    return 0


# --- fitting measured GPU operator times (Vidur) --------------------------------------------

# The datasheet profile a device's files are fitted against, by file-name prefix.
VIDUR_DATASHEETS = {"h100": "h100-sxm-datasheet", "a100": "a100-80g-datasheet"}


def vidur_peak(args: CalibrateArgs, tables) -> HardwareProfile:
    """The datasheet profile to fit against: --hardware, or the one the files' device names."""
    if args.hardware:
        return get_hardware(args.hardware)
    devices = sorted({str(t.device) for t in tables})
    if len(devices) > 1:
        raise ConfigError(f"vidur: files of several devices ({', '.join(devices)}); fit one device "
                          "at a time, or name its datasheet profile with --hardware")
    if devices[0] not in VIDUR_DATASHEETS:
        raise ConfigError(f"vidur: no datasheet profile known for device {devices[0]!r} "
                          f"({tables[0].name}); name one with --hardware PROFILE.toml")
    return get_hardware(VIDUR_DATASHEETS[devices[0]])


def vidur_command(args: CalibrateArgs) -> str:
    words = ["python -m envs.calibrate --vidur", *args.vidur]
    if args.held_out:
        words += ["--held-out", *args.held_out]
    if args.hardware:
        words += ["--hardware", args.hardware]
    if args.tp is not None:
        words += ["--tp", str(args.tp)]
    if args.name:
        words += ["--name", args.name]
    return " ".join(words + ["--out", args.out])


def check_vidur(args: CalibrateArgs) -> int:
    require(args.hardware is not None, "hardware", None, "--check needs --hardware, the profile to check")
    hw = get_hardware(args.hardware)
    tables = read_tables(args.vidur + args.held_out, args.tp)
    rows, med, p90 = Errors.of(hw, tables).summary()
    if args.json:
        print(json.dumps({"rows": rows, "median_abs_pct": round(100 * med, 3),
                          "p90_abs_pct": round(100 * p90, 3)}))
    else:
        print(f"{hw.name} on {rows} rows of {', '.join(t.name for t in tables)}: per-layer time "
              f"off by a median {med:.1%}, p90 {p90:.1%}")
    return 0


def calibrate_vidur(args: CalibrateArgs) -> int:
    if args.check:
        return check_vidur(args)
    fit_tables = read_tables(args.vidur, args.tp)
    held_tables = read_tables(args.held_out, args.tp)
    peak = vidur_peak(args, fit_tables + held_tables)
    fit = fit_layers(fit_tables, peak)
    profile = fitted_profile(fit, peak, args.name or f"fitted-{fit_tables[0].device or 'gpu'}")
    held = Errors.of(profile, held_tables)
    summary = "; ".join(f"{g}: median {m:.1%}, p90 {q:.1%}" for g, (n, m, q) in
                        ((g, held.summary(g)) for g in ("tp 1", "tp 2-8")) if n)
    write_profile(Path(args.out),
                  f"# Fitted by {vidur_command(args)}\n# to measured per-layer operator times (Vidur's "
                  f"profiling data); device figures are fractions of {peak.name}'s peaks.\n"
                  + (f"# Held-out error of the per-layer time: {summary}.\n" if summary else ""),
                  profile)
    print("\n".join(report_lines(fit, profile, peak, fit_tables, held_tables, args.cross_validate)))
    print(f"profile written to {args.out}; use it with --hardware {args.out}")
    if args.plot:
        plot_vidur(args.plot, fit_tables + held_tables, {t.path for t in held_tables}, profile, peak)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(CalibrateArgs, argv, prog="python -m envs.calibrate")
    if args.check:
        require(bool(args.vidur or args.held_out), "check", True,
                "--check needs --vidur FILE.csv (and --hardware PROFILE)")
    else:
        args.check_outputs()
    if args.vidur or args.held_out:
        require(bool(args.vidur) or args.check, "vidur", args.vidur,
                "--held-out needs files to fit, given with --vidur")
        return calibrate_vidur(args)
    if args.steps:
        return calibrate_steps(args)
    return calibrate_torch(args)


if __name__ == "__main__":
    run_cli(main)
