"""The stored states' index: stored states by key, by token prefix (a radix trie per
scope) and by (scope, session name), with an LRU clock. What lives where (memory,
disk) is each entry's own business; this file only finds and orders them.

A scope is whose states they are (e.g. a hash of a client's API key; "" is the
shared default): a lookup sees only its own scope's states, so no client can reuse,
read or count another's. The index takes a lock of its own, so the server may list or
drop a session from another thread while the engine's thread stores and takes states."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from statetrans.prefix import PrefixTrie
from statetrans.write_outcome import Write


@dataclass
class Entry:
    """One stored state: its tokens, where it is held (memory, disk or both) and its bookkeeping."""

    key: str
    tokens: list[int]
    cache: list | None = None  # in the memory tier
    nbytes: int = 0  # in memory
    path: Path | None = None  # on disk: an anonymous snapshot, or a session's generation
    disk_bytes: int = 0
    session: str | None = None
    sampler: dict = field(default_factory=dict)  # RNG position, continued on reuse
    trimmable: bool = True  # all layers can drop trailing positions (not recurrent state)
    used: int = 0  # LRU clock
    owner: dict | None = None  # who wrote the anonymous disk copy (sessions: unused)
    generation: int = 0  # a session's: the turn count its disk copy holds (or will)
    scope: str = ""  # whose state it is: only requests of the same scope see it
    touched: float = 0.0  # a session's: wall time of its last write or use
    base: int | None = None  # a session's: the generation its turn started from (None: unchecked)
    write: Write | None = None  # a session's: its latest write-through (None: nothing written through)


@dataclass
class Reuse:
    """What a request starts from: a state holding `tokens` (a prefix of its own)."""

    cache: list | None
    tokens: list[int]
    sampler: dict
    source: str  # "memory", "disk" or "" (nothing reusable)
    seconds: float = 0.0  # spent restoring
    session: str | None = None  # the entry was this session's
    base: int = 0  # the requested session's generation when the request started (0: none); put(base=...)

    @property
    def length(self) -> int:
        """Positions the reused state holds."""
        return len(self.tokens)


class Index:
    """Entries by key, by token prefix within their scope and by (scope, session), most
    recently used last."""

    def __init__(self) -> None:
        self.tries: dict[str, PrefixTrie] = {}  # scope -> its states' tokens
        self.entries: dict[str, Entry] = {}
        self.sessions: dict[tuple[str, str], str] = {}  # (scope, name) -> entry key
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # (list(...) copies in one step: the server reads these while its engine thread writes)
    @property
    def memory_bytes(self) -> int:
        """Bytes of the states held in memory."""
        return sum(e.nbytes for e in list(self.entries.values()) if e.cache is not None)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the states' disk copies."""
        return sum(e.disk_bytes for e in list(self.entries.values()) if e.path is not None)

    @property
    def anonymous_disk_bytes(self) -> int:
        """Bytes of the anonymous states' disk copies (what the anonymous disk limit bounds)."""
        return sum(e.disk_bytes for e in list(self.entries.values()) if e.path is not None and e.session is None)

    def touch(self, e: Entry) -> None:
        """Mark `e` as the most recently used."""
        e.used = next(self._clock)

    def add(self, e: Entry) -> Entry | None:
        """Index `e`; returns the session's previous entry it replaces, if any."""
        with self._lock:
            self.touch(e)
            self.entries[e.key] = e
            self.tries.setdefault(e.scope, PrefixTrie()).insert(e.key, e.tokens)
            if not e.session:
                return None
            prev = self.sessions.get((e.scope, e.session))
            self.sessions[e.scope, e.session] = e.key
            return self.entries.get(prev) if prev != e.key else None

    def remove(self, e: Entry) -> None:
        """Forget `e`: by key, by prefix and by session name."""
        with self._lock:
            self.entries.pop(e.key, None)
            trie = self.tries.get(e.scope)
            if trie is not None and e.key in trie:
                trie.remove(e.key)
                if not len(trie):
                    del self.tries[e.scope]
            self.unmap(e)

    def unmap(self, e: Entry) -> None:
        """`e` is no longer its session's entry (it stays indexed by key and prefix)."""
        with self._lock:
            if e.session and self.sessions.get((e.scope, e.session)) == e.key:
                del self.sessions[e.scope, e.session]

    def rename(self, e: Entry, name: str) -> None:
        """`e` becomes session `name`'s entry (its write was kept under another name);
        `e` out of the index already stays out."""
        with self._lock:
            self.unmap(e)
            e.session = name
            if e.key in self.entries:
                self.sessions[e.scope, name] = e.key

    def session(self, name: str, scope: str = "") -> Entry | None:
        """Session `name`'s entry in `scope`, or None."""
        key = self.sessions.get((scope, name))
        return self.entries.get(key) if key is not None else None

    def session_entries(self, scope: str | None = None) -> list[Entry]:
        """Every session's entry (of `scope`, if given)."""
        with self._lock:
            keys = [key for (s, _), key in self.sessions.items() if scope is None or s == scope]
            return [self.entries[k] for k in keys if k in self.entries]

    def session_counts(self) -> dict[str, int]:
        """How many sessions each scope holds."""
        with self._lock:
            return dict(Counter(s for s, _ in self.sessions))

    def match(self, tokens: list[int], scope: str = "") -> list[tuple[int, Entry]]:
        """(shared prefix length, entry) for `scope`'s states sharing a prefix with
        `tokens`, longest first (PrefixTrie.match); never another scope's."""
        with self._lock:
            trie = self.tries.get(scope)
            if trie is None:
                return []
            return [(n, self.entries[k]) for n, k in trie.match(tokens) if k in self.entries]

    def same_tokens(self, tokens: list[int], session: str | None, scope: str = "") -> Entry | None:
        """An entry of `scope` holding exactly `tokens`, anonymous or `session`'s."""
        for n, e in self.match(tokens, scope):
            if n == len(tokens) == len(e.tokens) and e.session in (None, session):
                return e
        return None

    def in_memory(self, spare: Entry | None = None) -> list[Entry]:
        """Entries held in memory, least recently used first."""
        return sorted((e for e in list(self.entries.values()) if e.cache is not None and e is not spare),
                      key=lambda e: e.used)

    def anonymous_on_disk(self) -> list[Entry]:
        """Anonymous entries with a disk copy, least recently used first."""
        return sorted((e for e in list(self.entries.values()) if e.path is not None and e.session is None),
                      key=lambda e: e.used)


def cache_nbytes(cache: list) -> int:
    """Bytes a cache list holds in memory."""
    return sum(_nbytes(c) for c in cache)


def _nbytes(c) -> int:
    n = getattr(c, "nbytes", None)
    return n if isinstance(n, int) else sum(a.nbytes for a in c.state if isinstance(a, mx.array))
