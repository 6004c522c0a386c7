"""Stored serving states in two tiers, memory (bounded in bytes) and disk, indexed by
token prefix.

A state is anonymous (a prefix-cache entry: reusable by any request of its scope
whose tokens share its prefix; spilled to `anon/` when memory is short, deleted when
the anonymous disk limit is reached) or a named session's: user data, written through
to disk at the end of every turn (statetrans.writer) as the session's next generation
(statetrans.sessions), deleted by `drop` or, past the sessions' own disk limit, by the
quota's least-recently-used eviction (statetrans.quota decides, statetrans.session_ledger
applies it). A parked state (statetrans.parking decides) is written, read back and
indexed here.

Every state has a scope (whose it is: e.g. a hash of a client's API key; "" is the
shared default). Requests see only their own scope's states, sessions are named within
a scope, and listings show other scopes only as counts. The disk limits may be divided
among scopes (`share_among`): each then has an equal share of the sessions' limit and
of the anonymous states', and only its own states are evicted to keep it within it.

What fails its checks is quarantined (statetrans.quarantine) within its own limit; the
quarantine's bytes count against the anonymous states' disk limit.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Iterable

import mlx.core as mx

from kvexec.export import can_trim, trim
from statetrans.disk import locked, sweep_temporaries
from statetrans.disk_tier import DiskTier
from statetrans.faults import Faults, installed as installed_faults
from statetrans.identity import identity_key, read_checked
from statetrans.index import Entry, Index, Reuse, cache_nbytes
from statetrans.parking import Parked, check_unparked, parked_as, parked_entry, to_park
from statetrans.quarantine import quarantine, quarantine_bytes
from statetrans.quota import (REFRESH_S, SESSION_KEEP_S, SessionQuota, anonymous_room, anonymous_shares,
                              disk_shares, unshared_limit)
from statetrans.reuse import Candidate, ranked
from statetrans.schema import Expect
from statetrans.session_ledger import SessionLedger
from statetrans.sessions import SessionStore, folder_name
from statetrans.snapshot import SnapshotError, load_snapshot
from statetrans.state import capture, copy_cache
from statetrans.writer import KEPT_FAILURES, Job, WriteThrough, reason_of

log = logging.getLogger("justfit.statetrans")


class StateTiers:
    """Stored states in memory and on disk, found by token prefix (see the module doc)."""

    def __init__(self, directory: str | Path, identity: dict, layers: int,
                 memory_limit: int, disk_limit: int, faults: Faults | None = None,
                 session_disk_limit: int | None = None, session_keep_s: float = SESSION_KEEP_S,
                 vocab: int | None = None, quarantine_limit: int | None = None, scopes: Iterable[str] = ()):
        self.identity, self.layers, self.vocab = identity, layers, vocab  # vocab: token ids are below it
        self.dir = Path(directory).expanduser() / identity_key(identity)
        # disk_limit: the anonymous states' and the quarantine's together; the quarantine's own (None: none)
        self.memory_limit, self.disk_limit, self.quarantine_limit = memory_limit, disk_limit, quarantine_limit
        self.faults = faults if faults is not None else installed_faults()
        self.index = Index()
        self.disk = DiskTier(self.dir, identity, self.faults, Expect(layers, vocab), quarantine_limit)
        self.store = SessionStore(self.dir, identity, self.faults, Expect(layers, vocab), quarantine_limit)
        # sessions' disk bytes (None: unbounded), each scope of `scopes` within its share
        self.ledger = SessionLedger(SessionQuota(session_disk_limit, session_keep_s, scopes=frozenset(scopes)))
        self._quarantined: tuple[float, int] | None = None  # (monotonic time read, the quarantine's bytes)
        self.writer = WriteThrough(self.store)  # each job carries the ledger that applies the quota after it
        self.last: Entry | None = None  # the most recently stored state
        self.spilled = self.restored = 0  # counts, for stats
        self.failures: deque[str] = deque(maxlen=KEPT_FAILURES)  # the latest spills that could not be written
        self.spill_failures = 0  # all of them (the states stayed in memory)
        self._spill_error = ""  # why the latest spill failed, until one succeeds
        self._settling = threading.Lock()
        self._scan()

    @property
    def quota(self) -> SessionQuota:
        """The sessions' disk quota (the ledger applies it)."""
        return self.ledger.quota

    @property
    def session_disk_limit(self) -> int | None:
        """Bytes the sessions may take on disk, all scopes and processes (None: no limit)."""
        return self.quota.limit

    @property
    def scopes(self) -> frozenset[str]:
        """The scopes the disk limits are divided among (none: one share for all)."""
        return self.quota.scopes

    def share_among(self, scopes: Iterable[str]) -> None:
        """Divide the sessions' and the anonymous states' disk limits among `scopes`
        (e.g. one for each API key a server accepts): each has an equal share, and only
        its own states are evicted to keep it within it. States of other scopes share
        what these leave; none given: one share for all, as before. A new ledger
        of the quota divided so governs the session writes queued from now on."""
        self.ledger = self.ledger.shared_among(scopes)

    def disk_shares(self, scope: str = "") -> dict[str, int | None]:
        """`scope`'s disk shares, in bytes (None: no share of its own): "sessions" and
        "anonymous" (its part of what the quarantine leaves of the anonymous limit)."""
        room = anonymous_room(self.disk_limit, self.quarantine_bytes())
        return disk_shares(self.session_disk_limit, room, scope, self.scopes).as_dict()

    def quarantine_bytes(self) -> int:
        """Bytes in this model's quarantine: read again after a load quarantined a
        state, else at most every REFRESH_S (scans and other processes quarantine too)."""
        now = time.monotonic()
        if self._quarantined is None or now - self._quarantined[0] > REFRESH_S:
            self._quarantined = (now, quarantine_bytes(self.dir))
        return self._quarantined[1]

    @property
    def session_keep_s(self) -> float:
        """A session touched this recently is evicted only when nothing older is left (and the write says so)."""
        return self.quota.keep_s

    @property
    def entries(self) -> dict[str, Entry]:
        """Every indexed state by key."""
        return self.index.entries

    @property
    def sessions(self) -> dict[str, str]:
        """Session name -> its state's key, in the shared scope ("")."""
        return {name: key for (scope, name), key in list(self.index.sessions.items()) if scope == ""}

    @property
    def memory_bytes(self) -> int:
        """Bytes of the states held in memory."""
        return self.index.memory_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the states on disk."""
        return self.index.disk_bytes

    @property
    def session_disk_bytes(self) -> int:
        """Bytes of the sessions' disk copies this process knows of."""
        return sum(e.disk_bytes for e in self.index.session_entries() if e.path is not None)

    # -- health ---------------------------------------------------------------------
    @property
    def writes(self) -> int:
        """Session writes attempted (written or failed)."""
        return self.writer.writes

    @property
    def write_failures(self) -> int:
        """Session writes that failed."""
        return self.writer.write_failures

    def degraded(self) -> str:
        """"" while writes succeed; else why the latest failed (a session's write, or a
        spill of an anonymous state), until a later one succeeds."""
        return self.writer.last_error or self._spill_error

    # -- storing --------------------------------------------------------------------
    def put(self, tokens: list[int], cache: list, session: str | None = None, sampler: dict | None = None,
            scope: str = "", base: int | None = None) -> Entry:
        """Keep `cache` (holding exactly `tokens`) in the memory tier, in `scope`; a
        session's state is also queued for its next generation on disk (`entry.write`
        says what became of it; None for an anonymous state). It replaces an anonymous
        state with the same tokens; the session's previous state, if still in memory,
        stays as an anonymous one (a checkpoint the LRU tiers bound).

        `base`: the session's generation the turn started from (`Reuse.base`); when the
        session has moved on since (here or in another process), the state is kept as
        a fork `SESSION~k` rather than replacing the newer one. None: no check."""
        mx.eval([c.state for c in cache])  # nothing pending is stored half-done
        if session:
            self.writer.wait((scope, session))  # the previous turn's write is decided first
        self._settle()
        same = self.index.same_tokens(tokens, session, scope)
        if same is not None and same.session is None:
            self._forget(same)
        name = session
        if session and base is not None:
            current = self.index.session(session, scope)
            if current is not None and current.generation > base:  # another request of this process moved it on
                held = {n for s, n in list(self.index.sessions) if s == scope}
                name = self.store.fork_name(session, scope, held)
        e = Entry(uuid.uuid4().hex[:16], list(tokens), cache, cache_nbytes(cache), session=name,
                  sampler=dict(sampler or {}), trimmable=can_trim(cache, 0), scope=scope,
                  touched=time.time() if name else 0.0)
        prev = self.index.add(e)
        self.last = e
        if name:
            forked = name != session
            e.base = 0 if forked else base
            e.generation = 1 if forked else max(prev.generation if prev is not None else 0, base or 0) + 1
            if prev is not None:
                self._retire(prev)
            job = self._job(e, *capture(cache, lazy=True), origin=session)
            e.write = job.write
            self.writer.submit(job)
        return e

    def _job(self, e: Entry, arrays: dict[str, mx.array], layers: list[dict], origin: str | None = None) -> Job:
        meta = json.loads(json.dumps({**self.identity, "tokens": e.tokens, "layers": layers, "sampler": e.sampler,
                                      "scope": e.scope}))
        arrays = {k: copy.copy(v) for k, v in arrays.items()}
        # Computed here, on the thread that computes: the writer's thread then only reads
        # buffers (MLX evaluating on two threads at once can crash).
        mx.eval([a for a in arrays.values() if isinstance(a, mx.array)])
        return Job(e, arrays, meta, e.base, origin or e.session, ledger=self.ledger)

    def _retire(self, prev: Entry) -> None:
        """A session's superseded (or evicted) state: an anonymous checkpoint of its
        scope if still in memory (its disk copy is the session's: removed once the
        newer one is durable, or by the eviction)."""
        self.index.unmap(prev)
        if prev.cache is None:
            self.index.remove(prev)
            return
        prev.session, prev.path, prev.disk_bytes, prev.generation = None, None, 0, 0

    def _settle(self) -> None:
        """Follow what finished writes decided (on the thread that owns the index): a
        turn kept as a fork is the fork's entry now; sessions the quota evicted leave
        the index."""
        with self._settling:
            while self.writer.settled:
                job = self.writer.settled.popleft()
                w, e = job.write, job.entry
                if w.ok and w.stored_as != e.session:
                    self.index.rename(e, w.stored_as)
                if w.evicted:
                    self._evicted(set(w.evicted))

    def _evicted(self, folders: set[str]) -> None:
        """Sessions whose folders the quota deleted: out of the index (a state still
        in memory stays as an anonymous checkpoint), unless written again since."""
        for e in self.index.session_entries():
            if folder_name(e.session, e.scope) not in folders or (e.write is not None and not e.write.done):
                continue
            if e.path is None or not e.path.exists():
                self._retire(e)
                if self.last is e and e.cache is None:
                    self.last = None

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
    def take(self, tokens: list[int], session: str | None = None, memory_limit: int | None = None,
             scope: str = "") -> Reuse:
        """The stored state of `scope` sharing the longest usable prefix with `tokens` (at
        most all but the last token, so the request computes logits), trimmed to it, and
        detached for the request to extend (statetrans.reuse chooses which). The
        session's own state stays on disk until its next generation is durable.
        `Reuse.base` is `session`'s generation as found (0: none), whatever state the
        request starts from: its `put` keeps a fork if the session moves on meanwhile."""
        base, own = 0, None
        if session:
            current = self.session_entry(session, scope)  # also one another process wrote since
            if current is not None:
                base, own = current.generation, current.key
                self.touch_session(current)
        for choice in ranked(self.index.match(tokens, scope), len(tokens), own, session):
            e = choice.entry
            if e.key not in self.index.entries or e.scope != scope:
                continue  # gone meanwhile: an earlier candidate's detaching made room
            try:
                reuse = self._detach(choice, memory_limit)
                if reuse is None or (choice.cut and not trim(reuse.cache, choice.cut)):
                    continue  # unreadable, or e.g. evicted positions: the copy is dropped
            except Exception as err:  # noqa: BLE001 - a stored state never fails a request: the next one, or none
                log.warning("not reusing a stored state of %d tokens: %r", len(e.tokens), err, exc_info=True)
                continue
            reuse.tokens, reuse.base = reuse.tokens[:choice.length], base
            return reuse
        self.fit(memory_limit)
        return Reuse(None, [], {}, "", base=base)

    def _detach(self, choice: Candidate, memory_limit: int | None) -> Reuse | None:
        """The chosen state for a request: handed over, or a copy where it is kept (or
        a session's) leaves it indexed; None when it cannot be read from disk."""
        e, keep = choice.entry, choice.keep
        start = time.perf_counter()
        stays = keep or e.session is not None  # a session's next turn: its disk copy stays indexed
        if not keep and e.cache is not None:  # hand the memory over; nothing to copy
            cache, source = e.cache, "memory"
            e.cache = None
            self.release(e, stays)
            self.fit(memory_limit)
        else:
            self.fit(memory_limit, spare=None if keep else e)  # spill first: the copy needs room
            if e.cache is not None:
                cache, source = copy_cache(e.cache), "memory"
            else:
                source = "disk"
                try:
                    cache = self.load(e)
                except Exception as err:  # noqa: BLE001 - whatever a stored file does, the request goes on
                    log.warning("not reusing a stored state of %d tokens: %r", len(e.tokens), err, exc_info=True)
                    self.index.remove(e)  # (a session's older generation is found again on its next request)
                    if e.path is not None and not isinstance(err, MemoryError):  # too large now is not damage
                        quarantine(self.dir, e.path, err)
                    return None
                if cache is None:
                    return None
                self.restored += 1
            self.release(e, stays)
        return Reuse(cache, list(e.tokens), dict(e.sampler), source, time.perf_counter() - start, e.session)

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
            self.writer.wait((e.scope, e.session))
            self._settle()
        if e.path is None:
            return None
        try:
            return self.read(e.path)[0]
        except SnapshotError as err:
            quarantine(self.dir, e.path, err, self.quarantine_limit)  # (logs why)
            self._quarantined = None
            if e.session is None:
                self._forget(e)
                return None
            self.index.remove(e)
            older = self.store.find(e.session, below=e.generation, scope=e.scope)
            if older is not None:
                self._adopt(older)
            return None

    # -- tiers ----------------------------------------------------------------------
    def fit(self, memory_limit: int | None = None, spare: Entry | None = None) -> None:
        """Spill least recently used states to disk until the memory tier holds at
        most `memory_limit` (default: the tier's own limit), then delete the least
        recently used anonymous snapshots past the anonymous disk limit less the
        quarantine's bytes: within each scope's share first, where the limit is
        divided, then among the scopes without one (this process's, or a dead
        process's: never another live one's; sessions have their own limit,
        statetrans.quota)."""
        limit = self.memory_limit if memory_limit is None else min(memory_limit, self.memory_limit)
        total = self.memory_bytes
        for e in self.index.in_memory(spare):
            if total <= limit:
                break
            if self.spill(e):
                total -= e.nbytes
        room, scopes = anonymous_room(self.disk_limit, self.quarantine_bytes()), self.scopes
        for scope, limit in anonymous_shares(room, scopes).items():
            self._trim_anonymous([e for e in self.index.anonymous_on_disk() if e.scope == scope], limit)
        on_disk = self.index.anonymous_on_disk()
        shared = sum(e.disk_bytes for e in on_disk if e.scope in scopes)  # each within its share
        self._trim_anonymous([e for e in on_disk if e.scope not in scopes], unshared_limit(room, shared))

    def _trim_anonymous(self, entries: list[Entry], limit: int) -> None:
        """Delete the disk copies of `entries` (least recently used first), those this
        process may, until they hold at most `limit` bytes."""
        total = sum(e.disk_bytes for e in entries)
        for e in entries:
            if total <= limit:
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
            self.writer.wait((e.scope, e.session))
            self._settle()
            if e.path is None and e.session is not None and not self._rewrite(e):
                return False
        elif e.path is None:
            try:
                e.path, e.disk_bytes, e.owner = self.disk.write(e, *capture(e.cache, lazy=True))
            except Exception as err:  # e.g. no space left: keep it in memory
                self.spill_failures += 1
                self.failures.append(f"spill of {len(e.tokens)} tokens: {err}")
                self._spill_error = f"a stored state could not be spilled to disk: {reason_of(err)}"
                log.warning("could not spill a stored state to disk: %s", err)
                return False
            self._spill_error = ""
        e.cache = None
        self.spilled += 1
        return True

    def _rewrite(self, e: Entry) -> bool:
        """Write session entry `e` again (its write failed), through the writer; whether it is durable now."""
        cache = e.cache
        if cache is None:
            return False
        job = self._job(e, *capture(cache, lazy=True))
        e.write = job.write
        self.writer.submit(job)
        self.writer.wait(job.key)
        self._settle()
        return job.write.ok

    # -- parking (statetrans.parking decides) -----------------------------------------
    def park_state(self, tokens: list[int], cache: list, sampler: dict | None = None, scope: str = "") -> Parked:
        """Write `cache` (holding exactly `tokens`) to the disk tier, kept out of the
        index; raises (nothing published) when the write fails."""
        start = time.perf_counter()
        arrays, layers = capture(cache, lazy=True)
        e = to_park(tokens, sampler, scope)
        path, size, owner = self.disk.write(e, arrays, layers)
        return parked_as(e, path, size, owner, layers, time.perf_counter() - start)

    def unpark_state(self, parked: Parked) -> tuple[list, float]:
        """A parked cache read back and checked, and the seconds reading took; its
        snapshot deleted once read. Raises SnapshotError for a damaged or foreign one."""
        start = time.perf_counter()
        cache, manifest, _ = self.read(parked.path)
        check_unparked(parked, manifest)
        self.disk.delete(parked_entry(parked))
        return cache, time.perf_counter() - start

    def keep_parked_state(self, parked: Parked) -> None:
        """Index a parked state as an anonymous disk state, unless the index holds its
        tokens already (then its snapshot is deleted)."""
        e = parked_entry(parked)
        if self.index.same_tokens(e.tokens, None, e.scope) is not None:
            self.disk.delete(e)
            return
        self.index.add(e)
        self.fit()

    def flush(self, timeout: float | None = None) -> bool:
        """Until every session's latest state is on disk: queued writes published
        (fsynced), failed ones retried; at most `timeout` seconds. Whether every
        state unwritten when it was called is durable now. Safe from another thread
        (a shutdown on a signal) while requests still run."""
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        if not self.writer.wait(timeout=left()):
            return False
        self._settle()
        retried = []
        for e in self.index.session_entries():
            cache = e.cache
            if (e.write is None or e.write.done) and e.path is None and cache is not None:  # path is set before done
                job = self._job(e, *capture(cache, lazy=True))
                e.write = job.write
                self.writer.submit(job)
                retried.append(job.write)
        done = self.writer.wait(timeout=left())
        self._settle()
        return done and all(w.ok for w in retried)

    def arrays(self, e: Entry) -> tuple[dict[str, mx.array], list[dict]]:
        """`e`'s state as arrays and per-layer metadata, from memory or disk."""
        if e.cache is not None:
            return capture(e.cache, lazy=True)  # pages on disk stay there (a snapshot links them)
        if e.session is not None:
            self.writer.wait((e.scope, e.session))
        arrays, manifest = load_snapshot(e.path)
        return arrays, manifest["layers"]

    def read(self, path: str | Path) -> tuple[list, dict, int]:
        """A snapshot's cache, manifest and in-memory bytes, checked against this
        model, its KV settings and its layers; raises SnapshotError otherwise."""
        return read_checked(path, self.identity, self.layers, self.vocab)

    def _scan(self) -> None:
        """Index what earlier runs and other processes left (manifests only; checked
        on use), after removing temporaries whose writer is dead."""
        try:
            sweep_temporaries(self.dir.parent, depth=0)
            if not self.dir.is_dir():
                return
            with locked(self.dir):
                sweep_temporaries(self.dir)
        except OSError as err:  # e.g. a read-only state directory: what it holds is still read
            log.warning("could not clean up the state directory %s: %s", self.dir, err)
        for e in self.disk.scan():  # (these skip or quarantine what fails; they never raise)
            self.index.add(e)
        for e in self.store.scan():
            self._adopt(e)
        self.last = None

    def _adopt(self, e: Entry) -> None:
        """Index a session generation found on disk as the session's entry."""
        if not e.touched and e.path is not None:
            try:
                e.touched = e.path.parent.stat().st_mtime
            except OSError:
                pass
        prev = self.index.add(e)
        if prev is not None:
            self._retire(prev)

    # -- sessions -------------------------------------------------------------------
    def session_entry(self, name: str, scope: str = "") -> Entry | None:
        """Session `name`'s state in `scope`: indexed, or found on disk when another
        process has written a newer generation since (or this one never looked)."""
        self.writer.wait((scope, name))
        self._settle()
        e = self.index.session(name, scope)
        newest = self.store.newest(name, scope)
        if e is None or newest > e.generation or (e.path is None and 0 < newest >= e.generation):
            found = self.store.find(name, scope=scope)
            if found is not None and (e is None or e.path is None or found.generation > e.generation):
                self._adopt(found)
                e = found
        return e

    def touch_session(self, e: Entry) -> None:
        """Session entry `e` is being used: the quota's clock (its folder's mtime,
        seen by every process) and the listing's."""
        e.touched = time.time()
        self.ledger.noted(folder_name(e.session, e.scope), self.store.touch(e.session, e.scope), e.scope)

    def session_list(self, scope: str = "") -> list[dict]:
        """`scope`'s sessions this process knows, most recently touched first: name,
        tokens, bytes on disk, generation and the wall time it was last touched (what
        finished writes decided first: no session the quota has evicted)."""
        self._settle()
        rows = [{"name": e.session, "tokens": len(e.tokens), "bytes": e.disk_bytes, "generation": e.generation,
                 "touched": e.touched} for e in self.index.session_entries(scope)]
        return sorted(rows, key=lambda r: -r["touched"])

    def session_counts(self) -> dict[str, int]:
        """How many sessions each scope holds (what a page may show of other scopes)."""
        return self.index.session_counts()

    def fork(self, source: str, name: str, scope: str = "") -> Entry:
        """A new session `name` starting from session `source`'s state (both of `scope`)."""
        e = self.session_entry(source, scope)
        if e is None:
            raise KeyError(f"no session {source!r}")
        return self.keep_as(e, name)

    def keep_as(self, e: Entry, name: str, scope: str | None = None) -> Entry:
        """Store `e`'s state as session `name` (written through) of `scope` (default:
        `e`'s own): an anonymous state in memory becomes the session's without a copy."""
        scope = e.scope if scope is None else scope
        if e.session is None and e.cache is not None:
            cache = e.cache
            self._forget(e)
        else:
            cache = copy_cache(e.cache) if e.cache is not None else self.load(e)
        if cache is None:
            raise SnapshotError(f"the state of {len(e.tokens)} tokens could not be read from disk")
        return self.put(e.tokens, cache, name, e.sampler, scope=scope)

    def drop(self, session: str, scope: str = "") -> bool:
        """Forget a session's state, on disk too; whether there was one. Safe from
        another thread than the engine's (the index is locked; a request that holds
        the state keeps its own)."""
        self.writer.wait((scope, session))
        self._settle()
        e = self.index.session(session, scope)
        if e is not None:
            self.index.remove(e)
            if self.last is e:
                self.last = None
        found = self.store.drop(session, scope)
        self.ledger.noted(folder_name(session, scope), None)
        return found or e is not None

    def clear(self) -> None:
        """Forget every anonymous state (sessions stay)."""
        for e in [e for e in list(self.index.entries.values()) if e.session is None]:
            self._forget(e)
        self.last = None
