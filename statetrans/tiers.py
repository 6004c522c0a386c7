"""Stored serving states in two tiers, memory (bounded in bytes) and disk, indexed by
token prefix.

A state is anonymous (a prefix-cache entry: reusable by any request whose tokens
share its prefix; spilled to `anon/` when memory is short, deleted when the disk tier
is full) or a named session's: user data, written through to disk at the end of every
turn (statetrans.writer) as the session's next generation (statetrans.sessions), and
deleted only by `drop`.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import uuid
import weakref
from pathlib import Path

import mlx.core as mx

from kvexec.export import can_trim
from statetrans.disk import locked, sweep_temporaries
from statetrans.disk_tier import DiskTier
from statetrans.faults import Faults
from statetrans.identity import identity_key, read_checked
from statetrans.memory_tier import Entry, Index, Reuse, cache_nbytes
from statetrans.reuse import take
from statetrans.sessions import SessionStore
from statetrans.snapshot import SnapshotError, load_snapshot
from statetrans.state import capture, copy_cache
from statetrans.writer import Job, WriteThrough

log = logging.getLogger("justfit.statetrans")


class StateTiers:
    """Stored states in memory and on disk, found by token prefix (see the module doc)."""

    def __init__(self, directory: str | Path, identity: dict, layers: int,
                 memory_limit: int, disk_limit: int, faults: Faults | None = None):
        self.identity, self.layers = identity, layers
        self.dir = Path(directory).expanduser() / identity_key(identity)
        self.memory_limit, self.disk_limit = memory_limit, disk_limit
        self.faults = faults if faults is not None else Faults.from_env()
        self.index = Index()
        self.disk = DiskTier(self.dir, identity, self.faults)
        self.store = SessionStore(self.dir, identity, self.faults)
        self.writer = WriteThrough(self.store)
        self.last: Entry | None = None  # the most recently stored state
        self.spilled = self.restored = 0  # counts, for stats
        self.failures: list[str] = []  # spills that could not be written (the state stayed in memory)
        self._scan()
        _flush_at_exit(self)

    @property
    def entries(self) -> dict[str, Entry]:
        """Every indexed state by key."""
        return self.index.entries

    @property
    def sessions(self) -> dict[str, str]:
        """Session name -> its state's key."""
        return self.index.sessions

    @property
    def memory_bytes(self) -> int:
        """Bytes of the states held in memory."""
        return self.index.memory_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the states on disk."""
        return self.index.disk_bytes

    # -- storing --------------------------------------------------------------------
    def put(self, tokens: list[int], cache: list, session: str | None = None,
            sampler: dict | None = None) -> Entry:
        """Keep `cache` (holding exactly `tokens`) in the memory tier; a session's state
        is also queued for its next generation on disk. It replaces an anonymous state
        with the same tokens; the session's previous state, if still in memory, stays
        as an anonymous one (a checkpoint the LRU tiers bound)."""
        mx.eval([c.state for c in cache])  # nothing pending is stored half-done
        same = self.index.same_tokens(tokens, session)
        if same is not None and same.session is None:
            self._forget(same)
        e = Entry(uuid.uuid4().hex[:16], list(tokens), cache, cache_nbytes(cache), session=session,
                  sampler=dict(sampler or {}), trimmable=can_trim(cache, 0))
        prev = self.index.add(e)
        self.last = e
        if session:
            e.generation = (prev.generation if prev is not None else 0) + 1
            if prev is not None:
                self._retire(prev)
            arrays, layers = capture(cache)
            self.writer.submit(self._job(e, arrays, layers))
        return e

    def _job(self, e: Entry, arrays: dict[str, mx.array], layers: list[dict]) -> Job:
        meta = json.loads(json.dumps({**self.identity, "tokens": e.tokens, "layers": layers, "sampler": e.sampler}))
        return Job(e, {k: copy.copy(v) for k, v in arrays.items()}, meta)

    def _retire(self, prev: Entry) -> None:
        """A session's superseded state: an anonymous checkpoint if still in memory
        (its disk copy is the session's, removed once the newer one is durable)."""
        if prev.cache is None:
            self.index.remove(prev)
            return
        prev.session, prev.path, prev.disk_bytes, prev.generation = None, None, 0, 0

    def _forget(self, e: Entry) -> None:
        """Out of the index; an anonymous disk copy is deleted (if this process may),
        a session's never (only `drop` does)."""
        self.index.remove(e)
        if e.session is None and e.path is not None:
            self.disk.delete(e)
        if self.last is e:
            self.last = None
        e.cache = None

    # -- reuse ----------------------------------------------------------------------
    def take(self, tokens: list[int], session: str | None = None, memory_limit: int | None = None) -> Reuse:
        """The stored state sharing the longest usable prefix with `tokens`, detached
        for the request to extend (statetrans.reuse.take)."""
        return take(self, tokens, session, memory_limit)

    def release(self, e: Entry, stays: bool) -> None:
        """After `e`'s state was handed out: keep it indexed (`stays`) or forget it."""
        if stays:
            self.index.touch(e)
        else:
            self._forget(e)

    def load(self, e: Entry) -> list | None:
        """`e`'s state read from disk; None when it cannot be (then a damaged anonymous
        state is forgotten, a damaged session generation gives way to its previous one)."""
        if e.session is not None:
            self.writer.wait(e.session)
        if e.path is None:
            return None
        try:
            return self.read(e.path)[0]
        except SnapshotError as err:
            log.warning("not reusing a stored state: %s", err)
            if e.session is None:
                self._forget(e)
                return None
            self.index.remove(e)
            older = self.store.find(e.session, below=e.generation)
            if older is not None:
                self._adopt(older)
            return None

    # -- tiers ----------------------------------------------------------------------
    def fit(self, memory_limit: int | None = None, spare: Entry | None = None) -> None:
        """Spill least recently used states to disk until the memory tier holds at
        most `memory_limit` (default: the tier's own limit), then delete the least
        recently used anonymous snapshots past the disk limit (this process's, or a
        dead process's: never another live one's)."""
        limit = self.memory_limit if memory_limit is None else min(memory_limit, self.memory_limit)
        total = self.memory_bytes
        for e in self.index.in_memory(spare):
            if total <= limit:
                break
            if self.spill(e):
                total -= e.nbytes
        total = self.disk_bytes
        for e in self.index.anonymous_on_disk():
            if total <= self.disk_limit:
                break
            if not self.disk.may_delete(e):
                continue
            total -= e.disk_bytes
            if e.cache is not None:  # still in memory: only the disk copy goes
                self.disk.delete(e)
                e.path, e.disk_bytes = None, 0
            else:
                self._forget(e)

    def spill(self, e: Entry) -> bool:
        """Move a state from memory to the disk tier (written once; a session's is
        written through already). Whether it left memory: a state whose write fails
        (a full disk) stays in memory, never lost."""
        if e.cache is None:
            return True
        if e.session is not None:
            self.writer.wait(e.session)
            if e.path is None and not self.writer.write(self._job(e, *capture(e.cache))):
                return False
        elif e.path is None:
            try:
                e.path, e.disk_bytes, e.owner = self.disk.write(e, *capture(e.cache))
            except Exception as err:  # e.g. no space left: keep it in memory
                self.failures.append(f"spill of {len(e.tokens)} tokens: {err}")
                log.warning("could not spill a stored state to disk: %s", err)
                return False
        e.cache = None
        self.spilled += 1
        return True

    def flush(self) -> None:
        """Until every session's latest state is on disk (retrying failed writes)."""
        self.writer.wait()
        for e in [e for e in list(self.index.entries.values()) if e.session and e.path is None and e.cache]:
            self.writer.write(self._job(e, *capture(e.cache)))

    def arrays(self, e: Entry) -> tuple[dict[str, mx.array], list[dict]]:
        """`e`'s state as arrays and per-layer metadata, from memory or disk."""
        if e.cache is not None:
            return capture(e.cache)
        if e.session is not None:
            self.writer.wait(e.session)
        arrays, manifest = load_snapshot(e.path)
        return arrays, manifest["layers"]

    def read(self, path: str | Path) -> tuple[list, dict, int]:
        """A snapshot's cache, manifest and in-memory bytes, checked against this
        model, its KV settings and its layers; raises SnapshotError otherwise."""
        return read_checked(path, self.identity, self.layers)

    def _scan(self) -> None:
        """Index what earlier runs and other processes left (manifests only; checked
        on use), after removing temporaries whose writer is dead."""
        sweep_temporaries(self.dir.parent, depth=0)
        if not self.dir.is_dir():
            return
        with locked(self.dir):
            sweep_temporaries(self.dir)
        for e in self.disk.scan():
            self.index.add(e)
        for e in self.store.scan():
            self._adopt(e)
        self.last = None

    def _adopt(self, e: Entry) -> None:
        prev = self.index.add(e)
        if prev is not None:
            self.index.remove(prev)

    # -- sessions -------------------------------------------------------------------
    def session_entry(self, name: str) -> Entry | None:
        """Session `name`'s state: indexed, or found on disk (written by another
        process since this one looked)."""
        e = self.index.session(name)
        if e is None:
            e = self.store.find(name)
            if e is not None:
                self._adopt(e)
        return e

    def fork(self, source: str, name: str) -> Entry:
        """A new session `name` starting from session `source`'s state."""
        e = self.session_entry(source)
        if e is None:
            raise KeyError(f"no session {source!r}")
        return self.keep_as(e, name)

    def keep_as(self, e: Entry, name: str) -> Entry:
        """Store `e`'s state as session `name` (written through): an anonymous state in
        memory becomes the session's without a copy."""
        if e.session is None and e.cache is not None:
            cache = e.cache
            self._forget(e)
        else:
            cache = copy_cache(e.cache) if e.cache is not None else self.load(e)
        if cache is None:
            raise SnapshotError(f"the state of {len(e.tokens)} tokens could not be read from disk")
        return self.put(e.tokens, cache, name, e.sampler)

    def drop(self, session: str) -> None:
        """Forget a session's state, on disk too."""
        self.writer.wait(session)
        e = self.index.session(session)
        if e is not None:
            self._forget(e)
        self.store.drop(session)

    def clear(self) -> None:
        """Forget every anonymous state (sessions stay)."""
        for e in [e for e in self.index.entries.values() if e.session is None]:
            self._forget(e)
        self.last = None


def _flush_at_exit(tiers: StateTiers) -> None:
    """At interpreter exit, wait for queued session writes (without keeping `tiers`
    alive meanwhile)."""
    ref = weakref.ref(tiers)
    atexit.register(lambda: (t := ref()) is not None and t.flush())
