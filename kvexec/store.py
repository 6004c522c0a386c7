"""One attention layer's KV, kept as pages: the layout, writing, reading and trimming.

Layout by position: pinned sink tokens (full precision) | pages of `page_size` tokens
in the page format | a full-precision hot window of the most recent tokens. When the
hot window holds `hot_window + page_size` tokens, its oldest `page_size` become a
page, written in place into a preallocated segment (kvexec.segments); a segment is
also one attention block. Sliding-window layers drop segments that no future query can
see, so their store is a bounded ring. The strategies over the pages are their own
modules: the pressure ladder (kvexec.pressure), retention (kvexec.retention) and page
selection (kvexec.selection); they decide (which segment steps down, which is dropped)
and this store applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kvexec.attention import Block
from kvexec.config import KVConfig
from kvexec.disk_pages import Extent, PageFile, PageReader, read_now, segment_arrays
from kvexec.exact import ExactPoint, paged_end
from kvexec.formats import KVFormat, get_format
from kvexec.fused import available as fused_available
from kvexec.hot import HotWindow
from kvexec.pressure import ladder, step_down
from kvexec.retention import RetentionPolicy, observe
from kvexec.segments import (Segment, merge_with_previous, next_segment_capacity, reencode, release_unwritten,
                             segment_capacity)
from kvexec.selection import select_pages


def _segment_block(seg: Segment) -> Block:
    """`seg`'s attention block, the one made last time while its storage and extent are
    unchanged (Segment drops it when they change; its views of a partly written segment
    are then made once)."""
    if seg.block is None:
        seg.block = Block(seg.keys, seg.values, seg.fmt, seg.start, seg.length, tag=seg)
    return seg.block


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    # `b` is a slice of a whole chunk's keys or values: held as a view it would keep
    # that chunk's buffer alive for as long as the sinks (a copy holds only its rows)
    return mx.contiguous(b) if a is None else mx.concatenate([a, b], axis=-2)


@dataclass
class PageStore:
    """One layer's KV in pages (see the module doc)."""

    config: KVConfig = field(default_factory=KVConfig)
    window: int | None = None  # sliding-window layers: keys older than this are dead

    def __post_init__(self) -> None:
        self.fmt: KVFormat = get_format(self.config.format)
        if self.config.page_size % self.fmt.token_multiple:
            raise ValueError(f"{self.fmt.name} needs pages of a multiple of {self.fmt.token_multiple} tokens")
        self.full = get_format("fp32")  # how sinks and the hot window are read
        self.sinks = 0 if self.window else self.config.sink_tokens
        self.segment_capacity = segment_capacity(self.config, self.window)
        self.pinned = 0  # positions below this (the prompt) are never evicted
        self.evicted = 0
        self.retention = RetentionPolicy(self.config.policy)
        self.sink_k = self.sink_v = None
        self.segments: list[Segment] = []
        self.hot = HotWindow(self.config.hot_window + self.config.page_size)
        self.offset = 0  # positions written so far
        self.page_limit: int | None = None  # bytes the segments may take (kvexec.pressure)
        self._ladder: list[KVFormat] | None = None  # known once head_dim is
        self.exact: ExactPoint | None = None  # a position trim restores bit for bit (kvexec.exact)
        # Pages on disk (kvexec.disk_pages): where full segments are written when this
        # layer is planned on disk, and the reader that brings spilled ones back.
        self.page_file: PageFile | None = None
        self.reader: PageReader | None = None
        # Attention computes each query row as a lone query at its position would
        # (kvexec.attention.invariant_rows): set where the engine promises the same
        # reply however a token was computed (kvexec.row_invariant).
        self.row_invariant = False
        self._sinks_kept: tuple | None = None  # (sink_k, sink_v, their block): `_sink_block`
        self._head_dim: int | None = None  # the head_dim appends were checked for

    # -- writing -------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add [B, kv_heads, L, D] keys/values at positions offset .. offset + L - 1."""
        L, D = keys.shape[-2], keys.shape[-1]
        if D != self._head_dim:  # checked once, not per layer and step
            if not self.fmt.supports_head_dim(D):
                raise ValueError(f"KV format {self.fmt.name} needs a head_dim divisible by 32, not {D}")
            self._head_dim = D
        if self._ladder is None:
            self._ladder = ladder(self.config, D)
        keys, values = keys.astype(self._full_dtype(keys.dtype)), values.astype(self._full_dtype(values.dtype))
        have = 0 if self.sink_k is None else self.sink_k.shape[-2]
        take = min(L, self.sinks - have)
        if take > 0:
            self.sink_k = _cat(self.sink_k, keys[..., :take, :])
            self.sink_v = _cat(self.sink_v, values[..., :take, :])
            keys, values = keys[..., take:, :], values[..., take:, :]
        if keys.shape[-2]:
            self.hot.append(keys, values)
        first_query = self.offset  # this call's queries start here
        self.offset += L
        self._flush()
        self._drop_dead(first_query)
        self._retain()

    def _full_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """What sinks and the hot window keep tokens computed in `dtype` in (KVConfig.full_bits)."""
        return mx.float16 if dtype == mx.float32 and self.config.full_bytes(4) == 2 else dtype

    def _hot_len(self) -> int:
        return self.hot.n

    def _flush(self) -> None:
        P = self.config.page_size
        while self._hot_len() >= self.config.hot_window + P:
            start = self.offset - self._hot_len()
            a = self.hot.lead  # the window's oldest tokens follow the room's lead
            k, v = self.hot.keys_room[..., a : a + P, :], self.hot.values_room[..., a : a + P, :]
            seg = self.segments[-1] if self.segments else None
            if seg is None or seg.length + P > seg.capacity:
                lead, D = tuple(k.shape[:2]), k.shape[-1]
                per_token = self.fmt.bytes_per_token(lead[0] * lead[1], D)
                room = None if self.page_limit is None else self.page_limit - self.page_bytes()
                cap = next_segment_capacity(sum(s.length for s in self.segments), P, self.segment_capacity,
                                            per_token, room)
                self._relieve(int(per_token * cap))
                seg = Segment(start, cap, self.fmt.keys.allocate(lead, cap, D),
                              self.fmt.values.allocate(lead, cap, D), self.fmt)
                self.segments.append(seg)
            seg.block = None  # its views would hold the storage: the write would copy it
            seg.fmt.keys.write(seg.keys, seg.fmt.keys.encode(k), seg.length, P)
            seg.fmt.values.write(seg.values, seg.fmt.values.encode(v), seg.length, P)
            seg.length += P
            if self.config.select_pages:
                seg.key_min, seg.key_max = k.min(axis=-2), k.max(axis=-2)
            if self.page_limit is not None and seg.length == seg.capacity:
                # small segments made under the limit coalesce
                merge_with_previous(self.segments, seg, self.segment_capacity, P)
            if self.exact is not None:
                self.exact.note_page(self.offset, start, k, v)
            self.hot.drop_oldest(P)

    def page_bytes(self) -> int:
        """Bytes the segments take."""
        return sum(s.nbytes for s in self.segments)

    def limit(self, page_bytes: int | None) -> None:
        """Hold the pages to `page_bytes` (None: no limit), stepping down now what
        already passes it: the request that set it was planned with them that small."""
        self.page_limit = page_bytes
        self._relieve(0)

    def _relieve(self, incoming: int) -> None:
        """Step pages down the ladder until `incoming` more bytes fit the page limit, or
        no page can step further; then, past the floor with past_floor="retain", drop
        pages as retention chooses (kvexec.pressure)."""
        if self._ladder is None and self.hot_k is not None:  # restored from a snapshot
            self._ladder = ladder(self.config, self.hot_k.shape[-1])
        limit = self.page_limit
        if self._ladder is None or limit is None:
            return
        if self.page_bytes() + incoming > limit:
            for seg in self.segments:  # room no page is written in goes first
                release_unwritten(seg)
        while self.page_bytes() + incoming > limit:
            step = step_down(self.segments, self._ladder)
            if step is None:
                if self.config.past_floor == "retain":
                    while self.page_bytes() + incoming > limit and self._drop_one():
                        pass
                return
            seg, fmt = step
            reencode(seg, fmt)
            merge_with_previous(self.segments, seg, self.segment_capacity, self.config.page_size)

    def _retain(self) -> None:
        """Drop generated (unpinned) pages until max_positions are retained (kvexec.retention)."""
        budget = self.config.max_positions
        if budget is None:
            return
        while self.retained() > budget and self._drop_one():
            pass  # stops with only pinned tokens left; the planner refuses such requests up front

    def _drop_one(self) -> bool:
        """Drop the unpinned segment retention chooses; False when none is left to drop."""
        i = self.retention.choose(self.segments, max(self.pinned, self.sinks))
        if i is None:
            return False
        self.evicted += self.segments.pop(i).length
        return True

    def _drop_dead(self, first_query: int) -> None:
        if self.window is None:
            return
        # No query from `first_query` on sees positions <= first_query - window.
        while self.segments and self.segments[0].start + self.segments[0].length <= first_query - self.window:
            self.segments.pop(0)

    def retained(self) -> int:
        """Positions held: sinks, pages and the hot window."""
        sinks = 0 if self.sink_k is None else self.sink_k.shape[-2]
        return sinks + sum(s.length for s in self.segments) + self._hot_len()

    def observe(self, block: Block, mass: float) -> None:
        """Attention mass a block received (summed over heads and queries)."""
        observe(block, mass)

    # -- reading -------------------------------------------------------------
    @property
    def pages(self) -> int:
        """Whole pages held."""
        return sum(s.length for s in self.segments) // self.config.page_size

    def first_position(self) -> int:
        """Oldest position still held (sinks aside)."""
        if self.segments:
            return self.segments[0].start
        return self.offset - self._hot_len()

    def blocks(self, queries: mx.array | None = None, loaded: dict | None = None, newest: bool = False):
        """Blocks in position order, in their stored form; each at most block_tokens.
        Given decode `queries` and select_pages, only the selected pages come. Spilled
        segments come from `loaded` (PageReader.take), else are read now. `newest`: the
        queries are the newest positions (what PagedKVCache.attend gets), so the sinks may
        come with the hot window as one block (`_sinks_with_hot`)."""
        n = self._hot_len()
        together = newest and self._sinks_with_hot(n)
        if self.sink_k is not None and not together:
            yield self._sink_block()
        for seg in select_pages(self.segments, queries, self.config.select_pages):
            if seg.extent is None:
                yield _segment_block(seg)
                continue
            buffers = (loaded or {}).get(seg.extent)
            keys, values = read_now(seg.extent) if buffers is None else segment_arrays(seg.extent, buffers)
            yield Block(keys, values, seg.fmt, seg.start, seg.length, tag=seg)
        if together:
            # The sinks (the room's lead) and the window as one block: one decode query
            # sees all of them, so where they lie does not matter, only that all are read.
            yield Block({"x": self.hot.keys_room}, {"x": self.hot.values_room}, self.full, self.offset - n,
                        self.hot.lead + n, lead=self.hot.lead)
        elif n and self.hot.lead:
            yield Block({"x": self.hot.keys()}, {"x": self.hot.values()}, self.full, self.offset - n, n)
        elif n:
            yield Block({"x": self.hot.keys_room}, {"x": self.hot.values_room}, self.full, self.offset - n, n)

    def _sinks_with_hot(self, n: int) -> bool:
        """Whether the sinks are read with the hot window as one block (a decode step:
        one product and no softmax pieces to join for both), for queries at the newest
        positions, every query so (a decode step's rows in a prefill chunk's order),
        where MLX computes attention (the native kernel reads the room's first tokens as
        the window's); the sinks are then copied (once) in front of the window in its
        room (HotWindow's lead)."""
        if self.window is not None or self.sink_k is None or not n or fused_available():
            return False
        if self.hot.lead_k is not self.sink_k or self.hot.lead_v is not self.sink_v:
            self.hot.set_lead(self.sink_k, self.sink_v)
        return True

    def _sink_block(self) -> Block:
        """The sinks' block, kept while the sinks stay the same arrays. Where MLX computes
        attention (no native decode kernel), it holds them in float32, as attention reads
        them: the cast (exact) is made once, not per layer and step; a few positions."""
        kept = self._sinks_kept
        if kept is not None and kept[0] is self.sink_k and kept[1] is self.sink_v:
            return kept[2]
        k, v = self.sink_k, self.sink_v
        if not fused_available():
            k, v = k.astype(mx.float32), v.astype(mx.float32)
        block = Block({"x": k}, {"x": v}, self.full, 0, k.shape[-2])
        self._sinks_kept = (self.sink_k, self.sink_v, block)
        return block

    @property
    def hot_k(self) -> mx.array | None:
        """The hot window's keys, exactly the tokens held (a view)."""
        return self.hot.keys()

    @hot_k.setter
    def hot_k(self, keys: mx.array | None) -> None:
        """Hold exactly `keys` in the hot window (set hot_v next)."""
        self.hot.set(keys, self.hot.values())  # the tokens, not the room: it may hold a lead

    @property
    def hot_v(self) -> mx.array | None:
        """The hot window's values, exactly the tokens held (a view)."""
        return self.hot.values()

    @hot_v.setter
    def hot_v(self, values: mx.array | None) -> None:
        """Hold exactly `values` in the hot window (after hot_k)."""
        self.hot.set(self.hot.keys(), values)

    # -- pages on disk -------------------------------------------------------
    def spilled(self) -> tuple[Extent, ...]:
        """The extents of the segments on disk, in position order."""
        return tuple(s.extent for s in self.segments if s.extent is not None)

    def spill(self) -> None:
        """Write every full segment still in memory to the page file and drop it from
        memory (a layer planned on disk; after attention read it)."""
        if self.page_file is None:
            return
        for seg in self.segments:
            if seg.extent is None and seg.length == seg.capacity:
                seg.extent = self.page_file.write(seg.keys, seg.values)
                seg.keys, seg.values = {}, {}

    def unspill(self, seg: Segment) -> None:
        """Bring a spilled segment back into memory (it is about to change)."""
        if seg.extent is not None:
            seg.keys, seg.values = read_now(seg.extent)
            seg.extent = None

    def disk_bytes(self) -> int:
        """Bytes of this layer's pages on disk."""
        return sum(e.nbytes for e in self.spilled())

    # -- trimming ------------------------------------------------------------
    def can_trim(self, n: int) -> bool:
        """Whether the last n positions can be removed with everything a later query
        needs still held (sliding layers may have dropped it)."""
        if n > self.offset or (self.evicted and n > self._hot_len()):
            return False  # evicted pages cannot come back
        if self.window is None:
            return True
        return self.first_position() <= max(0, self.offset - n - self.window)

    def trim(self, n: int) -> int:
        """Remove the last `n` positions (0 when they cannot be, see can_trim); return how many."""
        if n <= 0 or not self.can_trim(n):
            return 0
        target = self.offset - n
        if self._trim_exact(target):
            return n
        hot_start = self.offset - self._hot_len()
        dtype = self.hot_dtype()
        P = self.config.page_size
        while target < hot_start and self.segments:
            seg = self.segments[-1]
            if seg.extent is not None and target <= seg.start and self.hot_k is not None:
                # wholly removed, and every position after it goes too: nothing to read back
                self.hot.set(self.hot_k[..., :0, :], self.hot_v[..., :0, :])
                hot_start = seg.start
                self.segments.pop()
                continue
            self.unspill(seg)
            keep = max(0, target - seg.start) // P * P  # whole pages stay
            # Back into the hot window as the values attention saw for them (in its precision).
            back = [codec.decode(codec.view(part, keep, seg.length)).astype(dtype)
                    for codec, part in ((seg.fmt.keys, seg.keys), (seg.fmt.values, seg.values))]
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

    def keep_exact(self, at: int) -> None:
        """Keep what a trim back to `at` (at most the positions written) needs to give
        the layout a store that stopped at `at` has: one such position at a time."""
        if at < self.offset:
            raise ValueError(f"an exact trim point at {at} is behind the {self.offset} positions written")
        if self.exact is None or self.exact.at != at:
            self.exact = ExactPoint(at)

    def _trim_exact(self, target: int) -> bool:
        """Trim to `target` with the pages and full-precision hot window a store that
        stopped at `target` holds, from the exact point's copies; False (nothing done)
        where there is no page to take back or the copies do not cover it."""
        cfg = self.config
        cold = paged_end(target, self.sinks, cfg.hot_window, cfg.page_size)
        paged = self.offset - self._hot_len()
        if self.exact is None or target < self.sinks or paged <= cold or \
                not self.exact.covers(cold, min(target, paged)):
            return False
        keys, values = self.exact.take(cold, min(target, paged))
        if target > paged:
            keys = mx.concatenate([keys, self.hot_k[..., : target - paged, :]], axis=-2)
            values = mx.concatenate([values, self.hot_v[..., : target - paged, :]], axis=-2)
        while self.segments and self.segments[-1].start + self.segments[-1].length > cold:
            seg = self.segments[-1]
            if seg.start >= cold:
                self.segments.pop()
                continue
            self.unspill(seg)  # it is written into again
            seg.length = cold - seg.start  # whole pages: segments start on page boundaries
        self.hot.set(keys, values)
        self.exact.keep_below(cold)  # the rest is in the hot window again, and is copied when paged again
        self.offset = target
        return True

    def formats(self) -> dict[str, int]:
        """Paged positions per format (several once pages stepped down)."""
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.fmt.name] = out.get(s.fmt.name, 0) + s.length
        return out

    def hot_dtype(self) -> mx.Dtype:
        """The dtype of the full-precision tokens (sinks, hot window)."""
        ref = self.hot_k if self.hot_k is not None else self.sink_k
        return mx.float32 if ref is None else ref.dtype

    # -- accounting ----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held, allocated segment capacity included."""
        arrays = [a for a in (self.sink_k, self.sink_v, self.hot.keys_room, self.hot.values_room) if a is not None]
        exact = 0 if self.exact is None else self.exact.nbytes
        return sum(a.nbytes for a in arrays) + sum(s.nbytes for s in self.segments) + exact

    def arrays(self) -> list[mx.array]:
        """Every array the store holds (to evaluate or count)."""
        out = [a for a in (self.sink_k, self.sink_v, self.hot.keys_room, self.hot.values_room) if a is not None]
        for s in self.segments:
            out.extend(s.keys.values())
            out.extend(s.values.values())
        if self.exact is not None:
            out.extend(self.exact.keys + self.exact.values)
        return out
