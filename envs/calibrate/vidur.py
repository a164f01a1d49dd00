"""Measured per-layer GPU operator times (Vidur's profiling data) as calibration data.

A file (``envs/data/vidur/README.md``) holds one model's shape on a ``# key=value, ...``
first line, then one row per (num_tokens, tp): the median time of each operator of one
decoder layer on one device of a tp group. A row's layer is priced by the cost model
(:mod:`envs.cost`) as one layer on one device: the weights and FLOPs of the QKV, output,
gate/up and down projections divided by tp on the roofline; norms, rotary embedding,
activation and residual add as small memory-bound kernels (their bytes per token,
:func:`envs.profiles.elementwise_bytes_per_token`); no KV cache, attention or all-reduce,
which the files do not time. The embedding lookup (once per pass) is left out.

:func:`fit_layers` fits a device's figures to such rows; :func:`price_rows` prices them
with a hardware profile through :func:`envs.cost.price`, the simulator's own function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from envs.calibrate.fit import PART_COLUMNS, Fit, least_squares
from envs.cost import PassShape, Roofline, price
from envs.errors import MAX_TOKENS, ConfigError, show
from envs.files import csv_rows, first_line
from envs.profiles import HardwareProfile, ModelProfile, elementwise_bytes_per_token

SHAPE_KEYS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
LAYER_COLUMNS = ("input_layernorm_ms", "attn_pre_proj_ms", "attn_rope_ms", "attn_post_proj_ms",
                 "post_attention_layernorm_ms", "mlp_up_proj_ms", "mlp_act_ms", "mlp_down_proj_ms",
                 "add_ms")
"""One decoder layer's operators; their times add up to the layer's."""
SECOND_NORM = "post_attention_layernorm_ms"
"""Empty where the model has one norm a layer (phi-2's parallel attention and MLP)."""

# Weights and activations were profiled in fp16.
BYTES_PER_ELEMENT = 2.0


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as a Vidur file's first line describes it."""

    heads: int
    kv_heads: int
    hidden_size: int
    intermediate_size: int
    gated_mlp: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @property
    def projection_params(self) -> int:
        """Weights of the QKV, output, gate/up and down projections of the whole layer."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * d
        out = self.heads * d * h
        up = h * self.intermediate_size * (2 if self.gated_mlp else 1)
        down = self.intermediate_size * h
        return qkv + out + up + down

    def model(self, tp: int) -> ModelProfile:
        """The layer as a one-layer model sharded over ``tp`` devices."""
        return ModelProfile(name="vidur-layer", layers=1, hidden_size=self.hidden_size, heads=self.heads,
                            kv_heads=self.kv_heads, head_dim=self.head_dim,
                            params=float(self.projection_params), bytes_per_weight=BYTES_PER_ELEMENT,
                            tensor_parallel=tp, intermediate_size=self.intermediate_size,
                            bytes_per_activation=BYTES_PER_ELEMENT)

    def elementwise_bytes_per_token(self, tp: int, norms: int = 2) -> float:
        return elementwise_bytes_per_token(self.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                           self.intermediate_size, tp, gated_mlp=self.gated_mlp,
                                           norms=norms, bytes_per_element=BYTES_PER_ELEMENT)


@dataclass(frozen=True, eq=False)
class VidurTable:
    """The rows of one file: per-layer seconds on one device against tokens and tp."""

    path: str
    shape: LayerShape
    tokens: np.ndarray
    tp: np.ndarray
    norms: np.ndarray
    """Norm kernels of the layer in each row: 2, or 1 where the second norm is empty."""
    seconds: np.ndarray

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def device(self) -> str | None:
        """The device named by the file name (``h100__Llama-2-7b-hf.csv``: h100)."""
        stem = Path(self.path).stem
        return stem.split("__")[0] if "__" in stem else None

    def __len__(self) -> int:
        return len(self.seconds)

    def select(self, mask: np.ndarray) -> "VidurTable":
        return replace(self, tokens=self.tokens[mask], tp=self.tp[mask], norms=self.norms[mask],
                       seconds=self.seconds[mask])

    def with_tp(self, tp: int | None) -> "VidurTable":
        """Only the rows of one tensor-parallel degree (all for None)."""
        if tp is None:
            return self
        if not (self.tp == tp).any():
            have = ", ".join(str(t) for t in sorted(set(self.tp.tolist())))
            raise ConfigError(f"vidur: {self.path!r} has no rows with tp {tp} (it has tp {have})")
        return self.select(self.tp == tp)


def _shape_line(path: str, line: str) -> LayerShape:
    where = f"vidur: {path!r} line 1"
    if not line.startswith("#"):
        raise ConfigError(f"{where}: must be the model's shape, '# {'=..., '.join(SHAPE_KEYS)}=...'")
    values = {}
    for item in line[1:].split(","):
        key, eq, value = item.partition("=")
        if eq:
            values[key.strip()] = value.strip()
    for key in SHAPE_KEYS:
        if key not in values:
            raise ConfigError(f"{where}: missing {key} in the shape line")

    def integer(key: str) -> int:
        try:
            value = int(values[key])
        except ValueError:  # not an integer, or one of over 4,300 digits
            raise ConfigError(f"{where}: {key}: got {show(values[key])}, must be an integer > 0") from None
        if not 0 < value <= MAX_TOKENS:
            raise ConfigError(f"{where}: {key}: got {show(value)}, must be an integer > 0 and <= {MAX_TOKENS}")
        return value

    heads, kv_heads, hidden, inter = (integer(k) for k in SHAPE_KEYS[:4])
    integer("vocab_size")
    gated = values["use_gated_mlp"]
    if gated not in ("True", "False"):
        raise ConfigError(f"{where}: use_gated_mlp: got {gated!r}, must be True or False")
    if hidden % heads:
        raise ConfigError(f"{where}: n_embd: got {hidden}, must be a multiple of n_head ({heads})")
    if heads % kv_heads:
        raise ConfigError(f"{where}: n_kv_head: got {kv_heads}, must divide n_head ({heads})")
    return LayerShape(heads, kv_heads, hidden, inter, gated == "True")


OPERATOR_MAX_MS = 3.6e6
"""Longest plausible operator time (an hour), milliseconds."""
MAX_TP = 1024
VIDUR_MAX_BYTES = 1 << 28


def _number(path: str, line: int, row: dict, field: str) -> float:
    text = row[field]
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"vidur: {path!r} line {line}: {field}: got {show(text)}, must be a number") from None
    if not (math.isfinite(value) and 0 <= value <= OPERATOR_MAX_MS):
        raise ConfigError(f"vidur: {path!r} line {line}: {field}: got {show(text)}, "
                          f"must be a finite number >= 0 and <= {OPERATOR_MAX_MS:g}")
    return value


def _count(path: str, line: int, row: dict, field: str, high: int) -> int:
    text = row[field]
    try:
        value = int(text)
    except (TypeError, ValueError):  # not an integer, or one of over 4,300 digits
        value = 0
    if not 1 <= value <= high:
        raise ConfigError(f"vidur: {path!r} line {line}: {field}: got {show(text)}, "
                          f"must be an integer > 0 and <= {high}")
    return value


def read_vidur(path: str) -> VidurTable:
    """Read one file; bad input raises a one-line ConfigError naming file, line and field."""
    shape = _shape_line(path, first_line("vidur", path, VIDUR_MAX_BYTES).strip())
    rows = csv_rows("vidur", path, VIDUR_MAX_BYTES, skip_lines=1)
    line, header = next(rows, (2, []))
    need = ("num_tokens", "tp") + LAYER_COLUMNS
    missing = [c for c in need if c not in header]
    if missing:
        raise ConfigError(f"vidur: {path!r} line {line}: missing column(s) {', '.join(missing)}")
    tokens, tps, norms, seconds = [], [], [], []
    for line, cells in rows:
        if len(cells) < len(header):
            raise ConfigError(f"vidur: {path!r} line {line}: expected {len(header)} fields, got {len(cells)}")
        row = dict(zip(header, cells))
        one_norm = row[SECOND_NORM] == ""
        ms = sum(_number(path, line, row, c) for c in LAYER_COLUMNS
                 if not (c == SECOND_NORM and one_norm))
        if ms <= 0:
            raise ConfigError(f"vidur: {path!r} line {line}: the layer's operators add up to "
                              f"{ms} ms, must be > 0")
        tokens.append(_count(path, line, row, "num_tokens", MAX_TOKENS))
        tps.append(_count(path, line, row, "tp", MAX_TP))
        norms.append(1 if one_norm else 2)
        seconds.append(ms * 1e-3)
    if not seconds:
        raise ConfigError(f"vidur: {path!r} has no rows")
    return VidurTable(path, shape, np.array(tokens), np.array(tps), np.array(norms), np.array(seconds))


def read_tables(paths, tp: int | None = None) -> list[VidurTable]:
    return [read_vidur(p).with_tp(tp) for p in paths]


# --- pricing --------------------------------------------------------------------------------


def layer_parts(table: VidurTable, tile_tokens: int = 1) -> np.ndarray:
    """Parts (:data:`envs.calibrate.fit.PART_COLUMNS`) of each row's layer on one device.

    ``tile_tokens`` > 1 rounds the tokens of the products up to a multiple of it (a
    GEMM's tile quantisation): a diagnostic the cost model itself does not carry.
    """
    s = table.shape
    tp = table.tp.astype(float)
    params = s.projection_params / tp
    product_tokens = np.ceil(table.tokens / tile_tokens) * tile_tokens
    elementwise = np.array([s.elementwise_bytes_per_token(int(t), int(n))
                            for t, n in zip(table.tp, table.norms)])
    parts = np.zeros((len(table), len(PART_COLUMNS)))
    parts[:, 0] = params * BYTES_PER_ELEMENT
    parts[:, 2] = 2.0 * params * product_tokens
    parts[:, 4] = elementwise * table.tokens
    parts[:, 7] = 1.0  # one layer
    return parts


def layer_roofline(hardware: HardwareProfile, shape: LayerShape, tp: int, norms: int = 2) -> Roofline:
    """The cost model's coefficients for one layer on one device of a tp group, without
    what the files do not time: KV cache, attention and all-reduces."""
    r = Roofline.of(hardware, shape.model(tp))
    ew = hardware.elementwise_bytes_per_s
    return replace(r, kv_bytes_per_token=0.0, attention_flops_per_pair=0.0, allreduce_s_per_token=0.0,
                   allreduce_fixed_s=0.0,
                   elementwise_s_per_token=shape.elementwise_bytes_per_token(tp, norms) / ew if ew else 0.0)


def price_rows(hardware: HardwareProfile, table: VidurTable) -> np.ndarray:
    """Each row's layer priced by :func:`envs.cost.price` (seconds)."""
    rooflines: dict[tuple[int, int], Roofline] = {}
    out = np.empty(len(table))
    for i, (tokens, tp, norms) in enumerate(zip(table.tokens.tolist(), table.tp.tolist(),
                                                table.norms.tolist())):
        r = rooflines.get((tp, norms))
        if r is None:
            r = rooflines[(tp, norms)] = layer_roofline(hardware, table.shape, tp, norms)
        out[i] = price(r, PassShape(num_decodes=tokens)).total_s
    return out


def abs_error(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Absolute relative error of each prediction."""
    return np.abs(predicted - measured) / measured


# --- fitting ---------------------------------------------------------------------------------


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-min(max(x, -60.0), 60.0)))


def fit_layers(tables: list[VidurTable], peak: HardwareProfile, tile_tokens: int = 1) -> Fit:
    """Fit one device's figures to the rows of ``tables``: the bandwidth of the weight
    products and their FLOP/s (at most the peaks of ``peak``), the overlap of memory and
    compute, a fixed time per layer, and the small kernels' bandwidth (at most the peak).

    Least squares on the relative error, each file weighing as much as any other
    (Levenberg-Marquardt from several starts, on logistic parameters that keep every
    figure in its range). Attention rates stay at 1: the files have no attention.
    """
    parts = np.vstack([layer_parts(t, tile_tokens) for t in tables])
    seconds = np.concatenate([t.seconds for t in tables])
    weights = np.concatenate([np.full(len(t), 1 / math.sqrt(len(t))) for t in tables])
    if len(seconds) < 5:
        raise ConfigError(f"vidur: {len(seconds)} rows are too few to fit 5 figures")
    bw_peak, flops_peak = peak.hbm_bytes_per_s, peak.peak_flops_per_s
    cap = float(seconds.min())  # no layer can cost less than its fixed part

    def unpack(x: np.ndarray) -> Fit:
        return Fit(bytes_per_s=bw_peak * _sigmoid(x[0]), flops_per_s=flops_peak * _sigmoid(x[1]),
                   overlap=_sigmoid(x[2]), per_layer_overhead_s=cap * _sigmoid(x[3]),
                   elementwise_bytes_per_s=bw_peak * _sigmoid(x[4]))

    def residual(x: np.ndarray) -> np.ndarray:
        return weights * (unpack(x).predict(parts) / seconds - 1)

    starts = [np.array([_logit(b), _logit(f), _logit(o), _logit(c), _logit(e)])
              for b, f, o, c, e in ((0.8, 0.7, 0.5, 0.2, 0.4), (0.95, 0.8, 0.2, 0.4, 0.6),
                                    (0.6, 0.5, 0.8, 0.1, 0.2))]
    best = min((least_squares(residual, x) for x in starts), key=lambda lx: lx[0])
    return unpack(best[1])


def fitted_profile(fit: Fit, peak: HardwareProfile, name: str) -> HardwareProfile:
    """``peak``'s datasheet figures with the fitted ones as fractions of its peaks."""
    return replace(peak, name=name, bandwidth_fraction=fit.bytes_per_s / peak.hbm_bytes_per_s,
                   flops_fraction=fit.flops_per_s / peak.peak_flops_per_s, overlap=fit.overlap,
                   per_layer_overhead_s=fit.per_layer_overhead_s,
                   elementwise_bytes_per_s=fit.elementwise_bytes_per_s)


def flat_end(table: VidurTable, tolerance: float = 0.1) -> int:
    """The most tokens up to which the measured layer (at tp 1) stays within
    ``tolerance`` of its time at the fewest tokens: where the free ride ends."""
    t = table.with_tp(1)
    order = np.argsort(t.tokens, kind="stable")
    tokens, seconds = t.tokens[order], t.seconds[order]
    over = seconds > (1 + tolerance) * seconds[0]
    return int(tokens[np.argmax(over) - 1]) if over.any() else int(tokens[-1])
