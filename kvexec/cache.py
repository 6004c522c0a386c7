"""The KV cache object mlx-lm's models talk to, backed by a page store.

`update_and_fetch` writes the new keys and values into the store and hands back
placeholders; the attention call that follows reaches `attend` through the seam
(kvexec/seam.py), which runs the blockwise executor on the store.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvexec.attention import blockwise_attention
from kvexec.formats import get_format
from kvexec.store import KVConfig, PageStore


class PagedKVCache:
    def __init__(self, config: KVConfig | None = None, window: int | None = None):
        self.store = PageStore(config or KVConfig(), window)

    # -- mlx-lm cache protocol -------------------------------------------------
    @property
    def offset(self) -> int:
        return self.store.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.store.append(keys, values)
        return keys, values  # unused: the seam routes attention to `attend`

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # the executor knows positions and windows itself

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        store = self.store
        q_start = store.offset - queries.shape[-2]
        scoring = store.config.max_positions is not None and store.config.policy == "score"
        return blockwise_attention(queries, store.blocks(queries), q_start, scale, store.window, sinks,
                                   observe=store.observe if scoring else None,
                                   block_tokens=store.config.block_tokens)

    @property
    def state(self) -> list[mx.array]:
        return self.store.arrays()

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        return self.store.can_trim(n)

    def trim(self, n: int) -> int:
        return self.store.trim(n)

    def size(self) -> int:
        return self.store.offset

    def empty(self) -> bool:
        return self.store.offset == 0

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


def for_head_dim(config: KVConfig, head_dim: int) -> KVConfig:
    """`config`, or the same in fp16 where its format cannot store this head_dim."""
    if get_format(config.format).supports_head_dim(head_dim):
        return config
    return replace(config, format="fp16")


def make_cache(model: nn.Module, config: KVConfig | None = None) -> list:
    """The model's own cache list with every attention cache replaced by a paged one
    (sliding-window caches by windowed ones); recurrent-state caches stay as they are."""
    caches = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            caches.append(PagedKVCache(config, window=c.max_size))
        elif isinstance(c, KVCache):
            caches.append(PagedKVCache(config))
        else:
            caches.append(c)
    return caches


def pin(cache: list, positions: int) -> None:
    """Retention never evicts positions below `positions` (the prompt)."""
    for c in cache:
        if isinstance(c, PagedKVCache):
            c.store.pinned = max(c.store.pinned, positions)


def limit_pages(cache: list, per_layer: int | None) -> None:
    """Hold each growing layer's pages to `per_layer` bytes (None: no limit) by stepping
    cold pages down the pressure ladder; sliding-window layers are bounded rings."""
    for c in cache:
        if isinstance(c, PagedKVCache) and c.store.window is None:
            c.store.limit(per_layer)


def page_formats(cache: list) -> dict[str, int]:
    """Paged positions per format, summed over layers."""
    out: dict[str, int] = {}
    for c in cache:
        if isinstance(c, PagedKVCache):
            for name, n in c.store.formats().items():
                out[name] = out.get(name, 0) + n
    return out


def can_trim(cache: list, n: int) -> bool:
    return all(c.can_trim(n) if isinstance(c, PagedKVCache) else c.is_trimmable() for c in cache)


def trim(cache: list, n: int) -> bool:
    """Remove the last n positions from every layer, or from none (returns False)."""
    if not can_trim(cache, n):
        return False
    for c in cache:
        c.trim(n)
    return True
