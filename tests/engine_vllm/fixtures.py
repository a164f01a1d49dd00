"""Build vLLM's real Scheduler without a model, the way vLLM's own tests do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}


# The provenance of a table made for TINY_LLAMA on vLLM's CPU backend (the hardware
# figures are never compared there: an engine on CPU knows only the name "cpu").
TINY_CPU_PROVENANCE = {
    "hardware": {"name": "cpu", "hbm_bytes_per_s": 1e11, "peak_flops_per_s": 1e12,
                 "memory_bytes": 16e9},
    "model": {"name": "tiny-llama", "layers": 2, "hidden_size": 128, "heads": 4, "kv_heads": 2,
              "head_dim": 32, "bytes_per_weight": 4.0, "tensor_parallel": 1},
    "slo": {"ttft_s": 2.0, "itl_s": 0.1},
}


def table_dict(features: list[tuple[str, list]], budgets: list[int], default_budget: int,
               **provenance) -> dict:
    """A table for the tiny Llama on CPU; ``provenance`` overrides blocks of it."""
    return {"schema_version": 2, "kind": "chunkpilot-budget-table", "action": {"kind": "tokens"},
            "features": [{"name": n, "edges": e} for n, e in features], "budgets": budgets,
            "default_budget": default_budget,
            "provenance": {**TINY_CPU_PROVENANCE, **provenance}}


def model_dir(root: Path) -> str:
    """A config.json-only model directory (no weights, no tokenizer)."""
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def create_scheduler(cls, model: str, max_num_batched_tokens: int, max_num_seqs: int = 32,
                     num_blocks: int = 4000, async_scheduling: bool = False,
                     prefix_caching: bool = False, **kwargs):
    """vLLM's scheduler ``cls`` over a KV cache of ``num_blocks`` blocks. ``async_scheduling``
    is set after the config is built: vLLM's CPU platform turns it off, as GPU vLLM would
    not (the scheduler classes behave the same either way; only start-up checks read it)."""
    sched_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=8192, enable_chunked_prefill=True,
                                   is_encoder_decoder=False)
    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=8192)
    cache_config = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=prefix_caching)
    vllm_config = VllmConfig(scheduler_config=sched_config, model_config=model_config,
                             cache_config=cache_config)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    return cls(vllm_config=vllm_config, kv_cache_config=kv_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK,
               log_stats=False, **kwargs)


def make_request(rid: str, prompt_tokens: int, max_tokens: int, tokens: list | None = None,
                 block_hasher=None) -> Request:
    """A request of ``prompt_tokens`` 7s, or of ``tokens``; with ``block_hasher`` (see
    :func:`block_hasher`) its blocks are hashed for prefix caching, as vLLM's engine does."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=rid, prompt_token_ids=tokens or [7] * prompt_tokens,
                   sampling_params=params, pooling_params=None, block_hasher=block_hasher)


def block_hasher():
    """vLLM's block hasher, as its engine core sets it up when prefix caching is on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK, fn)


def fake_output(scheduler, scheduler_output) -> ModelRunnerOutput:
    """What a model runner returns for a step: token 5 for each request whose scheduled
    tokens reach the end of its sequence, nothing for a partial prefill chunk. Call it
    right after ``schedule()``; an async test may deliver it steps later."""
    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [5] for rid in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def fake_clock(monkeypatch, start: float = 100.0) -> list[float]:
    """The table scheduler's ``time.monotonic`` read from a list a test moves by hand
    (``clock[0] += seconds``); ``time.time`` and ``time.perf_counter`` stay real."""
    import time
    import types

    import policies.vllm_scheduler as vs

    clock = [start]
    monkeypatch.setattr(vs, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], time=time.time, perf_counter=time.perf_counter))
    return clock
