"""Disk quotas of stored states: the default size of a state directory, its split
between named sessions and anonymous states, and the sessions' quota.

Sessions are counted apart from anonymous states (a prefix cache's churn never evicts
a conversation). Past their limit the least recently touched sessions go first
(touched: written or resumed, by any process: a session folder's mtime); one touched
within `keep_s` goes only when nothing older is left, and each write says how many
such recent sessions it had to evict. The session just written is never evicted, so
the newest sessions are the ones kept."""

from __future__ import annotations

import heapq
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from statetrans.sessions import SessionStore

log = logging.getLogger("justfit.statetrans")

STATE_DISK_CAP = 20 * 2**30  # the default state directory size at most ...
FREE_SHARE = 0.5  # ... and at most this share of the free space where it lives
SESSION_SHARE = 0.75  # of the total, what sessions may hold (the rest: anonymous states)
SESSION_KEEP_S = 600.0  # a session touched this recently is "recent"
REFRESH_S = 30.0  # the ledger is re-read from disk this often (other processes write too)


def default_state_disk(path: str | Path) -> int:
    """A state directory's default size: the smaller of 20 GiB and half the free space
    of the file system that holds (or will hold) `path`."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return STATE_DISK_CAP
    return int(min(STATE_DISK_CAP, free * FREE_SHARE))


def split_state_disk(total: int) -> tuple[int, int]:
    """(sessions' limit, anonymous states' limit) of a state directory of `total` bytes:
    sessions 3/4 (user data), anonymous states the remaining 1/4 (a cache)."""
    sessions = int(total * SESSION_SHARE)
    return sessions, total - sessions


@dataclass
class Usage:
    """A session folder's bytes on disk and when it was last touched (its mtime)."""

    bytes: int
    touched: float


class SessionQuota:
    """The sessions' disk limit over one model's session folders (all scopes, all
    processes): a ledger of their sizes, kept by this process's writes and re-read
    from disk every REFRESH_S, and the eviction that keeps them within the limit."""

    def __init__(self, limit: int | None = None, keep_s: float = SESSION_KEEP_S, refresh_s: float = REFRESH_S):
        self.limit, self.keep_s, self.refresh_s = limit, keep_s, refresh_s
        self._ledger: dict[str, Usage] = {}  # folder name -> usage
        self._read_at: float | None = None  # monotonic time the ledger was read from disk
        self._lock = threading.Lock()
        self.evicted = self.evicted_recent = 0  # sessions evicted in all, and of those recent ones

    @property
    def total(self) -> int:
        """Bytes the sessions take on disk, as the ledger knows it."""
        with self._lock:
            return sum(u.bytes for u in self._ledger.values())

    def noted(self, folder: str, usage: Usage | None) -> None:
        """Folder `folder` now holds `usage` (None: it is gone)."""
        with self._lock:
            if usage is None:
                self._ledger.pop(folder, None)
            else:
                self._ledger[folder] = usage

    def enforce(self, store: SessionStore, spare: str) -> list[tuple[str, bool]]:
        """Evict the least recently touched sessions, never folder `spare` (the one just
        written), until the sessions fit the limit; (folder, was recent) of each."""
        if self.limit is None:
            return []
        with self._lock:
            if self._read_at is None or time.monotonic() - self._read_at > self.refresh_s:
                self._ledger = store.usage()
                self._read_at = time.monotonic()
            total = sum(u.bytes for u in self._ledger.values())
            if total <= self.limit:
                return []
            evicted = []
            now = time.time()
            heap = [(u.touched, f) for f, u in self._ledger.items() if f != spare]
            heapq.heapify(heap)
            while total > self.limit and heap:
                touched, folder = heapq.heappop(heap)
                usage = self._ledger.get(folder)
                if usage is None or usage.touched != touched:
                    continue
                fresh = store.folder_usage(folder)  # another process may have used it since
                if fresh is None:
                    total -= self._ledger.pop(folder).bytes
                    continue
                if fresh.touched > usage.touched:
                    total += fresh.bytes - usage.bytes
                    self._ledger[folder] = fresh
                    heapq.heappush(heap, (fresh.touched, folder))
                    continue
                if not store.drop_folder(folder):  # a live process is writing it
                    continue
                total -= self._ledger.pop(folder).bytes
                evicted.append((folder, now - fresh.touched < self.keep_s))
            self.evicted += len(evicted)
            self.evicted_recent += sum(recent for _, recent in evicted)
        if evicted:
            log.info("session quota: evicted %d sessions (%d recent) to stay within %d bytes",
                     len(evicted), sum(recent for _, recent in evicted), self.limit)
        return evicted
