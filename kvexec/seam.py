"""The one place KVExec meets mlx-lm's model code.

mlx-lm's attention layers all call their module's `scaled_dot_product_attention`
(imported from mlx_lm.models.base) right after `cache.update_and_fetch`. Installing
wraps that name in the model's module: calls whose cache is a PagedKVCache run the
blockwise executor on the page store; every other call goes to mlx-lm unchanged.
"""

from __future__ import annotations

import sys

import mlx.nn as nn

from kvexec.cache import PagedKVCache

_ATTR = "scaled_dot_product_attention"


def _wrap(original):
    if getattr(original, "_kvexec", False):
        return original

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, PagedKVCache):
            return cache.attend(queries, scale, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)

    scaled_dot_product_attention._kvexec = True
    scaled_dot_product_attention._original = original
    return scaled_dot_product_attention


def install(model: nn.Module) -> None:
    """Route this model's attention through KVExec when its cache is paged."""
    modules = {type(m).__module__ for _, m in model.named_modules()}
    patched = 0
    for name in modules:
        mod = sys.modules.get(name)
        if mod is not None and callable(getattr(mod, _ATTR, None)):
            setattr(mod, _ATTR, _wrap(getattr(mod, _ATTR)))
            patched += 1
    if not patched:
        raise ValueError(f"{type(model).__name__}: no attention call that KVExec can serve")
