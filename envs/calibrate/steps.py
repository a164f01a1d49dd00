"""Measured engine steps as calibration data: read them, fit the cost model to them.

The CSV has columns ``decode_contexts`` (each decode's context, ';'-separated),
``chunks`` ('size@prefix;...') and ``seconds``; ``benchmarks/sim_vs_vllm.py`` records
vLLM's steps in this form.
"""

from __future__ import annotations

import numpy as np

from envs.calibrate.fit import Fit, fit_of, fit_overhead, fit_passes, held_out, shape_parts, unit_roofline
from envs.cost import PassShape
from envs.errors import ConfigError
from envs.profiles import HardwareProfile


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


def fit_steps(steps, model, refined: bool = True,
              base: HardwareProfile | None = None) -> tuple[Fit, Fit | None, np.ndarray, np.ndarray]:
    """Fit on two thirds of measured engine steps: (fit, plain-roofline fit, parts, seconds).
    With ``base``, its device figures are kept and only the per-step overhead is fitted
    (no plain fit then: None)."""
    # Parts are one device's share of each step, so the fitted rates are one device's.
    parts = shape_parts(unit_roofline(model), [PassShape.of(c, k) for c, k, _ in steps])
    secs = np.array([t for _, _, t in steps])
    held = held_out(len(steps))
    if base is not None:
        return fit_overhead(fit_of(base), parts[~held], secs[~held]), None, parts, secs
    plain = fit_passes(parts[~held], secs[~held], refined=False)
    fit = fit_passes(parts[~held], secs[~held]) if refined else plain
    return fit, plain, parts, secs


