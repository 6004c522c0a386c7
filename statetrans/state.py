"""Per-layer serving state as arrays + metadata: KVExec page stores in their
compressed form (through kvexec's export API), and mlx-lm's own caches (full,
rotating, recurrent) through their `state` / `meta_state` protocol.

Rebuilding checks first (`check_layers`, which needs only the arrays' dtypes and
shapes, so a reader can call it on a safetensors header before loading): each layer's
kind and class among those this module writes, an mlx-lm state tree of a few short
paths (nothing else reaches `tree_unflatten`), scalars that are plain JSON numbers,
every array accounted for and shaped as its cache holds it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from kvexec.export import KIND as PAGED, Shapes, check_layer, copy_layer, export_layer, import_layer

MLX_LM = "mlx-lm"
MAX_LAYERS = 4096
MAX_PATHS = 16  # paths of one mlx-lm state tree (the largest written: a quantized cache's 9)
MAX_INDEX = 15  # a list index in a path
MAX_COMPONENTS = 4  # components of a path ("0.1" has two)
_COMPONENT = re.compile(r"0|[1-9][0-9]?|[A-Za-z_][A-Za-z0-9_]{0,31}", re.ASCII)
_ARRAY = re.compile(r"layer(0|[1-9][0-9]{0,3})\.(.{1,256})", re.S)
_FLOATS = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class _Form:
    """The state an mlx-lm cache class saves: how many items, which are integers
    (offsets, sizes), which hold keys and values, and which is the offset."""

    items: int
    ints: tuple[int, ...] = ()
    kv: tuple[int, ...] = ()
    offset: int | None = None


# The classes a snapshot may name (rebuilt through `from_state`), and their state's form.
FORMS = {"KVCache": _Form(3, (2,), (0, 1), 2), "RotatingKVCache": _Form(6, (2, 3, 4, 5), (0, 1), 2),
         "QuantizedKVCache": _Form(5, (2, 3, 4), (0, 1), 2), "ChunkedKVCache": _Form(5, (2, 3, 4), (0, 1), 2),
         "ArraysCache": _Form(3)}


def capture(cache: list, lazy: bool = False) -> tuple[dict[str, mx.array], list[dict]]:
    """Arrays (keyed "layer{i}.NAME") and per-layer metadata of a cache list; with `lazy`,
    KV pages on disk as parts read when written (kvexec.disk_pages.SpilledPart: only
    the snapshot writer takes them)."""
    mx.eval([c.state for c in cache])  # nothing pending may be saved half-done
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(cache):
        paged = export_layer(c, lazy)
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
    """The cache list `capture` described; ValueError (nothing built) when `layers` and
    the arrays are not what `capture` writes (see check_layers)."""
    check_layers(layers, {k: (str(v.dtype).rpartition(".")[2], tuple(v.shape)) for k, v in arrays.items()})
    cache = []
    for i, meta in enumerate(layers):
        mine = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(f"layer{i}.")}
        if meta["kind"] == PAGED:
            cache.append(import_layer(mine, meta))
            continue
        cls = getattr(mlx_cache, meta["class"])  # one of FORMS
        items = [(p, mine[p] if p in mine else meta["scalars"][p]) for p in meta["paths"]]
        cache.append(cls.from_state(tree_unflatten(items)))
    return cache


def check_layers(layers, shapes: Shapes, count: int | None = None) -> None:
    """Raise ValueError unless `layers` (a manifest's per-layer metadata, `count` of
    them where known) and the arrays' dtypes and shapes (by name, as a safetensors
    header gives them) are what `capture` writes: every layer of a known kind, every
    array some layer's, each layer consistent with its arrays. Nothing is allocated."""
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise ValueError("'layers' must be a list")
    if count is not None and len(layers) != count:
        raise ValueError(f"{len(layers)} layers, this model has {count}")
    by_layer: dict[int, Shapes] = {}
    for name, value in shapes.items():
        m = _ARRAY.fullmatch(name)
        if m is None or int(m[1]) >= len(layers):
            raise ValueError(f"array {name[:60]!r} belongs to no layer")
        by_layer.setdefault(int(m[1]), {})[m[2]] = value
    for i, meta in enumerate(layers):
        try:
            if not isinstance(meta, dict) or meta.get("kind") not in (PAGED, MLX_LM):
                raise ValueError("a layer's kind must be paged or mlx-lm")
            (check_layer if meta["kind"] == PAGED else _check_mlx)(meta, by_layer.get(i, {}))
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None


def saved_offset(meta: dict) -> int | None:
    """The positions a checked layer's metadata says it holds (None: recurrent state, no offset)."""
    if meta["kind"] == PAGED:
        return meta["offset"]
    form = FORMS[meta["class"]]
    return None if form.offset is None else meta["scalars"][str(form.offset)]


