"""Stock mlx-lm as its users run it: the same quantized matrices, every floating
parameter in float16 (what `mlx_lm.convert --dtype float16` writes), so activations,
attention scores and the KV cache are float16; and mlx-lm's own settings per system.

JustFit's GGUF import keeps norms in float32, which would make every activation and
the whole KV cache of a "stock" run float32 (twice the bytes): the stock systems here
cast those parameters, never run float32.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StockSetup:
    prefill_step: int = 2048  # mlx-lm's generate_step default
    kv_bits: int | None = None
    kv_group_size: int = 64
    cache_limit: int | None = None  # mx.set_cache_limit; None: MLX's default
    dense: bool = False  # weights dequantized (speed only: JustFit's prefill form)
    dtype: str = "float16"  # what every floating parameter is cast to


# What a long-context mlx-lm user sets: small prefill steps, an 8-bit KV cache from the
# first token, and no buffer cache held back by MLX.
STOCK = {
    "mlx-lm": StockSetup(),
    "mlx-lm-tuned": StockSetup(prefill_step=512, kv_bits=8, cache_limit=0),
    "mlx-lm-kv4": StockSetup(prefill_step=512, kv_bits=4, cache_limit=0),
    # Speed only, not a baseline: JustFit's prefill weight form (dense float32, OpenBLAS)
    # in mlx-lm's own model code, to split JustFit's prefill gain into weight form vs the rest.
    "mlx-lm-dense": StockSetup(dense=True, dtype="float32"),
    # Not a baseline either: mlx-lm's defaults in float32, fast on this CPU, run only to
    # check the float16 rows' memory model (bench/memmodel.py) on a run that reaches its budget.
    "mlx-lm-fp32": StockSetup(dtype="float32"),
}


def cast_floating(model, dtype: str = "float16") -> None:
    """Every floating parameter of `model` to `dtype` (quantized uint32 matrices stay),
    as `mlx_lm.convert --dtype float16` does."""
    import mlx.core as mx
    from mlx.utils import tree_map

    to = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(to) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())


def dequantize(model) -> None:
    """Quantized layers back to dense ones (mlx-lm-dense: the weight form JustFit prefills with)."""
    import mlx.nn as nn

    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            dense = nn.Linear(1, 1, bias="bias" in module)
            dense.weight = _dense_weight(module)
            if "bias" in module:
                dense.bias = module.bias
            swaps.append((name, dense))
        elif isinstance(module, nn.QuantizedEmbedding):
            dense = nn.Embedding(1, 1)
            dense.weight = _dense_weight(module)
            swaps.append((name, dense))
    model.update_modules(_nested(swaps))


def _dense_weight(module):
    import mlx.core as mx

    return mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)


def _nested(pairs: list[tuple[str, object]]) -> dict:
    """{"a.b.0.c": m} as mlx's nested module tree ({"a": {"b": [{"c": m}]}})."""
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)


def weights_dtype(model) -> str:
    """The parameters' dtypes in words, e.g. "float16 (+ uint32 4-bit matrices)"."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    kinds = sorted({str(p.dtype).split(".")[-1] for _, p in tree_flatten(model.parameters())
                    if mx.issubdtype(p.dtype, mx.floating)})
    packed = any(p.dtype == mx.uint32 for _, p in tree_flatten(model.parameters()))
    return "+".join(kinds) + (" (+ uint32 quantized matrices)" if packed else "")


def kv_dtype(cache: list) -> str:
    """The dtype the cache holds its values in (a quantized cache: its scales') after a
    forward pass; "" before any."""
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is None:
            continue
        first = keys[1] if isinstance(keys, (tuple, list)) else keys  # quantized: (packed, scales, biases)
        return str(first.dtype).split(".")[-1]
    return ""


def quantize_what_mlx_lm_can(cache: list, bits: int = 4) -> str:
    """mlx-lm raises on `kv_bits` for sliding-window caches (RotatingKVCache:
    "Quantization NYI"), so on models that have them (Gemma 3) the quantized systems
    quantize every other cache, as mlx-lm's own `maybe_quantize_kv_cache` does, and
    leave those in float16 (they hold one window each). Returns a note saying so, or ""."""
    import importlib

    from mlx_lm.models.cache import RotatingKVCache

    generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is the function

    rotating = sum(isinstance(c, RotatingKVCache) for c in cache)
    if not rotating:
        return ""
    quantize = generate.maybe_quantize_kv_cache

    def skipping_rotating(prompt_cache, *args, **kwargs):
        keep = [i for i, c in enumerate(prompt_cache) if not isinstance(c, RotatingKVCache)]
        part = [prompt_cache[i] for i in keep]
        quantize(part, *args, **kwargs)
        for i, c in zip(keep, part):
            prompt_cache[i] = c

    generate.maybe_quantize_kv_cache = skipping_rotating  # read when generate_step starts
    return (f"kv{bits} on {len(cache) - rotating} of {len(cache)} layers; sliding-window layers float16 "
            "(mlx-lm: NYI)")


def load_stock(model: str, setup: StockSetup):
    """The model as a user of mlx-lm loads it: float16 parameters (dense, if asked)."""
    from justfit.model.models import load

    loaded = load(model)
    if setup.dense:
        dequantize(loaded.model)
    cast_floating(loaded.model, setup.dtype)
    return loaded


def make_stock(system: str, model: str):
    """(tokenizer, step(tokens, out) -> generated, details() -> dict) for a stock system:
    one growing conversation in one mlx-lm prompt cache, end-of-sequence suppressed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    setup = STOCK[system]
    if setup.cache_limit is not None:
        mx.set_cache_limit(setup.cache_limit)
    loaded = load_stock(model, setup)
    cache = make_prompt_cache(loaded.model)
    eos = list(loaded.tokenizer.eos_token_ids)
    note = ""
    if setup.kv_bits:
        note = quantize_what_mlx_lm_can(cache, setup.kv_bits)

    def no_eos(tokens, logits):
        return logits.at[..., eos].add(-1e9) if eos else logits

    def step(tokens: list[int], out: int) -> list[int]:
        kw = {"kv_bits": setup.kv_bits, "kv_group_size": setup.kv_group_size,
              "quantized_kv_start": 0} if setup.kv_bits else {}
        gen = generate_step(mx.array(tokens), loaded.model, prompt_cache=cache, max_tokens=out,
                            sampler=make_sampler(0.0), logits_processors=[no_eos],
                            prefill_step_size=setup.prefill_step, **kw)
        return [int(t) for t, _ in gen]

    facts = {"weights_dtype": weights_dtype(loaded.model), "kv_bits": setup.kv_bits,
             "prefill_step": setup.prefill_step, "cache_limit": setup.cache_limit}

    def details() -> dict:
        return {**facts, "kv_dtype": kv_dtype(cache), "kv_cache": sorted({type(c).__name__ for c in cache}),
                **({"note": note} if note else {})}

    return loaded, step, details
