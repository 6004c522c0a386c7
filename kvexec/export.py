"""KVExec's export/import API: a cache layer as plain arrays and JSON-able metadata,
and back (`export_layer` / `import_layer`), and trimming a stored cache list back to a
shared prefix (`can_trim` / `trim`). What StateTrans uses; pages stay in their
compressed form, nothing is re-encoded."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, fields

import mlx.core as mx

from kvexec.cache import PagedKVCache, can_trim, trim
from kvexec.disk_pages import SpilledPart, joined, read_now, spilled_parts
from kvexec.exact import ExactPoint
from kvexec.formats import get_format
from kvexec.config import KVConfig
from kvexec.segments import Segment
from kvexec.store import PageStore

KIND = "paged"
__all__ = ["KIND", "can_trim", "check_layer", "copy_layer", "export_layer", "import_layer", "trim"]

Shapes = dict[str, tuple[str, tuple[int, ...]]]  # array name -> (dtype name, shape)
_LIMIT = 2**31  # positions, sizes and counts are below this
_TEXT = 1 << 16  # characters of a format name
_FULL = ("float16", "bfloat16", "float32")  # what sinks and the hot window are kept in
_META = {"kind", "config", "window", "offset", "pinned", "evicted", "segments"}
_SEGMENT = {"start", "capacity", "length", "score", "keys", "values", "format"}
_INTS = ("page_size", "hot_window", "full_bits", "sink_tokens", "block_tokens")
_OPTIONAL_INTS = ("max_positions", "select_pages")
_NUMBERS = ("fidelity_floor", "calibration_tolerance")


def export_layer(layer, lazy: bool = False) -> tuple[dict[str, mx.array], dict] | None:
    """A paged cache layer's arrays and metadata ({"kind": "paged", ...}); None for a
    layer KVExec does not own (mlx-lm's caches). With `lazy`, the parts of pages on disk
    are `SpilledPart`s, read as they are written (not all at once)."""
    if not isinstance(layer, PagedKVCache):
        return None
    arrays, meta = export_store(layer.store, lazy)
    return arrays, {"kind": KIND, **meta}


def import_layer(arrays: dict[str, mx.array], meta: dict) -> PagedKVCache:
    """The paged cache layer `export_layer` described; ValueError (nothing built) when
    the metadata and arrays are not one `export_layer` could have written."""
    check_layer(meta, {k: (str(v.dtype).rpartition(".")[2], tuple(v.shape)) for k, v in arrays.items()})
    return paged_cache_from_store(restore_store(arrays, meta))


def check_layer(meta: dict, shapes: Shapes) -> None:
    """Raise ValueError unless `meta` and the arrays' dtypes and shapes (`shapes`, by
    the names export_store gives them; from a safetensors header, before anything is
    read) describe a page store export_store could have written: a sound KVConfig, known
    formats, positions that add up, and every array exactly as the store allocates it,
    none missing and none extra. Nothing is allocated."""
    if not isinstance(meta, dict) or not _META <= set(meta) <= _META | {"rng", "exact"} or meta["kind"] != KIND:
        raise ValueError("a paged layer's metadata is malformed")
    config = _config(meta["config"])
    P = config.page_size
    window, offset, evicted = meta["window"], meta["offset"], meta["evicted"]
    if window is not None:
        _int(window, "window", 1)
    for name in ("offset", "pinned", "evicted"):
        _int(meta[name], name)
    if evicted > offset:
        raise ValueError("more positions evicted than written")
    if "rng" in meta:
        _rng(meta["rng"])
    segments = meta["segments"]
    if not isinstance(segments, (list, tuple)) or len(segments) > offset // P + 1:
        raise ValueError("'segments' must list at most one segment per page written")
    expected: set[str] = set()
    full = _full(shapes, expected)
    sinks = full.get("sink_k", (0, 0, 0, 0))[2]
    hot = full.get("hot_k", (0, 0, 0, 0))[2]
    if sinks > (0 if window else config.sink_tokens):
        raise ValueError(f"{sinks} sink positions, the layer keeps {0 if window else config.sink_tokens}")
    if segments and "hot_k" not in full:
        raise ValueError("pages without a hot window")
    ref = full.get("hot_k") or full.get("sink_k") or (0, 0, 0, 0)
    lead, D = ref[:2], ref[3]
    end = sinks
    for i, s in enumerate(segments):
        end = _segment(i, s, P, end, lead, D, shapes, expected)
    if end > offset - hot:
        raise ValueError("the pages reach past the hot window")
    retained = sinks + sum(s["length"] for s in segments) + hot
    if retained + evicted > offset or (window is None and retained + evicted != offset):
        raise ValueError(f"{retained} positions held and {evicted} evicted do not add up to {offset}")
    if "exact" in meta:
        _exact(meta["exact"], offset, lead, D, shapes, expected)
    if set(shapes) != expected:
        extra, missing = sorted(set(shapes) - expected), sorted(expected - set(shapes))
        raise ValueError(f"arrays {(extra or missing)[:3]} {'unexpected' if extra else 'missing'}")


def _int(value, what: str, lo: int = 0) -> None:
    if type(value) is not int or not lo <= value < _LIMIT:
        raise ValueError(f"'{what}' must be an integer in [{lo}, {_LIMIT})")


def _names(value, what: str) -> None:
    if not isinstance(value, (list, tuple)) or len(value) > 256 or \
            not all(isinstance(n, str) and len(n) <= _TEXT for n in value):
        raise ValueError(f"'{what}' must be a list of names")


def _config(c) -> KVConfig:
    """The KVConfig a layer's metadata holds, every field checked for type and range."""
    names = {f.name for f in fields(KVConfig)}
    if not isinstance(c, dict) or set(c) != names:
        raise ValueError("a paged layer's config is malformed")
    for name in _INTS:
        _int(c[name], f"config.{name}")
    for name in _OPTIONAL_INTS:
        if c[name] is not None:
            _int(c[name], f"config.{name}")
    for name in ("format", "policy", "past_floor"):
        if not isinstance(c[name], str) or len(c[name]) > _TEXT:
            raise ValueError(f"'config.{name}' must be text")
    for name in _NUMBERS:
        if c[name] is not None and (type(c[name]) not in (int, float) or not math.isfinite(c[name])):
            raise ValueError(f"'config.{name}' must be a number")
    if type(c["pin_prompt"]) is not bool:
        raise ValueError("'config.pin_prompt' must be true or false")
    _names(c["pressure"], "config.pressure")
    _names(c["layer_formats"], "config.layer_formats")
    top1 = c["measured_top1"]
    if not isinstance(top1, (list, tuple)) or len(top1) > 256 or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and len(p[0]) <= _TEXT
            and type(p[1]) in (int, float) and math.isfinite(p[1]) for p in top1):
        raise ValueError("'config.measured_top1' must list (format, top-1) pairs")
    try:
        config = KVConfig(**c)
        get_format(config.format)  # a store's own format is a resolved one
    except (TypeError, ValueError) as e:
        raise ValueError(f"a paged layer's config: {e}") from None
    return config


