"""KVExec's export/import API: a cache layer as plain arrays and JSON-able metadata,
and back (`export_layer` / `import_layer`), and trimming a stored cache list back to a
shared prefix (`can_trim` / `trim`). What StateTrans uses; pages stay in their
compressed form, nothing is re-encoded."""

from __future__ import annotations

from dataclasses import asdict

import mlx.core as mx

from kvexec.cache import PagedKVCache, can_trim, trim
from kvexec.formats import get_format
from kvexec.config import KVConfig
from kvexec.segments import Segment
from kvexec.store import PageStore

KIND = "paged"
__all__ = ["KIND", "can_trim", "export_layer", "import_layer", "trim"]


def export_layer(layer) -> tuple[dict[str, mx.array], dict] | None:
    """A paged cache layer's arrays and metadata ({"kind": "paged", ...}); None for a
    layer KVExec does not own (mlx-lm's caches)."""
    if not isinstance(layer, PagedKVCache):
        return None
    arrays, meta = export_store(layer.store)
    return arrays, {"kind": KIND, **meta}


def import_layer(arrays: dict[str, mx.array], meta: dict) -> PagedKVCache:
    """The paged cache layer `export_layer` described."""
    return paged_cache_from_store(restore_store(arrays, meta))


def export_store(store: PageStore) -> tuple[dict[str, mx.array], dict]:
    """A page store's arrays and JSON-able metadata: layout, positions, segments, eviction state."""
    arrays: dict[str, mx.array] = {}
    for name in ("sink_k", "sink_v", "hot_k", "hot_v"):
        a = getattr(store, name)
        if a is not None:
            arrays[name] = a
    segments = []
    for i, seg in enumerate(store.segments):
        for side, parts in (("k", seg.keys), ("v", seg.values)):
            for part, a in parts.items():
                arrays[f"seg{i}.{side}.{part}"] = a
        for bound in ("key_min", "key_max"):
            if getattr(seg, bound) is not None:
                arrays[f"seg{i}.{bound}"] = getattr(seg, bound)
        segments.append({"start": seg.start, "capacity": seg.capacity, "length": seg.length,
                         "score": seg.score, "keys": sorted(seg.keys), "values": sorted(seg.values),
                         "format": seg.fmt.name})
    meta = {"config": asdict(store.config), "window": store.window, "offset": store.offset,
            "pinned": store.pinned, "evicted": store.evicted, "segments": segments}
    if store.config.max_positions is not None and store.config.policy == "random":
        version, internal, gauss = store.retention.rng.getstate()  # random eviction continues its sequence
        meta["rng"] = [version, list(internal), gauss]
    return arrays, meta


def restore_store(arrays: dict[str, mx.array], meta: dict) -> PageStore:
    """The page store `export_store` described."""
    store = PageStore(KVConfig(**meta["config"]), meta["window"])
    for name in ("sink_k", "sink_v", "hot_k", "hot_v"):
        setattr(store, name, arrays.get(name))
    for i, s in enumerate(meta["segments"]):
        seg = Segment(s["start"], s["capacity"], {p: arrays[f"seg{i}.k.{p}"] for p in s["keys"]},
                      {p: arrays[f"seg{i}.v.{p}"] for p in s["values"]}, get_format(s["format"]), s["length"], s["score"],
                      arrays.get(f"seg{i}.key_min"), arrays.get(f"seg{i}.key_max"))
        store.segments.append(seg)
    store.offset, store.pinned, store.evicted = meta["offset"], meta["pinned"], meta["evicted"]
    if "rng" in meta:
        version, internal, gauss = meta["rng"]
        store.retention.rng.setstate((version, tuple(internal), gauss))
    return store


def paged_cache_from_store(store: PageStore) -> PagedKVCache:
    """A paged cache layer over `store`, as it is."""
    cache = PagedKVCache.__new__(PagedKVCache)
    cache.store = store
    return cache
