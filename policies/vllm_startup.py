"""What the table schedulers check before serving, and the vLLM plug-in that checks it early.

The checks (``check_startup``): the table loads and validates; its largest budget and its
default fit under the engine's ``max_num_batched_tokens``; ``TableScheduler`` is not run
with async scheduling on; its provenance matches the served model's shape (layers,
hidden size, heads, KV heads, head dim, bytes per weight, tensor parallel) and the device
(name and memory), and the SLO the operator states, if any. A mismatch is refused with
one line naming both sides, unless ``CHUNKPILOT_ALLOW_MISMATCH=1``. A table that carries to
other deployments (provenance ``deployments``) is compared instead with the deployment
``CHUNKPILOT_HARDWARE`` and ``CHUNKPILOT_MODEL`` name, if set, and re-priced for it.

Where they run. The scheduler runs them when vLLM builds it, which in vLLM 0.32 is in the
engine-core process after the model's weights are loaded and the KV cache is allocated
(``EngineCore.__init__``: executor, then ``_initialize_kv_caches``, then the scheduler),
minutes into a large model's start. The first point where the served model's config is
known and nothing is loaded yet is the front end's ``EngineArgs.create_engine_config``
(it reads ``config.json`` and resolves async scheduling; ``vllm serve``, ``LLM(...)`` and
headless engines all go through it). vLLM offers no hook there, but it loads general
plug-ins (entry-point group ``vllm.general_plugins``) in every process before that call,
from ``EngineArgs.__post_init__``. ``register`` is that plug-in: it wraps
``create_engine_config`` so that, when the configured scheduler is a table scheduler,
the checks run on the finished config and a bad table stops ``vllm serve`` in seconds,
before any engine process starts. The plug-in exists only where chunkpilot is installed
as a distribution (``pip install --no-deps ...``; see docs/serving.md); with a bare
``PYTHONPATH`` the scheduler's own check is the only one.

Device queries go through ``vllm.platforms.current_platform``, which reads NVML on
NVIDIA parts and does not initialise CUDA in the front end.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from envs.cost import Roofline
from envs.errors import MAX_SLO_ITL_S, MAX_SLO_TTFT_S, ConfigError
from envs.pricing import Coefficients
from envs.profiles import get_hardware, get_model
from policies.step_record import StepRecordError, check_record_path
from policies.table import (BudgetTable, TableError, device_hardware_name, hardware_provenance,
                            model_provenance, provenance_mismatches)

TABLE_ENV = "CHUNKPILOT_TABLE"
ALLOW_MISMATCH_ENV = "CHUNKPILOT_ALLOW_MISMATCH"
SLO_TTFT_ENV = "CHUNKPILOT_SLO_TTFT_S"
SLO_ITL_ENV = "CHUNKPILOT_SLO_ITL_S"
RELOAD_ENV = "CHUNKPILOT_RELOAD_INTERVAL_S"
SUMMARY_ENV = "CHUNKPILOT_SUMMARY_INTERVAL_S"
STEP_OVERHEAD_ENV = "CHUNKPILOT_STEP_OVERHEAD_S"
CORRECT_SPEED_ENV = "CHUNKPILOT_CORRECT_SPEED"
RECORD_STEPS_ENV = "CHUNKPILOT_RECORD_STEPS"
HARDWARE_ENV = "CHUNKPILOT_HARDWARE"
MODEL_ENV = "CHUNKPILOT_MODEL"

# vLLM configures the "vllm" logger tree (handlers, format, VLLM_LOGGING_LEVEL) and lets
# nothing propagate to the root; a child of it lands in the server's log like vLLM's own.
logger = logging.getLogger("vllm.chunkpilot")


@dataclass(frozen=True)
class Settings:
    """The table schedulers' environment variables, parsed once at start."""

    table_path: str
    """CHUNKPILOT_TABLE: the table file (JSON)."""
    allow_mismatch: bool = False
    """CHUNKPILOT_ALLOW_MISMATCH=1: serve a table whose provenance does not match (warned)."""
    slo_ttft_s: float | None = None
    """CHUNKPILOT_SLO_TTFT_S: the TTFT target served; compared with the table's when set."""
    slo_itl_s: float | None = None
    """CHUNKPILOT_SLO_ITL_S: the ITL target served; compared with the table's when set."""
    reload_interval_s: float = 1.0
    """CHUNKPILOT_RELOAD_INTERVAL_S: how often to look for a replaced table file (0: every
    step)."""
    summary_interval_s: float = 60.0
    """CHUNKPILOT_SUMMARY_INTERVAL_S: seconds between summary log lines (0: none)."""
    step_overhead_s: float = 0.0
    """CHUNKPILOT_STEP_OVERHEAD_S: the engine's own cost per step beyond the table's cost
    model (a time-fraction table turns fractions into tokens with it)."""
    correct_speed: bool = True
    """CHUNKPILOT_CORRECT_SPEED=0: take the table's cost model as this engine's speed;
    otherwise a time-fraction table's budgets follow the engine's measured step times
    (``policies.table.correction``)."""
    record_steps: str | None = None
    """CHUNKPILOT_RECORD_STEPS: a CSV file every step's shape and time are appended to, for
    ``python -m envs.calibrate --steps`` (``policies.step_record``); unset: none."""

    served: "ServedDeployment | None" = None
    """CHUNKPILOT_HARDWARE and CHUNKPILOT_MODEL: the deployment served, each a preset name,
    ``PRESET@field=value`` or a profile file (``python -m envs.calibrate``'s), whose cost model
    a table that carries is re-priced with; unset: the table's own cost model."""

    @classmethod
    def from_env(cls, table_path: str | None = None) -> "Settings":
        env = os.environ
        path = table_path or env.get(TABLE_ENV)
        if not path:
            raise TableError(f"{TABLE_ENV}: set it to the path of a chunkpilot table (JSON)")
        allow = _env_switch(ALLOW_MISMATCH_ENV, False)
        return cls(table_path=path, allow_mismatch=allow,
                   correct_speed=_env_switch(CORRECT_SPEED_ENV, True),
                   slo_ttft_s=_env_number(SLO_TTFT_ENV, None, positive=True, high=MAX_SLO_TTFT_S),
                   slo_itl_s=_env_number(SLO_ITL_ENV, None, positive=True, high=MAX_SLO_ITL_S),
                   reload_interval_s=_env_number(RELOAD_ENV, cls.reload_interval_s),
                   summary_interval_s=_env_number(SUMMARY_ENV, cls.summary_interval_s),
                   step_overhead_s=_env_number(STEP_OVERHEAD_ENV, 0.0),
                   record_steps=_env_record_path(RECORD_STEPS_ENV), served=_env_served())

    @property
    def slo(self) -> dict | None:
        if self.slo_ttft_s is None and self.slo_itl_s is None:
            return None
        return {"ttft_s": self.slo_ttft_s, "itl_s": self.slo_itl_s}


