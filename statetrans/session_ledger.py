"""What one model's session folders hold on disk, as this process knows it, and the
sessions' quota applied to them: the ledger owns the snapshot of their usage (kept by
this process's writes, re-read from disk every `refresh_s`: other processes write too),
asks the quota (statetrans.quota) what to evict, and evicts it through the store under
its lock: each folder read again first (another process may have used it since: then
it goes back in the order), never one a live process is writing into."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Iterable

from statetrans.quota import SessionQuota, Trim, unshared_limit
from statetrans.sessions import SessionStore, Usage

log = logging.getLogger("justfit.statetrans")


class SessionLedger:
    """The session folders' sizes, last touches and scopes, and the evictions `quota`
    decided on them (counted: `evicted`, and of those `evicted_recent`)."""

    def __init__(self, quota: SessionQuota):
        self.quota = quota
        self._ledger: dict[str, Usage] = {}  # folder name -> usage
        self._scopes: dict[str, str] = {}  # folder name -> its scope (a folder's name is bound to its scope)
        self._read_at: float | None = None  # monotonic time the ledger was read from disk
        self._lock = threading.Lock()
        self.evicted = self.evicted_recent = 0  # sessions evicted in all, and of those recent ones

    def shared_among(self, scopes: Iterable[str]) -> SessionLedger:
        """A new ledger for this quota divided among `scopes` instead (none: one share
        for all), read from disk at its first enforcement."""
        return SessionLedger(self.quota.shared_among(scopes))

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
        """Apply the quota after a write of folder `spare` (of `scope`): evict what it
        decides, least recently touched first, never `spare`; (folder, was recent) of each."""
        if self.quota.limit is None:
            return []
        with self._lock:  # one decision and its eviction at a time: the ledger stays whole
            if self._read_at is None or time.monotonic() - self._read_at > self.quota.refresh_s:
                self._ledger = store.usage()
                self._scopes = {f: s for f, s in self._scopes.items() if f in self._ledger}
                self._read_at = time.monotonic()
            scope_of = {f: self._scope_of(store, f) for f in self._ledger} if self.quota.scopes else {}
            evicted: list[tuple[str, bool]] = []
            for trim in self.quota.decide(self._ledger, scope_of, spare, scope):
                evicted += self._apply(store, trim)
            self.evicted += len(evicted)
            self.evicted_recent += sum(recent for _, recent in evicted)
        if evicted:
            log.info("session quota: evicted %d sessions (%d recent) to stay within %d bytes",
                     len(evicted), sum(recent for _, recent in evicted), self.quota.limit)
        return evicted

    def _scope_of(self, store: SessionStore, folder: str) -> str | None:
        """Folder `folder`'s scope (None: unknown, or no division to know it for)."""
        if not self.quota.scopes:
            return None
        if folder not in self._scopes:
            found = store.folder_scope(folder)  # another process's session, or one from an earlier run
            if found is None:
                return None  # (not kept: it may be readable once its first generation is published)
            self._scopes[folder] = found
        return self._scopes[folder]

    def _apply(self, store: SessionStore, trim: Trim) -> list[tuple[str, bool]]:
        """Evict `trim`'s folders in its order until they fit; (folder, was recent) of
        each. A folder touched since goes back in the order, one
        gone leaves the ledger, one a live process writes into is skipped."""
        total = sum(self._ledger[f].bytes for f in trim.folders if f in self._ledger)
        limit = unshared_limit(trim.limit, sum(self._ledger[f].bytes for f in trim.less if f in self._ledger))
        evicted: list[tuple[str, bool]] = []
        if total <= limit:
            return evicted
        now = time.time()
        heap = [(self._ledger[f].touched, f) for f in trim.order if f in self._ledger]
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
            if not store.drop_folder(folder):  # a live process is writing it (checked under the directory lock)
                continue
            total -= self._ledger.pop(folder).bytes
            self._scopes.pop(folder, None)
            evicted.append((folder, self.quota.recent(fresh.touched, now)))
        return evicted
