"""One attention layer's KV, kept as pages.

Layout by position: pinned sink tokens (full precision) | pages of `page_size` tokens
in the page format | a full-precision hot window of the most recent tokens. When the
hot window holds `hot_window + page_size` tokens, its oldest `page_size` become a
page, written in place into a preallocated segment (never copied, never reallocated;
segment sizes double from one page up to `block_tokens`); a segment is also one
attention block. Sliding-window layers
drop segments that no future query can see, so their store is a bounded ring.
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


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=-2)


@dataclass
class Segment:
    """Preallocated storage for consecutive pages; pages are written in place."""

    start: int  # position of its first token
    capacity: int
    keys: dict[str, mx.array]
    values: dict[str, mx.array]
    length: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys.values(), *self.values.values()))


@dataclass
class PageStore:
    config: KVConfig = field(default_factory=KVConfig)
    window: int | None = None  # sliding-window layers: keys older than this are dead

    def __post_init__(self) -> None:
        self.fmt: KVFormat = get_format(self.config.format)
        if self.config.page_size % self.fmt.token_multiple:
            raise ValueError(f"{self.fmt.name} needs pages of a multiple of {self.fmt.token_multiple} tokens")
        self.full = get_format("fp32")  # how sinks and the hot window are read
        P = self.config.page_size
        self.sinks = 0 if self.window else self.config.sink_tokens
        cap = self.config.block_tokens // P * P
        if self.window:  # a ring needs only about one window per segment
            cap = min(cap, -(-self.window // P) * P)
        self.segment_capacity = cap
        self.sink_k = self.sink_v = None
        self.segments: list[Segment] = []
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
        self._drop_dead(first_query)

    def _hot_len(self) -> int:
        return 0 if self.hot_k is None else self.hot_k.shape[-2]

    def _flush(self) -> None:
        P = self.config.page_size
        while self._hot_len() >= self.config.hot_window + P:
            start = self.offset - self._hot_len()
            k, v = self.hot_k[..., :P, :], self.hot_v[..., :P, :]
            seg = self.segments[-1] if self.segments else None
            if seg is None or seg.length + P > seg.capacity:
                # Capacities double up to a block, so a short context wastes little.
                held = sum(s.length for s in self.segments)
                cap = min(self.segment_capacity, max(P, held // P * P))
                lead, D = tuple(k.shape[:2]), k.shape[-1]
                seg = Segment(start, cap, self.fmt.keys.allocate(lead, cap, D),
                              self.fmt.values.allocate(lead, cap, D))
                self.segments.append(seg)
            self.fmt.keys.write(seg.keys, self.fmt.keys.encode(k), seg.length, P)
            self.fmt.values.write(seg.values, self.fmt.values.encode(v), seg.length, P)
            seg.length += P
            # A slice: the flushed tokens' buffer goes with the next append's concatenate.
            self.hot_k, self.hot_v = self.hot_k[..., P:, :], self.hot_v[..., P:, :]

    def _drop_dead(self, first_query: int) -> None:
        if self.window is None:
            return
        # No query from `first_query` on sees positions <= first_query - window.
        while self.segments and self.segments[0].start + self.segments[0].length <= first_query - self.window:
            self.segments.pop(0)

    # -- reading -------------------------------------------------------------
    @property
    def pages(self) -> int:
        return sum(s.length for s in self.segments) // self.config.page_size

    def first_position(self) -> int:
        """Oldest position still held (sinks aside)."""
        if self.segments:
            return self.segments[0].start
        return self.offset - self._hot_len()

    def blocks(self):
        """Blocks in position order, in their stored form; each at most block_tokens."""
        if self.sink_k is not None:
            yield Block({"x": self.sink_k}, {"x": self.sink_v}, self.full, 0, self.sink_k.shape[-2])
        for seg in self.segments:
            yield Block(self.fmt.keys.view(seg.keys, 0, seg.length), self.fmt.values.view(seg.values, 0, seg.length),
                        self.fmt, seg.start, seg.length)
        if self._hot_len():
            yield Block({"x": self.hot_k}, {"x": self.hot_v}, self.full, self.offset - self._hot_len(),
                        self._hot_len())

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
        dtype = self.hot_dtype()
        P = self.config.page_size
        while target < hot_start and self.segments:
            seg = self.segments[-1]
            keep = max(0, target - seg.start) // P * P  # whole pages stay
            # Back into the hot window as the values attention saw for them.
            back = [codec.decode(codec.view(part, keep, seg.length)).astype(dtype)
                    for codec, part in ((self.fmt.keys, seg.keys), (self.fmt.values, seg.values))]
            self.hot_k = back[0] if self.hot_k is None else mx.concatenate([back[0], self.hot_k], axis=-2)
            self.hot_v = back[1] if self.hot_v is None else mx.concatenate([back[1], self.hot_v], axis=-2)
            hot_start = seg.start + keep
            seg.length = keep
            if keep == 0:
                self.segments.pop()
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
        """Bytes held, allocated segment capacity included."""
        arrays = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        return sum(a.nbytes for a in arrays) + sum(s.nbytes for s in self.segments)

    def arrays(self) -> list[mx.array]:
        out = [a for a in (self.sink_k, self.sink_v, self.hot_k, self.hot_v) if a is not None]
        for s in self.segments:
            out.extend(s.keys.values())
            out.extend(s.values.values())
        return out