@dataclass(frozen=True)
class ServedDeployment:
    """The hardware and model a table that carries is re-priced for, as their provenance
    blocks (compared with what the engine runs) and their cost model."""

    hardware: dict
    model: dict
    cost: Coefficients


def _env_served() -> ServedDeployment | None:
    """CHUNKPILOT_HARDWARE and CHUNKPILOT_MODEL, read and priced before serving: both or
    neither (unset: None)."""
    hw, mdl = (os.environ.get(n, "").strip() for n in (HARDWARE_ENV, MODEL_ENV))
    if not hw and not mdl:
        return None
    if not (hw and mdl):
        unset, given = (HARDWARE_ENV, MODEL_ENV) if not hw else (MODEL_ENV, HARDWARE_ENV)
        raise TableError(f"{unset}: unset while {given} is set; set both (a preset name or a "
                         "profile file each), or neither")
    try:
        hardware = get_hardware(hw)
    except ConfigError as err:
        raise TableError(f"{HARDWARE_ENV}: {_unprefixed(err, 'hardware')}") from None
    try:
        model = get_model(mdl)
    except ConfigError as err:
        raise TableError(f"{MODEL_ENV}: {_unprefixed(err, 'model')}") from None
    # A preset with changed figures (h100-sxm@peak_flops_per_s=...) is still that part.
    named = {**hardware_provenance(hardware), "name": hardware.name.split("@")[0]}
    return ServedDeployment(named, model_provenance(model), Roofline.of(hardware, model).coefficients())


def _unprefixed(err: ConfigError, field: str) -> str:
    """A profile's error without its own field name (the variable names it instead)."""
    text = str(err)
    return text[len(field) + 2:] if text.startswith(f"{field}: ") else text


def _env_record_path(name: str) -> str | None:
    """A step record's path from the environment, checked before serving (unset: None)."""
    path = os.environ.get(name, "").strip()
    if not path:
        return None
    try:
        check_record_path(path, name)
    except StepRecordError as err:
        raise TableError(str(err)) from None
    return path


def _env_switch(name: str, default: bool) -> bool:
    """A yes/no setting from the environment (1/0, true/false, yes/no; unset: ``default``)."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text not in ("0", "1", "true", "false", "yes", "no"):
        raise TableError(f"{name}: got {text!r}, must be 1 or 0")
    return text in ("1", "true", "yes")


def _env_number(name: str, default: float | None, positive: bool = False,
                high: float | None = None) -> float | None:
    """A number from the environment; ``high``: a latency target's ceiling in seconds."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise TableError(f"{name}: got {text!r}, must be a number {'> 0' if positive else '>= 0'}")
    if high is not None and value > high:
        raise TableError(f"{name}: got {text!r}, must be at most {high:g} seconds; targets are "
                         "in seconds (100 ms is 0.1)")
    return value