def _rng(rng) -> None:
    """Random eviction's generator state, as random.getstate gives it."""
    if not isinstance(rng, (list, tuple)) or len(rng) != 3 or type(rng[0]) is not int \
            or not isinstance(rng[1], (list, tuple)) \
            or len(rng[1]) != 625 or not all(type(x) is int and 0 <= x <= 2**32 for x in rng[1]) \
            or not (rng[2] is None or (type(rng[2]) in (int, float) and math.isfinite(rng[2]))):
        raise ValueError("'rng' is not a random generator's state")
    try:
        random.Random().setstate((rng[0], tuple(rng[1]), rng[2]))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"'rng': {e}") from None


def _full(shapes: Shapes, expected: set[str]) -> dict[str, tuple[int, ...]]:
    """The full-precision arrays (sinks, hot window): keys and values of one dtype and
    shape [B, kv_heads, positions, head_dim], all with the same B, kv_heads and head_dim."""
    out, dtypes = {}, set()
    for k, v in (("sink_k", "sink_v"), ("hot_k", "hot_v")):
        if (k in shapes) != (v in shapes):
            raise ValueError(f"{k} and {v} come in pairs")
        if k not in shapes:
            continue
        (dk, sk), (dv, sv) = shapes[k], shapes[v]
        if dk not in _FULL or dk != dv or len(sk) != 4 or sk != sv:
            raise ValueError(f"{k} and {v} must be float arrays of one shape [B, heads, positions, head_dim]")
        out[k] = sk
        dtypes.add(dk)
        expected.update((k, v))
    if len(dtypes) > 1 or len({(s[0], s[1], s[3]) for s in out.values()}) > 1:
        raise ValueError("the sinks and the hot window disagree on dtype or layout")
    return out


