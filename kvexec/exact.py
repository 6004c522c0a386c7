"""An exact trim point: the position a page store can be trimmed back to as a store
that stopped there would be, bit for bit.

A store keeps its newest positions in full precision (the hot window) and pages older
ones lossily as it grows. Trimming back to an earlier position cannot un-page what was
paged after it: decoding the pages gives other values than the ones attention saw
there, so a request resumed from the trimmed state (the same prompt again, a retry,
a shared prefix) computes a different reply than it did cold. An `ExactPoint` keeps the
full-precision keys and values of the positions below its position `at` that were
paged after the store passed `at`: at most the hot window there, and nothing else.
`paged_end` says which positions a store holding `t` positions has paged, so a trim to
any `t` the point covers restores exactly that layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


def paged_end(positions: int, sinks: int, hot_window: int, page_size: int) -> int:
    """Where the hot window starts in a store that wrote `positions` (flushing as it
    goes): sinks, then every whole page the hot window has passed."""
    if positions <= sinks:
        return positions
    return sinks + page_size * max(0, (positions - sinks - hot_window) // page_size)


def chunk_room(offset: int, chunk: int, sinks: int, hot_window: int, page_size: int) -> int:
    """How many of `chunk` positions from `offset` one forward pass may take so that
    each sees the pages a pass of its own would: none past the next position whose
    write flushes a page (a pass attends after its whole chunk is written and flushed)."""
    first = sinks + hot_window + page_size  # the write that flushes the first page
    flush = first if offset + 1 < first else first + page_size * ((offset + 1 - first) // page_size + 1)
    return max(1, min(chunk, flush - 1 - offset))


@dataclass
class ExactPoint:
    """Position `at` and the full-precision copies (from `start` on, contiguous) of
    the positions below it paged after the store passed it."""

    at: int
    start: int | None = None
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    held: int = 0  # positions copied

    def note_page(self, offset: int, start: int, keys: mx.array, values: mx.array) -> None:
        """A page of `keys`/`values` from `start` is being written while the store holds
        `offset` positions: keep what of it lies below `at`, if the store is past `at`."""
        if offset <= self.at or start >= self.at:
            return
        if self.start is None:
            self.start = start
        if start != self.start + self.held:  # pages are written in order; a gap means a lossy trim came between
            return
        n = min(keys.shape[-2], self.at - start)
        # copies: the page's rows live in the hot window's room, which is reused
        self.keys.append(mx.array(keys[..., :n, :]))
        self.values.append(mx.array(values[..., :n, :]))
        self.held += n

    def copy(self) -> ExactPoint:
        """An independent copy."""
        keys, values = self.arrays()
        return ExactPoint(self.at, self.start, [] if keys is None else [mx.array(keys)],
                          [] if values is None else [mx.array(values)], self.held)

    def covers(self, first: int, end: int) -> bool:
        """Whether positions first .. end - 1 are held."""
        return first >= end or (self.start is not None and self.start <= first and end <= self.start + self.held)

    def take(self, first: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions first .. end - 1 (held: see covers)."""
        k, v = self.arrays()
        return k[..., first - self.start : end - self.start, :], v[..., first - self.start : end - self.start, :]

    def keep_below(self, end: int) -> None:
        """Forget the copies from `end` on (they are in the hot window again)."""
        if self.start is None or end >= self.start + self.held:
            return
        if end <= self.start:
            self.start, self.keys, self.values, self.held = None, [], [], 0
            return
        k, v = self.take(self.start, end)
        self.keys, self.values, self.held = [k], [v], end - self.start

    def arrays(self) -> tuple[mx.array | None, mx.array | None]:
        """The copies as one keys and one values array (None when nothing is held)."""
        if not self.keys:
            return None, None
        if len(self.keys) > 1:
            self.keys, self.values = [mx.concatenate(self.keys, axis=-2)], [mx.concatenate(self.values, axis=-2)]
        return self.keys[0], self.values[0]

    @property
    def nbytes(self) -> int:
        """Bytes the copies take."""
        return sum(a.nbytes for a in (*self.keys, *self.values))
