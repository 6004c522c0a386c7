"""The memory tier's index: stored states by key, by token prefix (a radix trie) and
by session name, with an LRU clock. What lives where (memory, disk) is each entry's
own business; this file only finds and orders them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from statetrans.prefix import PrefixTrie


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


@dataclass
class Reuse:
    """What a request starts from: a state holding `tokens` (a prefix of its own)."""

    cache: list | None
    tokens: list[int]
    sampler: dict
    source: str  # "memory", "disk" or "" (nothing reusable)
    seconds: float = 0.0  # spent restoring
    session: str | None = None  # the entry was this session's

    @property
    def length(self) -> int:
        """Positions the reused state holds."""
        return len(self.tokens)


class Index:
    """Entries by key, token prefix and session, most recently used last."""

    def __init__(self) -> None:
        self.trie = PrefixTrie()
        self.entries: dict[str, Entry] = {}
        self.sessions: dict[str, str] = {}  # name -> entry key
        self._clock = itertools.count(1)

    # (list(...) copies in one step: the server reads these while its engine thread writes)
    @property
    def memory_bytes(self) -> int:
        """Bytes of the states held in memory."""
        return sum(e.nbytes for e in list(self.entries.values()) if e.cache is not None)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the states' disk copies."""
        return sum(e.disk_bytes for e in list(self.entries.values()) if e.path is not None)

    def touch(self, e: Entry) -> None:
        """Mark `e` as the most recently used."""
        e.used = next(self._clock)

    def add(self, e: Entry) -> Entry | None:
        """Index `e`; returns the session's previous entry it replaces, if any."""
        self.touch(e)
        self.entries[e.key] = e
        self.trie.insert(e.key, e.tokens)
        if not e.session:
            return None
        prev = self.sessions.get(e.session)
        self.sessions[e.session] = e.key
        return self.entries.get(prev) if prev != e.key else None

    def remove(self, e: Entry) -> None:
        """Forget `e`: by key, by prefix and by session name."""
        self.entries.pop(e.key, None)
        if e.key in self.trie:
            self.trie.remove(e.key)
        if e.session and self.sessions.get(e.session) == e.key:
            del self.sessions[e.session]

    def session(self, name: str) -> Entry | None:
        """Session `name`'s entry, or None."""
        key = self.sessions.get(name)
        return self.entries.get(key) if key is not None else None

    def same_tokens(self, tokens: list[int], session: str | None) -> Entry | None:
        """An entry holding exactly `tokens`, anonymous or `session`'s."""
        for n, key in self.trie.match(tokens):
            e = self.entries[key]
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
