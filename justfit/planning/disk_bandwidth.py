"""A KV folder's sequential read rate, for what pages on disk cost a decoded token
(justfit.planning.disk_plan): given (`parse_bandwidth`), or measured on the folder with a
short read past the page cache (`measure_bandwidth`; in a thread for a server,
`LazyBandwidth`), and whether the folder can hold pages at all (`writable_folder`)."""

from __future__ import annotations

import mmap
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

# Decimal and binary units of a bandwidth; a bare number is bytes a second.
_BANDWIDTH_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BANDWIDTH = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/\s*s)?\s*")
# The probe: long enough to be past a drive's burst, short enough for a command (~0.1 s at 1-2 GB/s).
PROBE_BYTES = 128 << 20
_BLOCK = 4 << 20


def parse_bandwidth(text: str | float) -> float:
    """'6GB/s', '500 MB/s', '2GiB/s', '6e9' -> bytes a second (above zero)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _BANDWIDTH.fullmatch(text)
        if not m or m.group(2).lower() not in _BANDWIDTH_UNITS:
            raise ValueError(f"not a bandwidth: {text!r} (try 6GB/s, 500MB/s, 2GiB/s or bytes a second)")
        value = float(m.group(1)) * _BANDWIDTH_UNITS[m.group(2).lower()]
    if not value > 0:
        raise ValueError(f"a bandwidth is above zero: {text!r}")
    return value


def writable_folder(folder: str) -> str:
    """`folder`, made if missing and checked by writing a file there; ValueError if it
    cannot hold pages."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(dir=folder, prefix=".justfit-probe-")
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        raise ValueError(f"cannot write KV pages to {folder}: {e.strerror or e}") from None
    return folder


@dataclass(frozen=True)
class Bandwidth:
    """A sequential read rate and where it comes from."""

    bytes_per_s: float
    method: str  # "given", or how the probe kept the page cache out of it

    def as_dict(self) -> dict:
        """The figures by name, for JSON."""
        return {"bytes_per_s": round(self.bytes_per_s), "method": self.method}


def measure_bandwidth(folder: str, nbytes: int = PROBE_BYTES) -> Bandwidth:
    """Read a temporary file of `nbytes` in `folder` once, sequentially, past the page
    cache: O_DIRECT where the system and file system take it, else the file's cached
    pages dropped (F_NOCACHE on macOS, as the page file itself reads; posix_fadvise
    elsewhere) before reading; the method says which. The file is removed."""
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".justfit-bandwidth-")
    try:
        block = os.urandom(1 << 20) * (_BLOCK >> 20)  # random: no file system compresses it away
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        written = 0
        while written < nbytes:
            written += os.write(fd, block[:min(_BLOCK, nbytes - written)])
        os.fsync(fd)
        method = "page cache bypassed (F_NOCACHE)" if sys.platform == "darwin" else "page cache dropped (fadvise)"
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif sys.platform != "darwin":
            method = "page cache not bypassed: an upper bound"
        os.close(fd)
        fd = -1
        read_fd = None
        if hasattr(os, "O_DIRECT"):
            try:
                read_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                method = "O_DIRECT"
            except OSError:  # tmpfs and some others refuse it
                read_fd = None
        if read_fd is None:
            read_fd = os.open(path, os.O_RDONLY)
            if sys.platform == "darwin":
                import fcntl

                fcntl.fcntl(read_fd, fcntl.F_NOCACHE, 1)
        buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
        try:
            done, start = 0, time.perf_counter()
            while done < nbytes:
                n = os.readv(read_fd, [buf])
                if n <= 0:
                    break
                done += n
            seconds = time.perf_counter() - start
        except OSError:  # O_DIRECT opened but refused the read: once more, through the cache's drop
            os.close(read_fd)
            return _buffered(path, nbytes)
        finally:
            buf.close()
        os.close(read_fd)
        return Bandwidth(done / max(seconds, 1e-9), method)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def _buffered(path: str, nbytes: int) -> Bandwidth:
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start, done = time.perf_counter(), 0
        while done < nbytes:
            chunk = os.read(fd, _BLOCK)
            if not chunk:
                break
            done += len(chunk)
        return Bandwidth(done / max(time.perf_counter() - start, 1e-9), "page cache dropped (fadvise)")
    finally:
        os.close(fd)


class LazyBandwidth:
    """A folder's read rate, measured once in a thread on first asked for (a server's
    status must not wait for it): None until measured."""

    def __init__(self, folder: str, given: str | float | None = None):
        self.folder = folder
        self.value: Bandwidth | None = Bandwidth(parse_bandwidth(given), "given") if given is not None else None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._thread = None

    def get(self) -> Bandwidth | None:
        """The rate if measured; starts measuring on the first call."""
        with self._lock:
            if self.value is None and self._thread is None and self.error is None:
                self._thread = threading.Thread(target=self._measure, name="kv-disk-bandwidth", daemon=True)
                self._thread.start()
        return self.value

    def wait(self, timeout: float | None = None) -> Bandwidth | None:
        """The rate, waiting up to `timeout` seconds for a measurement in flight (tests, CLIs)."""
        self.get()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.value

    def _measure(self) -> None:
        try:
            self.value = measure_bandwidth(self.folder)
        except OSError as e:
            self.error = str(e)
