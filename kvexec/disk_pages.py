"""KV pages on disk: a residency level for a layer's pages.

A layer planned on disk writes each segment once it is full (`PageFile.write`: the
storage's bytes, unchanged) and drops it from memory; its sinks, hot window and the
segment being filled stay resident. Attention reads the layer's segments back just in
time (`PageReader`): while one layer computes, a reader thread reads the next disk
layer's segments into buffers reused from step to step, so at most two layers' pages
are in memory at once, whatever the context. The bytes read are the bytes written, so
attention over them is exactly attention over resident pages.

The page file is named (`kv-pages-*.bin`, mode 0600) and held under an exclusive
`flock` for the owner's life: a stored state publishes its pages by linking that file
into its snapshot (statetrans.snapshot), not by writing them again, and the next
process in the folder removes the name a killed owner left (`sweep`: a lock it can take
has no owner; a name removed never frees what a snapshot links or a process holds
open). Each part's sha256 is taken as it is written, so a snapshot can vouch for bytes
it did not write. Read pages are dropped from the OS page cache unless `keep_cached`
(the cache is memory that no process is charged for; a budget that only holds because
of it does not hold).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

_ALIGN = 4096  # extents start on page boundaries (what direct I/O and readahead like)
_SYNC_EVERY = 64 << 20  # written bytes between flushes to disk (dirty pages are memory too)
_PART_ALIGN = 64  # a part's offset in a read slot: any dtype's view of it is aligned
PREFIX, SUFFIX = "kv-pages-", ".bin"


@dataclass(frozen=True)
class Extent:
    """Where one spilled segment's storage lies in a page file: its parts (side, name,
    dtype, shape) back to back from `offset`."""

    file: PageFile
    offset: int
    parts: tuple[tuple[str, str, mx.Dtype, tuple[int, ...]], ...]
    nbytes: int
    sha256: tuple[str, ...] = ()  # of each part's bytes, taken as they were written


def _nbytes(dtype: mx.Dtype, shape: tuple[int, ...]) -> int:
    n = dtype.size
    for s in shape:
        n *= s
    return n


def _writable(a: mx.array) -> memoryview:
    return memoryview(a).cast("B")


class PageFile:
    """An append-only file of spilled segments in `folder`, named and locked while this
    process owns it (see the module's note). Extents are written once and never change,
    so copies of a cache, and snapshots linking the file, share them."""

    def __init__(self, folder: str | os.PathLike, keep_cached: bool = False):
        os.makedirs(folder, exist_ok=True)
        self.fd, self.path = tempfile.mkstemp(dir=folder, prefix=PREFIX, suffix=SUFFIX)
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # held while this process lives: `sweep` leaves the file alone
        self.owned = True
        self.keep_cached = keep_cached
        if not keep_cached and hasattr(fcntl, "F_NOCACHE"):  # macOS: no posix_fadvise, this instead
            fcntl.fcntl(self.fd, fcntl.F_NOCACHE, 1)
        self._lock = threading.Lock()
        self.end = 0
        self._unsynced = 0
        self.bytes_written = 0

    @classmethod
    def existing(cls, path: str | os.PathLike) -> PageFile:
        """A page file a snapshot links, opened to read (never written, never removed
        here); OSError when `path` is not a regular file (a link is not followed)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
        file = cls.__new__(cls)
        file.fd, file.path, file.owned, file.keep_cached = fd, str(path), False, False
        file._lock, file.end, file._unsynced, file.bytes_written = threading.Lock(), os.fstat(fd).st_size, 0, 0
        return file

    def write(self, keys: dict[str, mx.array], values: dict[str, mx.array]) -> Extent:
        """Append a segment's storage (its arrays evaluated); where it went."""
        arrays = [("k", n, mx.contiguous(a)) for n, a in sorted(keys.items())] + \
            [("v", n, mx.contiguous(a)) for n, a in sorted(values.items())]
        mx.eval([a for *_, a in arrays])
        size = sum(a.nbytes for *_, a in arrays)
        with self._lock:
            offset = self.end
            self.end = -(-(offset + size) // _ALIGN) * _ALIGN
        at, digests = offset, []
        for *_, a in arrays:
            view = memoryview(a).cast("B")
            digests.append(hashlib.sha256(view).hexdigest())
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
        return Extent(self, offset, tuple((side, n, a.dtype, tuple(a.shape)) for side, n, a in arrays), size,
                      tuple(digests))

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

    def sync(self) -> None:
        """Make every extent written so far durable (before a snapshot names them)."""
        getattr(os, "fdatasync", os.fsync)(self.fd)

    def close(self) -> None:
        """Remove this process's name for the file and close it: its space is freed now
        unless a snapshot links it (otherwise when the last reference goes)."""
        if self.fd < 0:
            return
        if self.owned:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # removed by hand: the open file is ours all the same
                pass
        os.close(self.fd)
        self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit `os` may already be gone
            pass


def sweep(folder: str | os.PathLike) -> int:
    """Remove page files in `folder` whose owner is gone (their lock can be taken);
    how many. Only names go: a snapshot linking one keeps its pages."""
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX) and n.endswith(SUFFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner runs
            os.unlink(path)
            removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


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

    SLACK = 1.125  # a slot made for a larger layer takes this much more: the context grows (justfit.planning.cost_model)

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

    @property
    def offset(self) -> int:
        """Where the part starts in its page file."""
        return self.extent.offset + sum(_nbytes(d, s) for *_, d, s in self.extent.parts[:self.index])

    @property
    def sha256(self) -> str | None:
        """The sha256 of the part's bytes, taken when they were written (None: not known)."""
        return self.extent.sha256[self.index] if self.extent.sha256 else None

    def read_into(self, buffer: memoryview, offset: int = 0) -> int:
        """Fill `buffer` with the part's bytes from `offset` on; how many were read."""
        start = self.offset
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


def joined(keys: dict[str, SpilledPart], values: dict[str, SpilledPart]) -> Extent | None:
    """One extent holding a segment's parts, where they lie back to back in one page file
    in the order `PageFile.write` puts them (a restored snapshot's pages, read from its
    linked file as they were spilled); None otherwise."""
    parts = [("k", n, p) for n, p in sorted(keys.items())] + [("v", n, p) for n, p in sorted(values.items())]
    if not parts:
        return None
    file, start, at = parts[0][2].extent.file, parts[0][2].offset, parts[0][2].offset
    for _, _, p in parts:
        if p.extent.file is not file or p.offset != at:
            return None
        at += p.nbytes
    digests = tuple(p.sha256 for *_, p in parts)
    return Extent(file, start, tuple((side, n, p.dtype, p.shape) for side, n, p in parts), at - start,
                  digests if all(digests) else ())


def spilled_parts(extent: Extent) -> tuple[dict[str, SpilledPart], dict[str, SpilledPart]]:
    """A spilled segment's keys and values storage as parts read when written."""
    parts = [SpilledPart(extent, i) for i in range(len(extent.parts))]
    return segment_arrays(extent, parts)