def _exact(exact, offset: int, lead: tuple[int, ...], D: int, shapes: Shapes, expected: set[str]) -> None:
    """An exact trim point (kvexec.exact): its position, and its copies' first position
    and arrays, [B, kv_heads, positions, head_dim] below the point, or none."""
    if not isinstance(exact, dict) or set(exact) != {"at", "start"}:
        raise ValueError("'exact' is malformed")
    _int(exact["at"], "exact.at")
    if exact["at"] < offset and exact["start"] is None:
        pass  # a point trimmed past keeps nothing
    full = {k: shapes[k] for k in ("exact_k", "exact_v") if k in shapes}
    if exact["start"] is None:
        if full:
            raise ValueError("an exact trim point's copies without their position")
        return
    _int(exact["start"], "exact.start")
    if set(full) != {"exact_k", "exact_v"}:
        raise ValueError("an exact trim point's copies come as exact_k and exact_v")
    (dk, sk), (dv, sv) = full["exact_k"], full["exact_v"]
    if dk not in _FULL or dk != dv or sk != sv or len(sk) != 4 or (sk[0], sk[1], sk[3]) != (*lead, D) \
            or exact["start"] + sk[2] > exact["at"]:
        raise ValueError("an exact trim point's copies must be float arrays like the hot window's, below the point")
    expected.update(full)


def _segment(i: int, s, P: int, end: int, lead: tuple[int, ...], D: int, shapes: Shapes,
             expected: set[str]) -> int:
    """Check segment `i` (after positions up to `end`) and its arrays; the position it ends at."""
    if not isinstance(s, dict) or set(s) != _SEGMENT:
        raise ValueError(f"segment {i} is malformed")
    for name in ("start", "length"):
        _int(s[name], f"segments[{i}].{name}")
    _int(s["capacity"], f"segments[{i}].capacity")
    if s["length"] > s["capacity"] or s["length"] % P or s["start"] < end:
        raise ValueError(f"segment {i} overlaps its neighbours or holds part of a page")
    if type(s["score"]) not in (int, float) or not math.isfinite(s["score"]):
        raise ValueError(f"segment {i}'s score must be a number")
    if not isinstance(s["format"], str) or len(s["format"]) > _TEXT:
        raise ValueError(f"segment {i}'s format must be a name")
    fmt = get_format(s["format"])  # ValueError for an unknown one
    for side, codec, parts in (("k", fmt.keys, s["keys"]), ("v", fmt.values, s["values"])):
        _names(parts, f"segments[{i}].{'keys' if side == 'k' else 'values'}")
        try:  # lazily: only the shapes are computed, nothing is allocated
            want = codec.allocate(lead, s["capacity"], D)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"segment {i}: {e}") from None
        if list(parts) != sorted(want):
            raise ValueError(f"segment {i} names parts {parts[:4]}, format {fmt.label} stores {sorted(want)}")
        for part, a in want.items():
            name = f"seg{i}.{side}.{part}"
            if shapes.get(name) != (str(a.dtype).rpartition(".")[2], tuple(a.shape)):
                raise ValueError(f"{name}: {shapes.get(name)}, the layer's layout stores {tuple(a.shape)}")
            expected.add(name)
    bounds = [b for b in ("key_min", "key_max") if f"seg{i}.{b}" in shapes]
    if bounds and (len(bounds) != 2 or any(shapes[f"seg{i}.{b}"][0] not in _FULL
                                            or shapes[f"seg{i}.{b}"][1] != (*lead, D) for b in bounds)):
        raise ValueError(f"segment {i}'s key bounds must be two float arrays [B, heads, head_dim]")
    expected.update(f"seg{i}.{b}" for b in bounds)
    return s["start"] + s["length"]


