"""Per-layer serving state as arrays + metadata: KVExec page stores in their
compressed form (through kvexec's export API), and mlx-lm's own caches (full,
rotating, recurrent) through their `state` / `meta_state` protocol."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from kvexec.export import KIND as PAGED, export_layer, import_layer


def capture(cache: list) -> tuple[dict[str, mx.array], list[dict]]:
    """Arrays (keyed "layer{i}.NAME") and per-layer metadata of a cache list."""
    mx.eval([c.state for c in cache])  # nothing pending may be saved half-done
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(cache):
        paged = export_layer(c)
        if paged is not None:
            a, meta = paged
            layers.append(meta)
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
        if meta["kind"] == PAGED:
            cache.append(import_layer(mine, meta))
            continue
        cls = getattr(mlx_cache, meta["class"], None)
        if cls is None:
            raise ValueError(f"unknown cache class {meta['class']!r} in snapshot")
        items = [(p, mine[p] if p in mine else meta["scalars"][p]) for p in meta["paths"]]
        cache.append(cls.from_state(tree_unflatten(items)))
    return cache


def copy_arrays(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Independent copies, evaluated: the KV store writes its pages in place."""
    out = {k: mx.array(v) for k, v in arrays.items()}
    mx.eval(list(out.values()))
    return out


def copy_cache(cache: list) -> list:
    """An independent copy of a cache list."""
    arrays, layers = capture(cache)
    return rebuild(copy_arrays(arrays), layers)


def holds(cache: list, positions: int) -> bool:
    """Whether every layer of `cache` holds exactly `positions` (recurrent state,
    which has no offset, always agrees)."""
    return all(getattr(c, "offset", positions) == positions for c in cache)


def state_bytes(arrays: dict[str, mx.array]) -> int:
    """Bytes the arrays hold."""
    return sum(a.nbytes for a in arrays.values())


def trimmable_meta(layer: dict) -> bool:
    """Whether a saved layer can drop trailing positions (not recurrent state)."""
    return layer.get("kind") == PAGED or layer.get("class") in ("KVCache", "QuantizedKVCache")