# --- the served side -----------------------------------------------------------------

# Bytes per weight of quantization methods that do not say their bit width in the
# model's config (GPTQ and AWQ do: quantization_config.bits / w_bit).
_QUANT_BYTES = {"fp8": 1.0, "fbgemm_fp8": 1.0, "ptpc_fp8": 1.0, "modelopt": 1.0,
                "mxfp4": 0.53125, "modelopt_fp4": 0.5625}


def _bytes_per_weight(model_config) -> float | None:
    """Bytes each weight takes as served; None when the quantization does not say."""
    quant = getattr(model_config, "quantization", None)
    if not quant:
        return float(model_config.dtype.itemsize)
    qc = getattr(model_config.hf_config, "quantization_config", None)
    if isinstance(qc, dict):
        bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
        if isinstance(bits, (int, float)) and bits > 0:
            return bits / 8
    return _QUANT_BYTES.get(quant)


def dense_params(config) -> float | None:
    """A dense Llama-style decoder's parameter count from its Hugging Face config
    (embeddings, each layer's attention and gated MLP; norms are a rounding error): 8.03e9
    for Llama-3-8B, 7.24e9 for Mistral-7B, which share a shape. None for a mixture of
    experts or a config without the fields."""
    def get(key: str):
        return getattr(config, key, None)

    if any(get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    vocab, hidden, inter, layers = (get(k) for k in ("vocab_size", "hidden_size",
                                                     "intermediate_size", "num_hidden_layers"))
    heads = get("num_attention_heads")
    if not all(isinstance(v, int) and v > 0 for v in (vocab, hidden, inter, layers, heads)):
        return None
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    embed = vocab * hidden * (1 if get("tie_word_embeddings") else 2)
    return float(embed + layers * (attn + 3 * hidden * inter))


def served_model(vllm_config) -> dict:
    """The served model's shape, as a provenance ``model`` block."""
    mc = vllm_config.model_config
    arch = mc.model_arch_config
    name = mc.served_model_name
    try:
        params = dense_params(mc.hf_text_config)
    except Exception:  # a config this estimate does not know: the count is not compared
        params = None
    return {"name": name[0] if isinstance(name, list) else (name or mc.model),
            "layers": mc.get_total_num_hidden_layers(), "hidden_size": mc.get_hidden_size(),
            "heads": arch.total_num_attention_heads, "kv_heads": mc.get_total_num_kv_heads(),
            "head_dim": mc.get_head_size(), "bytes_per_weight": _bytes_per_weight(mc),
            "params": params, "tensor_parallel": vllm_config.parallel_config.tensor_parallel_size}


def served_hardware() -> dict:
    """The device as a provenance ``hardware`` block: its name mapped to the presets'
    (``device_hardware_name``) and its memory; ``cpu`` on vLLM's CPU backend."""
    from vllm.platforms import current_platform  # vLLM: only in its processes

    if current_platform.is_cpu():
        # Host memory is not the model's budget there (VLLM_CPU_KVCACHE_SPACE is).
        return {"name": "cpu", "device": "cpu", "memory_bytes": None}
    raw = current_platform.get_device_name(0)
    try:
        memory = float(current_platform.get_device_total_memory(0))
    except Exception:  # a platform without the query: the name alone is compared
        memory = None
    return {"name": device_hardware_name(raw), "device": raw, "memory_bytes": memory}


def engine_ceiling(vllm_config) -> int:
    """The most tokens one step may schedule: what vLLM sized its buffers for."""
    sc = vllm_config.scheduler_config
    return sc.max_num_scheduled_tokens or sc.max_num_batched_tokens


# --- the checks ----------------------------------------------------------------------

def provenance_reason(table: BudgetTable, settings: Settings, hardware: dict,
                      model: dict) -> str | None:
    """Why ``table`` does not fit the served ``hardware`` and ``model`` (provenance blocks),
    or None; raises TableError where the override cannot help. A table that carries is
    re-priced for the SLO served (the scheduler's ``_cp_carried``) and for the deployment
    CHUNKPILOT_HARDWARE/MODEL name, which must then be what runs."""
    carries, named = table.deployment_range is not None, settings.served
    if named and not carries:
        raise TableError(f"{HARDWARE_ENV}/{MODEL_ENV}: re-price only a table that carries to "
                         f"other deployments; {table.path} was made for one (no provenance "
                         f"deployments): unset both")
    if named:
        reasons = provenance_mismatches({"hardware": named.hardware, "model": named.model},
                                        hardware, model)
        return (f"{HARDWARE_ENV}/{MODEL_ENV} describe another deployment than this engine "
                "runs: " + "; ".join(reasons)) if reasons else None
    reason = table.mismatch(hardware, model, None if carries else settings.slo)
    if reason and carries:
        reason += (f" (a table that carries: set {HARDWARE_ENV} and {MODEL_ENV} to the "
                   "deployment served to re-price it for it)")
    return reason


def check_table(table: BudgetTable, vllm_config, settings: Settings,
                hardware: dict | None = None) -> str | None:
    """Refuse (TableError) a table this engine cannot serve; return the mismatch that
    CHUNKPILOT_ALLOW_MISMATCH lets through, if any. Run at start and on every reload."""
    # Provenance first: a table made for something else is the bigger mistake than a flag.
    reason = provenance_reason(table, settings, hardware or served_hardware(),
                               served_model(vllm_config))
    if reason and not settings.allow_mismatch:
        raise TableError(f"{reason}; set {ALLOW_MISMATCH_ENV}=1 to serve it anyway")
    ceiling = engine_ceiling(vllm_config)
    if table.max_budget is not None and table.max_budget > ceiling:
        raise TableError(
            f"{table.path}: its largest budget ({table.max_budget}) exceeds the engine's "
            f"max_num_batched_tokens ({ceiling}); start vLLM with --max-num-batched-tokens "
            f"{table.max_budget}")
    if table.default_budget > ceiling:
        raise TableError(f"{table.path}: default_budget ({table.default_budget}) exceeds the "
                         f"engine's max_num_batched_tokens ({ceiling})")
    return reason


def check_scheduler_mode(scheduler_cls: type, vllm_config) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # vLLM: only in its processes

    if vllm_config.scheduler_config.async_scheduling and not issubclass(scheduler_cls,
                                                                        AsyncScheduler):
        raise TableError(
            f"{scheduler_cls.__name__} is synchronous but async scheduling is on; use "
            "--scheduler-cls policies.vllm_scheduler.AsyncTableScheduler, or start vLLM with "
            "--no-async-scheduling")


def check_startup(scheduler_cls: type, vllm_config, table: BudgetTable | str | None = None,
                  hardware: dict | None = None) -> tuple[BudgetTable, Settings, str | None]:
    """Everything a table scheduler checks before serving: (table, settings, the mismatch
    let through by the override or None). Raises TableError with one line."""
    # A table given as an object (tests, embedding) is watched at its path, if it has one.
    settings = Settings.from_env(table.path if isinstance(table, BudgetTable) else table)
    if not isinstance(table, BudgetTable):
        table = BudgetTable.load(settings.table_path)
    check_scheduler_mode(scheduler_cls, vllm_config)
    return table, settings, check_table(table, vllm_config, settings, hardware)


# --- the plug-in ---------------------------------------------------------------------

TABLE_SCHEDULER_MARK = "chunkpilot_table_scheduler"
"""A class attribute every table scheduler sets (``policies.vllm_scheduler.TableBudget``):
how the plug-in knows one without importing the scheduler module, which imports this one."""


def _table_scheduler_class(vllm_config) -> type | None:
    """The configured scheduler class if it is a table scheduler, else None (without
    importing anyone else's scheduler module: vLLM resolves a qualified name of ours)."""
    cls = vllm_config.scheduler_config.scheduler_cls
    if isinstance(cls, str):
        if not cls.startswith("policies.vllm_scheduler."):
            return None
        from vllm.utils.import_utils import resolve_obj_by_qualname  # vLLM: only in its processes

        cls = resolve_obj_by_qualname(cls)
    return cls if isinstance(cls, type) and getattr(cls, TABLE_SCHEDULER_MARK, False) else None


def preflight(vllm_config) -> None:
    """The start-up checks, on the front end's config, before any engine starts."""
    cls = _table_scheduler_class(vllm_config)
    if cls is None:
        return
    table, _, reason = check_startup(cls, vllm_config)
    logger.info("chunkpilot: checked %s before loading the model: %s", table.path,
                f"provenance mismatch allowed ({reason})" if reason else "it fits this engine")


_registered = False


def register() -> None:
    """vLLM general plug-in (entry point ``vllm.general_plugins: chunkpilot``)."""
    global _registered
    if _registered:  # vLLM loads plug-ins once per process, but be safe on re-entry
        return
    _registered = True
    try:
        from vllm.engine.arg_utils import EngineArgs  # vLLM: absent where this is no vLLM process
    except ImportError:  # not a vLLM process after all
        return
    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        try:
            preflight(config)
        except TableError:
            raise
        except Exception as err:  # the early check must never be why vLLM cannot start
            logger.warning("chunkpilot: could not check the table before loading the model "
                           "(%s: %s); the scheduler checks it when it starts", type(err).__name__,
                           err)
        return config

    create_engine_config.__wrapped__ = original
    create_engine_config.__doc__ = original.__doc__
    EngineArgs.create_engine_config = create_engine_config
