"""KV pages on disk: a residency level for a layer's pages.

A layer planned on disk writes each segment once it is full (`PageFile.write`: the
storage's bytes, unchanged) and drops it from memory; its sinks, hot window and the
segment being filled stay resident. Attention reads the layer's segments back just in
time (`PageReader`): while one layer computes, a reader thread reads the next disk
layer's segments into buffers reused from step to step, so at most two layers' pages
are in memory at once, whatever the context. The bytes read are the bytes written, so
attention over them is exactly attention over resident pages.

The page file is unlinked from the moment it is made: a killed process leaves nothing
behind, and nothing outside this process can name it. Read pages are dropped from the
OS page cache unless `keep_cached` (the cache is memory that no process is charged
for; a budget that only holds because of it does not hold).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

_ALIGN = 4096  # extents start on page boundaries (what direct I/O and readahead like)
_SYNC_EVERY = 64 << 20  # written bytes between flushes to disk (dirty pages are memory too)
_PART_ALIGN = 64  # a part's offset in a read slot: any dtype's view of it is aligned


@dataclass(frozen=True)
class Extent:
    """Where one spilled segment's storage lies in a page file: its parts (side, name,
    dtype, shape) back to back from `offset`."""

    file: PageFile
    offset: int
    parts: tuple[tuple[str, str, mx.Dtype, tuple[int, ...]], ...]
    nbytes: int


def _nbytes(dtype: mx.Dtype, shape: tuple[int, ...]) -> int:
    n = dtype.size
    for s in shape:
        n *= s
    return n


def _writable(a: mx.array) -> memoryview:
    return memoryview(a).cast("B")


class PageFile:
    """An unlinked, append-only file of spilled segments in `folder`. Extents are
    written once and never change, so copies of a cache share them."""

    def __init__(self, folder: str | os.PathLike, keep_cached: bool = False):
        os.makedirs(folder, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder, prefix="kv-pages-")
        self.fd = self._file.fileno()
        self.keep_cached = keep_cached
        if not keep_cached and hasattr(fcntl, "F_NOCACHE"):  # macOS: no posix_fadvise, this instead
            fcntl.fcntl(self.fd, fcntl.F_NOCACHE, 1)
        self._lock = threading.Lock()
        self.end = 0
        self._unsynced = 0
        self.bytes_written = 0

    def write(self, keys: dict[str, mx.array], values: dict[str, mx.array]) -> Extent:
        """Append a segment's storage (its arrays evaluated); where it went."""
        arrays = [("k", n, mx.contiguous(a)) for n, a in sorted(keys.items())] + \
            [("v", n, mx.contiguous(a)) for n, a in sorted(values.items())]
        mx.eval([a for *_, a in arrays])
        size = sum(a.nbytes for *_, a in arrays)
        with self._lock:
            offset = self.end
            self.end = -(-(offset + size) // _ALIGN) * _ALIGN
        at = offset
        for *_, a in arrays:
            view = memoryview(a).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], at + done)
            at += a.nbytes
        self.bytes_written += size
        self._unsynced += size
        if self._unsynced >= _SYNC_EVERY and not self.keep_cached:
            # Written pages linger in the page cache, dirty then clean: flushed, they can be dropped.
            getattr(os, "fdatasync", os.fsync)(self.fd)
            _drop_cached(self.fd, 0, 0)
            self._unsynced = 0
        return Extent(self, offset, tuple((side, n, a.dtype, tuple(a.shape)) for side, n, a in arrays), size)

    def read_into(self, extent: Extent, views: list[memoryview]) -> None:
        """Fill `views` (one per part, of evaluated arrays shaped as the parts) from `extent`."""
        want, offset = extent.nbytes, extent.offset
        while want:
            got = os.preadv(self.fd, views, offset)
            if got <= 0:
                raise OSError(f"the KV page file ended {want} bytes early")
            want -= got
            offset += got
            views = _advance(views, got)
        if not self.keep_cached:
            _drop_cached(self.fd, extent.offset, extent.nbytes)

    def close(self) -> None:
        """Free the file's space now (otherwise when the last reference goes)."""
        self._file.close()


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """`views` with their first n bytes consumed (a short read)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _drop_cached(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class PageReader:
    """One sequence's reads of its disk layers: the next disk layer's segments are read
    by a thread while the current one computes, into one of two flat byte buffers
    (slots) reused across layers and steps, each part of a segment a view into its slot
    (layers' part shapes differ: a calibrated format's channel groups are per layer).
    Figures: bytes read, seconds the reader spent, seconds attention waited."""

    SLACK = 1.125  # a slot made for a larger layer takes this much more: the context grows (justfit.planning.planner)

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-pages")
        self._free: list[mx.array] = []  # slots not in use
        self._held: dict[int, tuple[tuple[Extent, ...], list[list[mx.array]], Future, mx.array]] = {}
        self.order: list = []  # the page stores read through this reader, in forward order
        self.bytes_read = 0
        self.read_s = 0.0
        self.wait_s = 0.0

    def _slot(self, need: int) -> mx.array:
        """A free slot of at least `need` bytes; at most two slots live (in use or free)."""
        fits = [i for i, s in enumerate(self._free) if s.nbytes >= need]
        if fits:  # (by index: arrays compare elementwise)
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if self._free and len(self._free) + len(self._held) >= 2:
            self._free.pop(0)  # too small: given back before a larger one is made
        slot = mx.zeros((int(need * self.SLACK),), dtype=mx.uint8)
        mx.eval(slot)
        return slot

    def _read(self, extents: tuple[Extent, ...], views: list[list[memoryview]]) -> None:
        # the reader thread: no MLX call here, only reads into memory the slot owns
        start = time.perf_counter()
        for extent, parts in zip(extents, views):
            extent.file.read_into(extent, parts)
            self.bytes_read += extent.nbytes
        self.read_s += time.perf_counter() - start

    def schedule(self, key: int, extents: tuple[Extent, ...]) -> None:
        """Start reading `extents` for layer `key` (a no-op when already held)."""
        if key in self._held or not extents:
            return
        sizes = [[-(-_nbytes(d, s) // _PART_ALIGN) * _PART_ALIGN for *_, d, s in e.parts] for e in extents]
        slot = self._slot(sum(map(sum, sizes)))
        whole = _writable(slot)
        buffers, views, at = [], [], 0
        for extent, padded in zip(extents, sizes):
            arrays, parts = [], []
            for (_, _, dtype, shape), size in zip(extent.parts, padded):
                n = _nbytes(dtype, shape)
                arrays.append(slot[at:at + n].view(dtype).reshape(shape))
                parts.append(whole[at:at + n])
                at += size
            buffers.append(arrays)
            views.append(parts)
        self._held[key] = (extents, buffers, self._pool.submit(self._read, extents, views), slot)

    def take(self, key: int, extents: tuple[Extent, ...]) -> dict[Extent, list[mx.array]]:
        """`extents` read into buffers (waiting for a scheduled read, reading what was
        not scheduled now): each extent's part arrays, in its parts' order."""
        held = self._held.get(key)
        if held is not None and held[0] != extents:
            self.release(key)  # the layer spilled or trimmed since: read it again
            held = None
        if held is None:
            self.schedule(key, extents)
            held = self._held.get(key)
            if held is None:
                return {}
        start = time.perf_counter()
        held[2].result()
        self.wait_s += time.perf_counter() - start
        return dict(zip(held[0], held[1]))

    def release(self, key: int) -> None:
        """Give layer `key`'s slot back for reuse (after its attention is evaluated)."""
        held = self._held.pop(key, None)
        if held is None:
            return
        held[2].result()  # never reuse a slot a read is still filling
        self._free.append(held[3])

    def after(self, key: int):
        """The store read after the one whose id is `key` (the first again after the last)."""
        for i, store in enumerate(self.order):
            if id(store) == key:
                return self.order[(i + 1) % len(self.order)]
        return None

    def close(self) -> None:
        """Wait for reads in flight and stop the reader thread."""
        for key in list(self._held):
            self.release(key)
        self._free.clear()
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class SpilledPart:
    """One part of a spilled segment's storage, standing in for its array where a
    snapshot is written (statetrans): read piece by piece as it is written, never all
    of a state's pages at once."""

    extent: Extent
    index: int

    @property
    def dtype(self) -> mx.Dtype:
        """The part's dtype."""
        return self.extent.parts[self.index][2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The part's shape."""
        return self.extent.parts[self.index][3]

    @property
    def nbytes(self) -> int:
        """The part's bytes."""
        return _nbytes(self.dtype, self.shape)

    def read_into(self, buffer: memoryview, offset: int = 0) -> int:
        """Fill `buffer` with the part's bytes from `offset` on; how many were read."""
        start = self.extent.offset + sum(_nbytes(d, s) for *_, d, s in self.extent.parts[:self.index])
        want = min(len(buffer), self.nbytes - offset)
        got = 0
        while got < want:
            n = os.preadv(self.extent.file.fd, [buffer[got:want]], start + offset + got)
            if n <= 0:
                raise OSError("the KV page file ended early")
            got += n
        if not self.extent.file.keep_cached:
            _drop_cached(self.extent.file.fd, start + offset, want)
        return got

    def read(self) -> mx.array:
        """The part as an array (read now)."""
        b = mx.zeros(self.shape, dtype=self.dtype)
        mx.eval(b)
        self.read_into(_writable(b))
        return b


def segment_arrays(extent: Extent, buffers: list[mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """A spilled segment's keys and values storage, from its extent's part buffers."""
    keys = {n: b for (side, n, _, _), b in zip(extent.parts, buffers) if side == "k"}
    values = {n: b for (side, n, _, _), b in zip(extent.parts, buffers) if side == "v"}
    return keys, values


def read_now(extent: Extent) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """A spilled segment's storage read into new arrays (trimming, exporting)."""
    buffers = []
    for _, _, dtype, shape in extent.parts:
        b = mx.zeros(shape, dtype=dtype)
        mx.eval(b)
        buffers.append(b)
    extent.file.read_into(extent, [_writable(b) for b in buffers])
    return segment_arrays(extent, buffers)


def spilled_parts(extent: Extent) -> tuple[dict[str, SpilledPart], dict[str, SpilledPart]]:
    """A spilled segment's keys and values storage as parts read when written."""
    parts = [SpilledPart(extent, i) for i in range(len(extent.parts))]
    return segment_arrays(extent, parts)
