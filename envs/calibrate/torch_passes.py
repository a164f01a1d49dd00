"""Timing real forward passes of a randomly initialised decoder with torch.

Only this module of the simulator's package imports torch (lazily, through the
``torch`` argument its functions take), so the simulator itself never needs it.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

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




def scaled_grid(scale: float) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """GRID with its token counts multiplied by ``scale`` (at least one token each)."""
    grid = []
    for contexts, chunks in GRID:
        cs = [max(int(c * scale), 1) for c in contexts]
        ks = [(max(int(x * scale), 1), int(p * scale)) for x, p in chunks]
        grid.append((cs, ks))
    return grid


def measure_grid(torch, full, layers: int, dtype, device: str, repeats: int, scale: float):
    """Time every grid shape on ``layers`` layers of ``full``'s shape.

    Returns ([(decode contexts, chunks, fastest seconds)], the per-pass overhead measured
    apart, {"model": the profile of exactly the layers built, "inter": MLP width,
    "measure_s": wall time}).
    """
    weights, inter = build_layers(torch, full, layers, dtype, device)
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer_params = sum(w.numel() for k, w in weights[0].items() if k not in ("n1", "n2"))
    built = replace(full, name=f"{full.name}-x{layers}", layers=layers,
                    params=float(per_layer_params * layers), bytes_per_weight=float(elem),
                    bytes_per_kv_element=float(elem), tensor_parallel=1)
    grid = scaled_grid(scale)
    max_ctx = max([max(c) + 1 if c else 0 for c, _ in grid] + [x + p for _, k in grid for x, p in k])
    max_n = max(len(c) for c, _ in grid) + 1  # the decodes' slots and one for a chunk
    caches = [{"k": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=device) * 0.1,
               "v": torch.randn(max_n, full.kv_heads, max_ctx, full.head_dim, dtype=dtype,
                                device=device) * 0.1} for _ in range(layers)]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    linear = linear_kernel(torch, device)
    t_start = time.perf_counter()
    times = [[] for _ in grid]
    with torch.inference_mode():
        inputs = [torch.randn(len(c) + sum(s for s, _ in k), full.hidden_size, dtype=dtype,
                              device=device) * 0.1 for c, k in grid]
        # Rounds over the whole grid (the first a warm-up), so that a slow spell of a
        # shared machine spreads over all shapes; each shape keeps its fastest time, as
        # interference only ever adds.
        for rnd in range(repeats + 1):
            for i, (contexts, chunks) in enumerate(grid):
                t0 = time.perf_counter()
                run_pass(torch, weights, full, contexts, chunks, caches, inputs[i], linear)
                sync()
                if rnd:
                    times[i].append(time.perf_counter() - t0)
            if rnd:
                print(f"  round {rnd}/{repeats}: {time.perf_counter() - t_start:.0f} s", flush=True)
        overhead = dispatch_overhead(torch, full, layers, dtype, device, linear, sync)
    rows = [(c, k, min(ts)) for (c, k), ts in zip(grid, times)]
    return rows, overhead, {"model": built, "inter": inter,
                            "measure_s": time.perf_counter() - t_start}