def _check_mlx(meta: dict, shapes: Shapes) -> None:
    """An mlx-lm layer: a known class, a state tree of few short paths, and arrays
    (or None) and scalars where its class keeps them."""
    if set(meta) != {"kind", "class", "paths", "scalars"} or meta["class"] not in FORMS:
        raise ValueError(f"unknown cache class {str(meta.get('class'))[:40]!r}")
    form = FORMS[meta["class"]]
    paths, scalars = meta["paths"], meta["scalars"]
    if not isinstance(paths, list) or not 0 < len(paths) <= MAX_PATHS or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"'paths' must list 1 to {MAX_PATHS} paths")
    if not isinstance(scalars, dict) or not set(scalars) <= set(paths) or set(scalars) & set(shapes):
        raise ValueError("'scalars' must name paths that hold no array")
    if set(shapes) | set(scalars) != set(paths) or len(set(paths)) != len(paths):
        raise ValueError("every path must hold exactly one array or scalar")
    for value in scalars.values():
        if not (value is None or type(value) is bool or (type(value) is int and abs(value) < 2**53)
                or (type(value) is float and math.isfinite(value))):
            raise ValueError("a scalar must be null, a boolean or a bounded number")
    root = _tree(paths)
    if not isinstance(root, list) or len(root) != form.items:
        raise ValueError(f"{meta['class']} saves {form.items} items")
    for i in form.ints:
        value = scalars.get(str(i), "") if root[i] is None else ""
        if type(value) is not int or not 0 <= value < 2**31:
            raise ValueError(f"item {i} of {meta['class']} must be a non-negative integer")
    kv = [_kv_shape(root[i], str(i), shapes, meta["class"] == "QuantizedKVCache", scalars) for i in form.kv]
    if kv and (kv[0] is None) != (kv[1] is None) or (kv and kv[0] and kv[0][:3] != kv[1][:3]):
        raise ValueError("keys and values must both be held, in the same layout")
    n = kv[0][2] if kv and kv[0] else 0
    ints = {i: scalars[str(i)] for i in form.ints}
    if meta["class"] in ("KVCache", "QuantizedKVCache") and ints[2] > n:
        raise ValueError(f"an offset of {ints[2]} in room for {n} positions")
    if meta["class"] == "RotatingKVCache" and (ints[5] > n or ints[3] > ints[4]):
        raise ValueError("a rotating cache's ring index or kept positions are out of range")
    if meta["class"] == "ChunkedKVCache" and not 0 <= ints[2] - ints[4] <= n:
        raise ValueError("a chunked cache's offset is out of its room")


def _tree(paths: list[str]):
    """The skeleton tree_unflatten would build from `paths` (leaves None), refusing
    anything but short dotted paths of names and small indices, lists with every index
    from 0, and no path inside another's leaf."""
    top: dict = {}
    for path in paths:
        parts = path.split(".")
        if len(parts) > MAX_COMPONENTS or not all(_COMPONENT.fullmatch(p) for p in parts):
            raise ValueError(f"path {path[:40]!r} is not a short dotted path")
        node = top
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if node is None:
                raise ValueError(f"path {path!r} runs through a leaf")
        if parts[-1] in node:
            raise ValueError(f"path {path!r} is given twice or holds a subtree")
        node[parts[-1]] = None
    return _shape_tree(top)


def _shape_tree(node):
    if node is None:
        return None
    keys = list(node)
    if all(k.isdigit() for k in keys):
        if sorted(int(k) for k in keys) != list(range(len(keys))) or len(keys) > MAX_INDEX + 1:
            raise ValueError("a list in a state tree must hold every index from 0")
        return [_shape_tree(node[str(i)]) for i in range(len(keys))]
    if any(k.isdigit() for k in keys):
        raise ValueError("a state tree node mixes indices and names")
    return {k: _shape_tree(v) for k, v in node.items()}


def _kv_shape(node, path: str, shapes: Shapes, quantized: bool, scalars: dict) -> tuple[int, ...] | None:
    """The shape of the keys (or values) at `path`: a float array [B, heads, positions,
    dim], or a quantized cache's (packed, scales, biases); None when not held yet."""
    if node is None and path in scalars:
        if scalars[path] is not None:
            raise ValueError(f"item {path} must hold an array or null")
        return None
    if not quantized:
        if node is not None or path not in shapes or shapes[path][0] not in _FLOATS or len(shapes[path][1]) != 4:
            raise ValueError(f"item {path} must be a float array [B, heads, positions, dim]")
        return shapes[path][1]
    if not isinstance(node, list) or len(node) != 3 or any(c is not None for c in node):
        raise ValueError(f"item {path} must hold a quantized triple")
    parts = [shapes.get(f"{path}.{j}") for j in range(3)]
    if any(p is None or len(p[1]) != 4 for p in parts) or parts[0][0] != "uint32" \
            or len({p[1][:3] for p in parts}) != 1:
        raise ValueError(f"item {path} must hold packed keys with their scales and biases")
    return parts[0][1]


def copy_arrays(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Independent copies, evaluated: the KV store writes its pages in place."""
    out = {k: mx.array(v) for k, v in arrays.items()}
    mx.eval(list(out.values()))
    return out


def copy_cache(cache: list) -> list:
    """An independent copy of a cache list (paged layers' pages on disk shared: kvexec.export.copy_layer)."""
    out = []
    for c in cache:
        paged = copy_layer(c)
        if paged is None:
            arrays, layers = capture([c])
            paged = rebuild(copy_arrays(arrays), layers)[0]
        out.append(paged)
    return out


def holds(cache: list, positions: int) -> bool:
    """Whether every layer of `cache` holds exactly `positions` (recurrent state,
    which has no offset, always agrees)."""
    return all(getattr(c, "offset", positions) == positions for c in cache)


def state_bytes(arrays: dict[str, mx.array]) -> int:
    """Bytes the arrays hold in memory (parts of pages on disk hold none)."""
    return sum(a.nbytes for a in arrays.values() if isinstance(a, mx.array))


def trimmable_meta(layer: dict) -> bool:
    """Whether a saved layer can drop trailing positions (not recurrent state)."""
    return layer.get("kind") == PAGED or layer.get("class") in ("KVCache", "QuantizedKVCache")
