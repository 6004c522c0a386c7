"""A long stored state without its prefill: random keys and values of the model's own
shape written into an engine's pages and stored for `tokens`, so a request that extends
`tokens` decodes at that context at once. Decode over them costs what it costs over
real ones (the same pages, formats and kernels); what it computes means nothing."""

from __future__ import annotations

import mlx.core as mx


def store_random_state(engine, tokens: list[int], chunk: int = 2048, seed: int = 0) -> None:
    """Fill a new cache with len(tokens) positions of random keys and values, layer by
    layer in `chunk`s, and store it as the state of `tokens`. With a KV folder
    (`EngineConfig.kv_disk`), every growing layer's full pages go to disk as they are
    written, so the state never needs its whole size in memory."""
    import kvexec
    from kvexec.disk_pages import PageFile

    _, kv_heads, head_dim = engine.kv_shape
    cache = engine.new_cache()
    if engine.config.kv_disk is not None:
        kvexec.spill_layers(cache, PageFile(engine.config.kv_disk, engine.config.kv_disk_cached), None, len(cache))
    key = mx.random.key(seed)
    dtype = mx.float32 if engine.policy.fp32 else mx.float16
    for layer in cache:
        for start in range(0, len(tokens), chunk):
            n = min(chunk, len(tokens) - start)
            key, k, v = mx.random.split(key, 3)
            layer.update_and_fetch(mx.random.normal((1, kv_heads, n, head_dim), key=k).astype(dtype),
                                   mx.random.normal((1, kv_heads, n, head_dim), key=v).astype(dtype))
            mx.eval(layer.state)
            if hasattr(layer, "store"):
                layer.store.spill()
    engine.states.put(list(tokens), cache)
