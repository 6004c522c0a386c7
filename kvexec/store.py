"""One attention layer's KV, kept as pages.

Layout by position: pinned sink tokens (full precision) | pages of `page_size` tokens
in the page format, each written once and never copied | a full-precision hot window
of the most recent tokens. When the hot window holds `hot_window + page_size` tokens,
its oldest `page_size` become a page. Sliding-window layers drop pages that no future
query can see, so their store is a bounded ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kvexec.attention import Block
from kvexec.formats import KVFormat, get_format


@dataclass(frozen=True)
class KVConfig:
    format: str = "fp16"
    page_size: int = 256
    hot_window: int = 256  # most recent tokens kept in full precision
    sink_tokens: int = 4  # first tokens kept in full precision (global layers)
    block_tokens: int = 2048  # tokens decoded per attention block: bounds the transient

    def __post_init__(self) -> None:
        get_format(self.format)
        if self.page_size < 1 or self.hot_window < 0 or self.sink_tokens < 0:
            raise ValueError("page_size must be >= 1; hot_window and sink_tokens >= 0")
        if self.block_tokens < self.page_size:
            raise ValueError("block_tokens must be at least one page")


@dataclass
class Page:
    start: int
    length: int
    keys: dict[str, mx.array]
    values: dict[str, mx.array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys.values(), *self.values.values()))


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=-2)


@dataclass
class PageStore:
    config: KVConfig = field(default_factory=KVConfig)
    window: int | None = None  # sliding-window layers: keys older than this are dead

    def __post_init__(self) -> None:
        self.fmt: KVFormat = get_format(self.config.format)
        self.sinks = 0 if self.window else self.config.sink_tokens
        self.sink_k = self.sink_v = None
        self.pages: list[Page] = []
        self.hot_k = self.hot_v = None
        self.offset = 0  # positions written so far

    # -- writing -------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add [B, kv_heads, L, D] keys/values at positions offset .. offset + L - 1."""
        L = keys.shape[-2]
        have = 0 if self.sink_k is None else self.sink_k.shape[-2]
        take = min(L, self.sinks - have)
        if take > 0:
            self.sink_k = _cat(self.sink_k, keys[..., :take, :])
            self.sink_v = _cat(self.sink_v, values[..., :take, :])
            keys, values = keys[..., take:, :], values[..., take:, :]
        if keys.shape[-2]:
            self.hot_k, self.hot_v = _cat(self.hot_k, keys), _cat(self.hot_v, values)
        first_query = self.offset  # this call's queries start here
        self.offset += L
        self._flush()
        self._drop_dead_pages(first_query)

    def _hot_len(self) -> int:
        return 0 if self.hot_k is None else self.hot_k.shape[-2]

    def _flush(self) -> None:
        P = self.config.page_size
        while self._hot_len() >= self.config.hot_window + P:
            start = self.offset - self._hot_len()
            k, v = self.hot_k[..., :P, :], self.hot_v[..., :P, :]
            self.pages.append(Page(start, P, self.fmt.encode(k), self.fmt.encode(v)))
            # A slice: the flushed tokens' buffer goes with the next append's concatenate.
            self.hot_k, self.hot_v = self.hot_k[..., P:, :], self.hot_v[..., P:, :]

    def _drop_dead_pages(self, first_query: int) -> None:
        if self.window is None:
            return
        # No query from `first_query` on sees positions <= first_query - window.
        while self.pages and self.pages[0].start + self.pages[0].length <= first_query - self.window:
            self.pages.pop(0)

    # -- reading -------------------------------------------------------------
    def first_position(self) -> int:
        """Oldest position still held (sinks aside)."""
        if self.pages:
            return self.pages[0].start
        return self.offset - self._hot_len()

    def blocks(self):
        """Full-precision blocks in position order, each at most block_tokens long."""
        if self.sink_k is not None:
            yield Block(self.sink_k.astype(mx.float32), self.sink_v.astype(mx.float32), 0)
        per_block = max(1, self.config.block_tokens // self.config.page_size)
        for i in range(0, len(self.pages), per_block):
            group = self.pages[i : i + per_block]
            ks = [self.fmt.decode(p.keys) for p in group]
            vs = [self.fmt.decode(p.values) for p in group]
            k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=-2)
            v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=-2)
            yield Block(k, v, group[0].start)
        if self.hot_k is not None and self._hot_len():
            yield Block(self.hot_k.astype(mx.float32), self.hot_v.astype(mx.float32),
                        self.offset - self._hot_len())

    # -- trimming ------------------------------------------------------------
    def can_trim(self, n: int) -> bool:
        """Whether the last n positions can be removed with everything a later query
        needs still held (sliding layers may have dropped it)."""
        if n > self.offset:
            return False
        if self.window is None:
            return True
        return self.first_position() <= max(0, self.offset - n - self.window)

    def trim(self, n: int) -> int:
        if n <= 0 or not self.can_trim(n):
            return 0
        target = self.offset - n
        hot_start = self.offset - self._hot_len()
        while target < hot_start and self.pages:
            page = self.pages.pop()
            # Back into the hot window as the values attention saw for them.
            k = self.fmt.decode(page.keys).astype(self.hot_dtype())
            v = self.fmt.decode(page.values).astype(self.hot_dtype())
            self.hot_k = k if self.hot_k is None else mx.concatenate([k, self.hot_k], axis=-2)
            self.hot_v = v if self.hot_v is None else mx.concatenate([v, self.hot_v], axis=-2)
            hot_start = page.start
        if target < self.sinks:
            self.sink_k = None if target == 0 else self.sink_k[..., :target, :]
            self.sink_v = None if target == 0 else self.sink_v[..., :target, :]
            self.hot_k = self.hot_v = None
        elif self.hot_k is not None:
            keep = target - hot_start
            self.hot_k, self.hot_v = self.hot_k[..., :keep, :], self.hot_v[..., :keep, :]
        self.offset = target
        return n

    def hot_dtype(self) -> mx.Dtype:
        ref = self.hot_k if self.hot_k is not None else self.sink_k
        return mx.float32 if ref is None else ref.dtype

    # -- accounting ----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        arrays = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        return sum(a.nbytes for a in arrays) + sum(p.nbytes for p in self.pages)

    def arrays(self) -> list[mx.array]:
        out = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        for p in self.pages:
            out.extend(p.keys.values())
            out.extend(p.values.values())
        return out
