"""The transient of mlx-lm's prefill attention, measured: MLX's peak bytes of one
attention call (mlx-lm's own code path: `mx.fast.scaled_dot_product_attention` with
mask "causal", or its quantized-KV path) per (chunk x query heads x positions seen),
for the stock systems' dtypes and KV bits. The memory models of stock rows
(bench/memmodel.py) take their scores term from here instead of assuming one.

    python -m bench.attn_transient --model smollm2 --chunk 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time

CASES = (("float16", None), ("float32", None), ("float16", 8), ("float16", 4))


def attention_peak(heads: int, kv_heads: int, head_dim: int, chunk: int, seen: int, dtype: str,
                   kv_bits: int | None = None, group: int = 64) -> dict:
    """One prefill attention call as mlx-lm makes it: MLX's peak bytes beyond its
    inputs, and those bytes per (chunk x heads x seen) less the output's."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    dt = getattr(mx, dtype)
    q = mx.random.normal((1, heads, chunk, head_dim)).astype(dt)
    k, v = (mx.random.normal((1, kv_heads, seen, head_dim)).astype(dt) for _ in range(2))
    if kv_bits:
        k, v = mx.quantize(k, group, kv_bits), mx.quantize(v, group, kv_bits)
    mx.eval(q, k, v)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    start = time.perf_counter()
    if kv_bits:
        out = quantized_scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal",
                                                     group_size=group, bits=kv_bits)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal")
    mx.eval(out)
    peak = mx.get_peak_memory() - base
    return {"dtype": dtype, "kv_bits": kv_bits, "chunk": chunk, "seen": seen, "peak_bytes": int(peak),
            "bytes_per_chunk_head_position": round((peak - out.nbytes) / (chunk * heads * seen), 3),
            "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--seen", default="1024,2048", help="positions seen by the chunk, comma-separated")
    args = ap.parse_args(argv)
    from bench.common import machine_info, save
    from justfit.model.models import load
    from justfit.planning.cost_model import attention_shape

    loaded = load(args.model)
    heads, kv_heads, head_dim = attention_shape(loaded.model, loaded.config)
    del loaded
    rows = []
    for dtype, bits in CASES:
        for seen in (int(s) for s in args.seen.split(",")):
            rows.append(attention_peak(heads, kv_heads, head_dim, args.chunk, seen, dtype, bits))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"machine": machine_info(), "settings": {**vars(args), "heads": heads, "kv_heads": kv_heads,
                                                      "head_dim": head_dim}, "systems": rows}
    print(f"saved {save('attn-transient', result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