def export_store(store: PageStore, lazy: bool = False) -> tuple[dict[str, mx.array], dict]:
    """A page store's arrays and JSON-able metadata: layout, positions, segments, eviction
    state (`lazy`: see export_layer)."""
    arrays: dict[str, mx.array] = {}
    for name in ("sink_k", "sink_v", "hot_k", "hot_v"):
        a = getattr(store, name)
        if a is not None:
            arrays[name] = a
    segments = []
    for i, seg in enumerate(store.segments):
        keys, values = (seg.keys, seg.values) if seg.extent is None else \
            spilled_parts(seg.extent) if lazy else read_now(seg.extent)
        for side, parts in (("k", keys), ("v", values)):
            for part, a in parts.items():
                arrays[f"seg{i}.{side}.{part}"] = a
        for bound in ("key_min", "key_max"):
            if getattr(seg, bound) is not None:
                arrays[f"seg{i}.{bound}"] = getattr(seg, bound)
        segments.append({"start": seg.start, "capacity": seg.capacity, "length": seg.length,
                         "score": seg.score, "keys": sorted(keys), "values": sorted(values),
                         "format": seg.fmt.name})
    meta = {"config": asdict(store.config), "window": store.window, "offset": store.offset,
            "pinned": store.pinned, "evicted": store.evicted, "segments": segments}
    if store.exact is not None:  # a trim back to it stays exact in every copy of the state
        keys, values = store.exact.arrays()
        meta["exact"] = {"at": store.exact.at, "start": store.exact.start}
        if keys is not None:
            arrays["exact_k"], arrays["exact_v"] = keys, values
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
        keys = {p: arrays[f"seg{i}.k.{p}"] for p in s["keys"]}
        values = {p: arrays[f"seg{i}.v.{p}"] for p in s["values"]}
        # Pages a snapshot links stay on disk where they lie whole; parts that do not are read.
        on_disk = all(isinstance(a, SpilledPart) for a in (*keys.values(), *values.values()))
        extent = joined(keys, values) if on_disk else None
        if extent is not None:
            keys, values = {}, {}
        else:
            keys, values = ({p: a.read() if isinstance(a, SpilledPart) else a for p, a in side.items()}
                            for side in (keys, values))
        seg = Segment(s["start"], s["capacity"], keys, values, get_format(s["format"]), s["length"], s["score"],
                      arrays.get(f"seg{i}.key_min"), arrays.get(f"seg{i}.key_max"), extent)
        store.segments.append(seg)
    store.offset, store.pinned, store.evicted = meta["offset"], meta["pinned"], meta["evicted"]
    if "exact" in meta:
        exact = meta["exact"]
        store.exact = ExactPoint(exact["at"], exact["start"])
        if exact["start"] is not None:
            store.exact.keys, store.exact.values = [arrays["exact_k"]], [arrays["exact_v"]]
            store.exact.held = arrays["exact_k"].shape[-2]
    if "rng" in meta:
        version, internal, gauss = meta["rng"]
        store.retention.rng.setstate((version, tuple(internal), gauss))
    return store


def copy_layer(layer) -> PagedKVCache | None:
    """An independent copy of a paged cache layer (None for a layer KVExec does not own):
    what it holds in memory copied, evaluated; its pages on disk shared, as extents are
    written once and never change (a copy that trims one reads it back first)."""
    if not isinstance(layer, PagedKVCache):
        return None
    store = layer.store
    new = PageStore(store.config, store.window)
    for name in ("sink_k", "sink_v", "hot_k", "hot_v"):
        a = getattr(store, name)
        setattr(new, name, None if a is None else mx.array(a))
    for seg in store.segments:
        new.segments.append(Segment(seg.start, seg.capacity, {p: mx.array(a) for p, a in seg.keys.items()},
                                    {p: mx.array(a) for p, a in seg.values.items()}, seg.fmt, seg.length, seg.score,
                                    seg.key_min, seg.key_max, seg.extent))
    new.offset, new.pinned, new.evicted = store.offset, store.pinned, store.evicted
    new.page_file = store.page_file  # later spills go on beside the shared ones
    new.retention.rng.setstate(store.retention.rng.getstate())
    new.exact = None if store.exact is None else store.exact.copy()
    mx.eval(new.arrays())
    return paged_cache_from_store(new)


def paged_cache_from_store(store: PageStore) -> PagedKVCache:
    """A paged cache layer over `store`, as it is."""
    cache = PagedKVCache.__new__(PagedKVCache)
    cache.store = store
    return cache
