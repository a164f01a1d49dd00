"""Generate greedily with vLLM's in-process LLM on a tiny random Llama; print JSON.

    python tests/engine_vllm/run_llm.py MODEL_DIR [--table PATH] [--async-scheduling] [--plugin]

With --table, the engine runs chunkpilot's TableScheduler reading that table. --plugin
registers chunkpilot's vLLM plug-in first, as an installed distribution's entry point would.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the engine core in this process
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def write_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=1000,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--table")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--plugin", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_model(args.model)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.plugin:
        from policies.vllm_startup import register
        register()

    kwargs = {}
    if args.table:
        os.environ["CHUNKPILOT_TABLE"] = args.table
        kwargs["scheduler_cls"] = ("policies.vllm_scheduler.AsyncTableScheduler"
                                   if args.async_scheduling else
                                   "policies.vllm_scheduler.TableScheduler")
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
              max_num_batched_tokens=512, max_num_seqs=16, enforce_eager=True,
              async_scheduling=args.async_scheduling, seed=0, **kwargs)
    # Short prompts and one long prompt (900 tokens) among them.
    lengths = [20, 30, 900, 25, 40]
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 900 + 3 for j in range(n)])
               for i, n in enumerate(lengths)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    history = [[f, b] for f, b in getattr(sched, "chunkpilot_history", [])]
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "scheduler": type(sched).__name__, "history": history}))


if __name__ == "__main__":
    main()
