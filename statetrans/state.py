"""Per-layer serving state as arrays + metadata: KVExec page stores in their
compressed form, and mlx-lm's own caches (full, rotating, recurrent) through their
`state` / `meta_state` protocol."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from kvexec import PagedKVCache
from kvexec.export import export_store, paged_cache_from_store, restore_store


def capture(cache: list) -> tuple[dict[str, mx.array], list[dict]]:
    """Arrays (keyed "layer{i}.NAME") and per-layer metadata of a cache list."""
    mx.eval([c.state for c in cache])  # nothing pending may be saved half-done
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(cache):
        if isinstance(c, PagedKVCache):
            a, meta = export_store(c.store)
            layers.append({"kind": "paged", **meta})
        else:  # mlx-lm's state: a tree of arrays and scalars, rebuilt by `from_state`
            flat = tree_flatten(c.state)
            a = {p: v for p, v in flat if isinstance(v, mx.array)}
            layers.append({"kind": "mlx-lm", "class": type(c).__name__, "paths": [p for p, _ in flat],
                           "scalars": {p: v for p, v in flat if not isinstance(v, mx.array)}})
        arrays.update({f"layer{i}.{k}": v for k, v in a.items()})
    return arrays, layers


def rebuild(arrays: dict[str, mx.array], layers: list[dict]) -> list:
    """The cache list `capture` described."""
    cache = []
    for i, meta in enumerate(layers):
        mine = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(f"layer{i}.")}
        if meta["kind"] == "paged":
            cache.append(paged_cache_from_store(restore_store(mine, meta)))
            continue
        cls = getattr(mlx_cache, meta["class"], None)
        if cls is None:
            raise ValueError(f"unknown cache class {meta['class']!r} in snapshot")
        items = [(p, mine[p] if p in mine else meta["scalars"][p]) for p in meta["paths"]]
        cache.append(cls.from_state(tree_unflatten(items)))
    return cache


def holds(cache: list, positions: int) -> bool:
    """Whether every layer of `cache` holds exactly `positions` (recurrent state,
    which has no offset, always agrees)."""
    return all(getattr(c, "offset", positions) == positions for c in cache)


def state_bytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())
