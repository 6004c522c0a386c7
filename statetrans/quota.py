"""Disk quotas of stored states: the default size of a state directory, its split
between named sessions, anonymous states and the quarantine, the shares of scopes,
and the sessions' quota.

Sessions are counted apart from anonymous states (a prefix cache's churn never evicts
a conversation); the quarantine's bytes come out of the anonymous states' part. Past
their limit the least recently touched sessions go first (touched: written or resumed,
by any process: a session folder's mtime); one touched within `keep_s` goes only when
nothing older is left, and each write says how many such recent sessions it had to
evict. The session just written is never evicted, so the newest sessions are the ones
kept.

Where the limit is divided among scopes (a server's API keys), each of them has an
equal share of it and a write evicts only its own scope's sessions, never another's;
states of scopes without a share (written before the keys changed, say) share what the
others leave of the limit."""

from __future__ import annotations

import heapq
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Iterable

from statetrans.sessions import SessionStore, Usage

log = logging.getLogger("justfit.statetrans")

STATE_DISK_CAP = 20 * 2**30  # the default state directory size at most ...
FREE_SHARE = 0.5  # ... and at most this share of the free space where it lives
SESSION_SHARE = 0.75  # of the total, what sessions may hold (the rest: anonymous states)
QUARANTINE_SHARE = 0.05  # of the total, what the quarantine may hold (out of the anonymous states' part)
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


def quarantine_limit(total: int, anonymous: int) -> int:
    """The quarantine's limit in a state directory of `total` bytes whose anonymous
    states may hold `anonymous`: 1/20 of the total, at most the anonymous part (whose
    bytes it takes)."""
    return max(0, min(int(total * QUARANTINE_SHARE), anonymous))


def share(limit: int, scope: str, scopes: frozenset[str]) -> int | None:
    """`scope`'s own share of `limit` when the limit is divided among `scopes` (equal
    parts); None when `scope` has none (then it shares what the others leave)."""
    return limit // len(scopes) if scope in scopes else None


class SessionQuota:
    """The sessions' disk limit over one model's session folders (all scopes, all
    processes), divided among `scopes` when there are any: a ledger of their sizes,
    kept by this process's writes and re-read from disk every REFRESH_S, and the
    eviction that keeps them within the limit and each scope within its share."""

    def __init__(self, limit: int | None = None, keep_s: float = SESSION_KEEP_S, refresh_s: float = REFRESH_S,
                 scopes: frozenset[str] = frozenset()):
        self.limit, self.keep_s, self.refresh_s, self.scopes = limit, keep_s, refresh_s, scopes
        self._ledger: dict[str, Usage] = {}  # folder name -> usage
        self._scopes: dict[str, str] = {}  # folder name -> its scope (a folder's name is bound to its scope)
        self._read_at: float | None = None  # monotonic time the ledger was read from disk
        self._lock = threading.Lock()
        self.evicted = self.evicted_recent = 0  # sessions evicted in all, and of those recent ones

    def shared_among(self, scopes: Iterable[str]) -> SessionQuota:
        """This quota's limit divided among `scopes` instead (none: one share for all): a
        new quota, whose ledger is read from disk at its first enforcement."""
        return SessionQuota(self.limit, self.keep_s, self.refresh_s, frozenset(scopes))

    @property
    def total(self) -> int:
        """Bytes the sessions take on disk, as the ledger knows it."""
        with self._lock:
            return sum(u.bytes for u in self._ledger.values())

    def noted(self, folder: str, usage: Usage | None, scope: str | None = None) -> None:
        """Folder `folder` (of `scope`, when known) now holds `usage` (None: it is gone)."""
        with self._lock:
            if usage is None:
                self._ledger.pop(folder, None)
                self._scopes.pop(folder, None)
                return
            self._ledger[folder] = usage
            if scope is not None:
                self._scopes[folder] = scope

    def scope_bytes(self, store: SessionStore, scope: str) -> int:
        """Bytes `scope`'s sessions take on disk, as the ledger knows it."""
        with self._lock:
            return sum(u.bytes for f, u in self._ledger.items() if self._scope_of(store, f) == scope)

    def enforce(self, store: SessionStore, spare: str, scope: str = "") -> list[tuple[str, bool]]:
        """Evict the least recently touched sessions, never folder `spare` (the one just
        written, of `scope`), until `scope`'s sessions fit its share (when the limit is
        divided) and then the sessions of scopes without a share fit what the others
        leave of the limit; (folder, was recent) of each."""
        if self.limit is None:
            return []
        with self._lock:
            if self._read_at is None or time.monotonic() - self._read_at > self.refresh_s:
                self._ledger = store.usage()
                self._scopes = {f: s for f, s in self._scopes.items() if f in self._ledger}
                self._read_at = time.monotonic()
            evicted: list[tuple[str, bool]] = []
            own = share(self.limit, scope, self.scopes)
            if own is not None:
                self._evict(store, {f for f in self._ledger if self._scope_of(store, f) == scope}, own, spare, evicted)
            rest = {f for f in self._ledger if self._scope_of(store, f) not in self.scopes}
            shared = sum(u.bytes for f, u in self._ledger.items() if f not in rest)  # each within its share
            self._evict(store, rest, self.limit - shared, spare, evicted)
            self.evicted += len(evicted)
            self.evicted_recent += sum(recent for _, recent in evicted)
        if evicted:
            log.info("session quota: evicted %d sessions (%d recent) to stay within %d bytes",
                     len(evicted), sum(recent for _, recent in evicted), self.limit)
        return evicted

    def _scope_of(self, store: SessionStore, folder: str) -> str | None:
        """Folder `folder`'s scope (None: unknown, or no division to know it for)."""
        if not self.scopes:
            return None
        if folder not in self._scopes:
            found = store.folder_scope(folder)  # another process's session, or one from an earlier run
            if found is None:
                return None  # (not kept: it may be readable once its first generation is published)
            self._scopes[folder] = found
        return self._scopes[folder]

    def _evict(self, store: SessionStore, folders: set[str], limit: int, spare: str,
               evicted: list[tuple[str, bool]]) -> None:
        """Evict the least recently touched of `folders`, never `spare`, until they hold
        at most `limit` bytes; each as (folder, was recent) onto `evicted`."""
        total = sum(self._ledger[f].bytes for f in folders)
        if total <= limit:
            return
        now = time.time()
        heap = [(self._ledger[f].touched, f) for f in folders if f != spare]
        heapq.heapify(heap)
        while total > limit and heap:
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
            self._scopes.pop(folder, None)
            evicted.append((folder, now - fresh.touched < self.keep_s))
