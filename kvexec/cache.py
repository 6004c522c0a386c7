"""The KV cache object mlx-lm's models talk to, backed by a page store.

`update_and_fetch` writes the new keys and values into the store and hands back
placeholders (`KVPlaceholder`); the attention call that follows reaches `attend`
through the seam (kvexec/seam.py), which runs the blockwise executor on the store.
Any other read of a placeholder raises `SeamBypassed`: a model attending by itself
would otherwise see only the current chunk, silently.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache, make_prompt_cache

from kvexec.attention import blockwise_attention
from kvexec import exact
from kvexec.formats import get_format
from kvexec.config import KVConfig
from kvexec.disk_pages import PageFile, PageReader
from kvexec.store import PageStore


class SeamBypassed(ValueError):
    """A model read a paged cache's keys or values other than through KVExec's executor."""


def _bypassed(what: str) -> SeamBypassed:
    return SeamBypassed(
        f"{what}: a paged KV cache's keys and values live in compressed pages that only KVExec's "
        "attention executor reads, reached through mlx-lm's scaled_dot_product_attention; this "
        "model's attention reads them another way (use mlx-lm's own KV cache for it: kv=None)")


class KVPlaceholder:
    """What `update_and_fetch` returns in place of the cached keys or values: their
    shape and dtype for code that only looks (as a full cache's would be); reading
    the data, by any path but the seam, raises SeamBypassed."""

    # Made per layer and step: it keeps what it needs and works out shape and dtype
    # only when asked (one is made per layer per decoded token).
    __slots__ = ("_like", "_positions", "_dtype")

    def __init__(self, like: mx.array, positions: int, dtype: mx.Dtype | None = None):
        self._like, self._positions, self._dtype = like, positions, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape a full cache's keys (values) would have: `like`'s, `positions` long."""
        s = self._like.shape
        return (*s[:-2], self._positions, s[-1])

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype a full cache's keys (values) would have: `like`'s, or the one cast to."""
        return self._like.dtype if self._dtype is None else self._dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions a full cache's keys (values) would have."""
        return self._like.ndim

    def astype(self, dtype: mx.Dtype, *args, **kwargs) -> KVPlaceholder:
        """A placeholder of `dtype`: a cast before the attention call reads nothing."""
        return KVPlaceholder(self._like, self._positions, dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"KVPlaceholder(shape={self.shape}, dtype={self.dtype})"

    def __getattr__(self, name: str):  # only names not defined above: array methods
        if name.startswith("__"):  # protocol probes (copy, pickle, hasattr checks) as usual
            raise AttributeError(name)
        raise _bypassed(f"KVPlaceholder.{name}")

    def _read(self, *args, **kwargs):
        raise _bypassed("KVPlaceholder read")

    # Operators are looked up on the type, not through __getattr__. MLX calls
    # __mlx_array__ when it converts an argument of an arithmetic operator.
    __mlx_array__ = __array__ = __getitem__ = __iter__ = __float__ = __int__ = __index__ = _read
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _read
    __matmul__ = __rmatmul__ = __pow__ = __rpow__ = __neg__ = __abs__ = __lt__ = __gt__ = _read
    __le__ = __ge__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _read


def placeholders(keys: mx.array, values: mx.array, positions: int) -> tuple[KVPlaceholder, KVPlaceholder]:
    """Stand-ins for `positions` cached keys and values shaped like `keys` and `values`."""
    return KVPlaceholder(keys, positions), KVPlaceholder(values, positions)


class PagedKVCache(_BaseCache):
    """mlx-lm's cache protocol over a PageStore; attention reaches `attend` through the seam."""

    def __init__(self, config: KVConfig | None = None, window: int | None = None):
        self.store = PageStore(config or KVConfig(), window)

    # -- mlx-lm cache protocol -------------------------------------------------
    @property
    def offset(self) -> int:
        """Positions stored so far."""
        return self.store.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KVPlaceholder, KVPlaceholder]:
        """Store the new keys and values; placeholders for all of them (see `attend`)."""
        self.store.append(keys, values)
        return placeholders(keys, values, self.store.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> None:
        """No mask: the executor knows positions and windows itself."""
        return None

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None,
               tokens_major: bool = False) -> mx.array:
        """Attention of `queries` (the newest positions) over the pages: the executor
        (its result [B, L, H * D] with `tokens_major`)."""
        store = self.store
        q_start = store.offset - queries.shape[-2]
        scoring = store.config.max_positions is not None and store.config.policy == "score"
        reader = store.reader
        spilled = store.spilled() if reader is not None else ()  # without a reader they are read in `blocks`
        loaded = reader.take(id(store), spilled) if spilled else None
        if reader is not None:  # the next disk layer is read while this one computes
            after = reader.after(id(store))
            if after is not None and after is not store:
                reader.schedule(id(after), after.spilled())
        out = blockwise_attention(queries, store.blocks(queries, loaded, newest=True), q_start, scale, store.window, sinks,
                                  observe=store.observe if scoring else None,
                                  block_tokens=store.config.block_tokens, tokens_major=tokens_major,
                                  row_invariant=store.row_invariant)
        if spilled or store.page_file is not None:
            mx.eval(out)  # the read pages are free for the next layer's read; full segments can go
            if loaded is not None:
                reader.release(id(store))
            store.spill()
        return out

    @property
    def state(self) -> list[mx.array]:
        """The store's arrays (to evaluate them; kvexec.export saves a layer)."""
        return self.store.arrays()

    @state.setter
    def state(self, value) -> None:
        """Refused: a paged cache is rebuilt by kvexec.export.import_layer, not from its arrays."""
        # The arrays alone do not say how the pages are laid out: kvexec.export does.
        raise TypeError("a paged KV cache is rebuilt by kvexec.export.import_layer, not from its state arrays")

    def is_trimmable(self) -> bool:
        """Trimmable in general; `can_trim` says whether by n positions."""
        return True

    def can_trim(self, n: int) -> bool:
        """Whether the last n positions are still held (a window may have dropped them)."""
        return self.store.can_trim(n)

    def trim(self, n: int) -> int:
        """Drop the last n positions; the number dropped."""
        return self.store.trim(n)

    def size(self) -> int:
        """Positions stored."""
        return self.store.offset

    def empty(self) -> bool:
        """Whether nothing is stored yet."""
        return self.store.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes the pages hold."""
        return self.store.nbytes


def for_head_dim(config: KVConfig, head_dim: int) -> KVConfig:
    """`config`, or the same in fp16 where its format (or a layer's) cannot store this head_dim."""
    if all(get_format(f).supports_head_dim(head_dim) for f in config.layer_formats or (config.format,)):
        return config
    return replace(config, format="fp16", layer_formats=())


def page_bytes_per_token(config: KVConfig, kv_heads: int, head_dim: int, layers=None) -> float:
    """Page bytes of one position in one layer: the format's, or with per-layer
    formats (a calibrated configuration) their mean over `layers` (attention-layer
    indices; None: all), so len(layers) x this is exact for those layers."""
    names = config.layer_formats or (config.format,)
    if config.layer_formats and layers is not None:
        names = tuple(names[i] for i in layers)
    if not names:
        return 0.0
    return sum(get_format(f).bytes_per_token(kv_heads, head_dim) for f in names) / len(names)


def make_cache(model: nn.Module, config: KVConfig | None = None) -> list:
    """The model's own cache list with every attention cache replaced by a paged one
    (sliding-window caches by windowed ones); recurrent-state caches stay as they are.
    With `config.layer_formats`, attention layer i keeps its pages in format i."""
    config = config or KVConfig()
    caches = make_prompt_cache(model)
    attention = [j for j, c in enumerate(caches) if isinstance(c, (RotatingKVCache, KVCache))]
    per_layer = config.layer_formats
    # Formats per attention layer; or per entry of the cache list, where a model holds only
    # some of its layers (a pipeline rank: the others' entries are stand-ins).
    by_entry = len(per_layer) == len(caches) != len(attention)
    if per_layer and not by_entry and len(per_layer) != len(attention):
        raise ValueError(f"{len(per_layer)} layer formats for a model with {len(attention)} attention layers")
    out = []
    for j, c in enumerate(caches):
        if not isinstance(c, (RotatingKVCache, KVCache)):
            out.append(c)
            continue
        name = per_layer[j if by_entry else attention.index(j)] if per_layer else None
        layer = replace(config, format=name, layer_formats=()) if name else config
        out.append(PagedKVCache(layer, window=c.max_size if isinstance(c, RotatingKVCache) else None))
    return out


def pin(cache: list, positions: int) -> None:
    """Retention never evicts positions below `positions` (the prompt)."""
    for c in cache:
        if isinstance(c, PagedKVCache):
            c.store.pinned = max(c.store.pinned, positions)


def keep_exact(cache: list, position: int) -> None:
    """A later trim back to `position` restores exactly what every layer held there
    (kvexec.exact): a request resumed from it computes what it did the first time."""
    for c in cache:
        if isinstance(c, PagedKVCache):
            c.store.keep_exact(position)


def chunk_room(cache: list, chunk: int) -> int:
    """How many of the next `chunk` positions one prefill pass may take, so that the
    pages each position attends to do not depend on the chunk size (kvexec.exact)."""
    room = chunk
    for c in cache:
        if isinstance(c, PagedKVCache):
            s, cfg = c.store, c.store.config
            room = min(room, exact.chunk_room(s.offset, chunk, s.sinks, cfg.hot_window, cfg.page_size))
    return room


def row_invariant(cache: list, on: bool = True) -> None:
    """Whether attention over `cache`'s pages computes each query row as a lone query
    at its position would, whatever rows share the step (a prefill chunk, a verified
    draft): kvexec.attention.invariant_rows."""
    for c in cache:
        if isinstance(c, PagedKVCache):
            c.store.row_invariant = on


def limit_pages(cache: list, per_layer: int | None) -> None:
    """Hold each growing layer's pages to `per_layer` bytes (None: no limit) by stepping
    cold pages down the pressure ladder; sliding-window layers are bounded rings."""
    for c in cache:
        if isinstance(c, PagedKVCache) and c.store.window is None and c.store.page_file is None:
            c.store.limit(per_layer)


def page_formats(cache: list) -> dict[str, int]:
    """Paged positions per format, summed over layers (allocated formats by their label:
    each layer's per-channel widths differ)."""
    out: dict[str, int] = {}
    for c in cache:
        if isinstance(c, PagedKVCache):
            for name, n in c.store.formats().items():
                label = get_format(name).label
                out[label] = out.get(label, 0) + n
    return out


def spill_layers(cache: list, page_file: PageFile | None, reader: PageReader | None, layers: int) -> int:
    """Plan the pages of `layers` of the growing attention layers (spread over them:
    `_spread_order`) on disk in `page_file`, read back through `reader`; every layer already holding
    spilled pages reads them through `reader` too. Layers on disk take no page limit (their
    pages in memory are the segment being filled). The number of layers on disk."""
    growing = [c.store for c in cache if isinstance(c, PagedKVCache) and c.store.window is None]
    layers = max(0, min(layers, len(growing)))
    chosen = set(_spread_order(len(growing))[:layers])
    order = []
    for i, store in enumerate(growing):
        if i in chosen:
            store.page_file = page_file
            store.limit(None)
        if store.page_file is not None or store.spilled():
            store.reader = reader
            order.append(store)
    if reader is not None:
        reader.order = order
    return sum(1 for s in growing if s.page_file is not None)


def _spread_order(n: int) -> list[int]:
    """0 .. n-1 in the order layers go to disk: each prefix spread over the model
    (van der Corput order), so a later plan's layers on disk include an earlier one's and
    reads interleave with resident layers' compute."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: (int(f"{i:0{bits}b}"[::-1], 2), i))


def detach_disk(cache: list) -> None:
    """Forget the reader (a request ended; its thread is stopped): spilled pages stay
    where they are and are read directly until a reader is attached again."""
    for c in cache:
        if isinstance(c, PagedKVCache):
            c.store.reader = None


def disk_bytes(cache: list) -> int:
    """Bytes of the cache's pages on disk."""
    return sum(c.store.disk_bytes() for c in cache if isinstance(c, PagedKVCache))


def can_trim(cache: list, n: int) -> bool:
    """Whether every layer can drop its last n positions."""
    return all(c.can_trim(n) if isinstance(c, PagedKVCache) else c.is_trimmable() for c in cache)


def trim(cache: list, n: int) -> bool:
    """Remove the last n positions from every layer, or from none (returns False)."""
    if not can_trim(cache, n):
        return False
    for c in cache:
        c.trim(n)
    return True
