"""Segments: preallocated storage for consecutive pages, and how large each is.

Segment sizes double from one page up to the store's segment capacity (a block, less
for sliding-window layers and one page where pages are evicted or selected one by one),
so a short context wastes little and a long one allocates rarely; under a page byte
limit a new segment is only as large as fits beside the pages, and room a looser limit
allocated is given back before any page steps down (`release_unwritten`). The planner
sizes KV with the same functions (`segment_capacity`, `allocated_positions`; whole
pages under a limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from kvexec.config import KVConfig
from kvexec.formats import KVFormat

if TYPE_CHECKING:
    from kvexec.disk_pages import Extent


@dataclass
class Segment:
    """Preallocated storage for consecutive pages; pages are written in place."""

    start: int  # position of its first token
    capacity: int
    keys: dict[str, mx.array]
    values: dict[str, mx.array]
    fmt: KVFormat
    length: int = 0
    score: float = 0.0  # attention mass received (retention's "score" policy)
    key_min: mx.array | None = None  # per-channel key bounds (page selection)
    key_max: mx.array | None = None
    # Where its storage lies on disk once spilled (kvexec.disk_pages); keys and values are
    # then empty until read back.
    extent: Extent | None = None
    # The attention block over it, kept while its storage and length stay as they are:
    # a decode step then makes no new views (slices) of a segment it read last step.
    block: object = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value) -> None:
        # New storage (spilled, re-encoded, joined, given back) drops the kept block: it
        # would hold the old arrays in memory. So does a new extent (a trim, a join).
        if name in ("keys", "values", "fmt", "start", "length"):
            object.__setattr__(self, "block", None)
        object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes of its storage in memory, allocated capacity included (0 once spilled)."""
        return sum(a.nbytes for a in (*self.keys.values(), *self.values.values()))


def segment_capacity(config: KVConfig, window: int | None = None) -> int:
    """The largest segment a layer's store allocates (whole pages): a block; about one
    window for a sliding layer (a ring); one page where pages are evicted or selected
    one by one."""
    P = config.page_size
    cap = config.block_tokens // P * P
    if window:
        cap = min(cap, -(-window // P) * P)
    if config.max_positions is not None or config.select_pages:
        cap = P
    return cap


def next_segment_capacity(held: int, page: int, limit: int, per_token: float = 0.0,
                          room: float | None = None) -> int:
    """Capacity of the segment that follows `held` paged positions: doubling up to
    `limit`; given `room` (bytes the page limit leaves) and `per_token` bytes, the
    largest of that, half of it, ... (whole pages) that fits, else one page: making
    room for a doubled segment would step every older page down at once, for positions
    not yet written."""
    cap = min(limit, max(page, held // page * page))
    while room is not None and cap > page and per_token * cap > room:
        cap = max(page, cap // 2 // page * page)
    return cap


def allocated_positions(paged: int, page: int, limit: int, page_limited: bool = False) -> int:
    """Positions the segments holding `paged` positions have room for: every segment
    whole, or under a page limit whole pages (room past them is given back before any
    page steps down: `release_unwritten`)."""
    if page_limited:
        return -(-paged // page) * page
    held = 0
    while held < paged:
        step = next_segment_capacity(held, page, limit)
        if step == limit:  # every later segment is `limit` too: the rest in one step (plans at 1M+ positions)
            return held + -(-(paged - held) // limit) * limit
        held += step
    return held


def release_unwritten(seg: Segment) -> None:
    """Give back `seg`'s room past its written tokens (its capacity becomes its length,
    whole pages): under a page limit, room allocated while the limit was looser goes
    before any page steps down, so the planner counts pages, not segments."""
    if seg.length >= seg.capacity:
        return
    for side, codec in (("keys", seg.fmt.keys), ("values", seg.fmt.values)):
        written = {name: mx.contiguous(a) for name, a in codec.view(getattr(seg, side), 0, seg.length).items()}
        mx.eval(written)  # the old storage is freed now
        setattr(seg, side, written)
    seg.capacity = seg.length


def reencode(seg: Segment, fmt: KVFormat) -> None:
    """Store `seg`'s tokens in `fmt` (same capacity); a codec both formats share is kept."""
    parts = []
    for old, new, storage in ((seg.fmt.keys, fmt.keys, seg.keys), (seg.fmt.values, fmt.values, seg.values)):
        if old == new:
            parts.append(storage)
            continue
        x = old.decode(old.view(storage, 0, seg.length))
        lead, D = tuple(x.shape[:2]), x.shape[-1]
        out = new.allocate(lead, seg.capacity, D)
        new.write(out, new.encode(x), 0, seg.length)
        mx.eval(out)  # the old storage is freed now, not when attention next reads it
        parts.append(out)
    seg.keys, seg.values, seg.fmt = parts[0], parts[1], fmt


def merge_with_previous(segments: list[Segment], seg: Segment, capacity: int, page: int) -> None:
    """Join `seg` to the segment before it in `segments` when both are full, share a
    format and together fit `capacity`: the small segments made under a page limit do
    not stay small blocks for every decode step to visit one by one. (Retention and
    page selection keep one page per segment.)"""
    i = next(j for j, s in enumerate(segments) if s is seg)  # by identity: fields hold arrays
    if i == 0 or capacity == page:
        return
    prev = segments[i - 1]
    if (prev.fmt != seg.fmt or prev.length != prev.capacity or seg.length != seg.capacity
            or prev.capacity + seg.capacity > capacity):
        return
    joined = []
    for codec, a, b in ((seg.fmt.keys, prev.keys, seg.keys), (seg.fmt.values, prev.values, seg.values)):
        axis = -1 if codec.tokens_last else -2
        joined.append({name: mx.concatenate([a[name], b[name]], axis=axis) for name in a})
    mx.eval(joined)  # the two old storages are freed now
    prev.keys, prev.values = joined
    prev.capacity += seg.capacity
    prev.length += seg.length
    prev.score += seg.score
    segments.pop(i)
