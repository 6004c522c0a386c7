"""The one place KVExec meets mlx-lm's model code.

mlx-lm's attention layers all call their module's `scaled_dot_product_attention`
(imported from mlx_lm.models.base) right after `cache.update_and_fetch`. Installing
wraps that name in the model's module: calls whose cache is a PagedKVCache run the
blockwise executor on the page store; every other call goes to mlx-lm unchanged.
Some of mlx-lm's models (gemma2, olmo, plamo) compute attention inline instead: a
probe forward at install finds them and refuses them (`check`).
"""

from __future__ import annotations

import sys
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvexec.cache import KVPlaceholder, PagedKVCache, SeamBypassed, placeholders

_ATTR = "scaled_dot_product_attention"


def _wrap(original):
    if getattr(original, "_kvexec", False):
        return original

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, PagedKVCache):
            return cache.attend(queries, scale, sinks)
        if isinstance(keys, KVPlaceholder):  # a paged cache's keys, the cache not passed along
            raise SeamBypassed("an attention call got a paged cache's keys without the cache")
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)

    scaled_dot_product_attention._kvexec = True
    scaled_dot_product_attention._original = original
    return scaled_dot_product_attention


def install(model: nn.Module) -> None:
    """Route this model's attention through KVExec when its cache is paged; raise
    SeamBypassed for a model whose attention would not reach the executor. JustFit
    installs it through justfit.model.adapter, with its other changes to the model."""
    wrap(model)
    check(model)


def wrap(model: nn.Module) -> list[tuple[ModuleType, bool]]:
    """Wrap the attention function of each module `model`'s layers come from (once: a
    wrapped one stays as it is); those modules, each with whether this call wrapped it.
    Raise SeamBypassed where there is none."""
    modules = []
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        mod = sys.modules.get(name)
        if mod is not None and callable(getattr(mod, _ATTR, None)):
            modules.append((mod, not wrapped(mod)))
            setattr(mod, _ATTR, _wrap(getattr(mod, _ATTR)))
    if not modules:
        raise _refusal(model_type(model), "does not call mlx-lm's scaled_dot_product_attention")
    return modules


def wrapped(module: ModuleType) -> bool:
    """Whether `module`'s attention function is the seam's."""
    return getattr(getattr(module, _ATTR, None), "_kvexec", False)


def unwrap(module: ModuleType) -> None:
    """Give `module` back mlx-lm's own attention function (nothing where it is not wrapped)."""
    if wrapped(module):
        setattr(module, _ATTR, getattr(module, _ATTR)._original)


def model_type(model: nn.Module) -> str:
    """mlx-lm's name for the model's architecture (its module's, failing that)."""
    return getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


class _ProbeCache(PagedKVCache):
    """A paged cache that stores nothing and counts the executor calls reaching it."""

    def __init__(self):  # no page store: the probe builds the graph and evaluates nothing
        self.positions = 0
        self.attended = 0

    @property
    def offset(self) -> int:
        return self.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KVPlaceholder, KVPlaceholder]:
        self.positions += keys.shape[-2]
        return placeholders(keys, values, self.positions)

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        self.attended += 1
        return mx.zeros(queries.shape, queries.dtype)


def check(model: nn.Module) -> int:
    """Refuse, with SeamBypassed naming the model type, a model whose attention layers
    do not each reach the executor once per forward; return the layers checked. One
    probe forward of two tokens, then one (prefill and decode paths): graphs are
    built, never evaluated, so no weight is read."""
    caches = [_ProbeCache() if isinstance(c, (KVCache, RotatingKVCache)) else c for c in make_prompt_cache(model)]
    probes = [c for c in caches if isinstance(c, _ProbeCache)]
    name = model_type(model)
    tokens = mx.zeros((1, 2), mx.int32)
    try:
        for piece in (tokens, tokens[:, :1]):
            model(piece, cache=caches)
    except SeamBypassed as e:
        raise SeamBypassed(f"{name}: {e}") from e
    except TypeError as e:  # an MLX op given a placeholder: it names the type
        if KVPlaceholder.__name__ not in str(e):
            raise
        raise _refusal(name, "passes its cached keys and values to MLX itself") from e
    missed = sum(c.attended != 2 for c in probes)
    if missed:
        raise _refusal(name, f"leaves {missed} of its {len(probes)} attention layers' caches unread "
                             "by mlx-lm's scaled_dot_product_attention")
    return len(probes)


def _refusal(name: str, how: str) -> SeamBypassed:
    return SeamBypassed(f"{name}: its attention {how}, so KVExec's paged cache cannot serve it "
                        "(it would attend to the current chunk only); use mlx-lm's own KV cache for it (kv=None)")
