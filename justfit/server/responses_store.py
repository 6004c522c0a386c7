"""Stored responses of the Responses API, per client key (scope): each response's
conversation items (what came before it and its own input), the response object
itself, the name of the named session holding its computed state
(justfit.server.sessions) and its context (its prompt's text and its reply, with their
exact token ids), so `previous_response_id` continues the conversation and its state.

Bounded per scope by count, bytes and age (`StoreLimits`): past the count or bytes
the oldest go first, one older than the age limit is gone when next looked at. Durable
on disk, where the server has a state directory, under `<state dir>/responses/`: one
folder per scope and one file per response, each named by a hash (of the scope, of
the response id), never by a client's string. A file is two JSON lines: a small
header (id, scope, creation time, size, session) that a scope's first use scans, and
the record. A file that cannot be read back is moved to `quarantine/` (its newest
files kept, a bounded number) and counts as not found; nothing it holds crashes a
request. Writes and reads run on the store's own thread, in order (`run`); a
response just finished is held in memory until its file is written, so the next
turn finds it at once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger("justfit.server")

QUARANTINE = "quarantine"
QUARANTINE_KEEP = 64  # files kept in quarantine/ (the newest)
CACHE_RECORDS = 64  # records kept in memory once written (the most recently used)


@dataclass(frozen=True)
class StoreLimits:
    """How much each client key (scope) may keep: responses, bytes, seconds."""

    max_count: int = 1000
    max_bytes: int = 256 * 2**20
    max_age_s: float = 30 * 86400.0


@dataclass
class StoredResponse:
    """One stored response: its id, when, the session holding its state, the response
    object, and the conversation items it was given (earlier turns' and its own input)."""

    id: str
    created_at: float
    session: str | None
    response: dict
    items: list[dict]
    nbytes: int = 0
    context: dict | None = None  # {"text", "ids"}: its prompt's text and its reply, and their exact token ids

    def conversation(self) -> list[dict]:
        """The items a response continuing this one starts from: its input, then its output."""
        return [*self.items, *self.response.get("output", [])]


@dataclass
class _Row:
    """What a scope's index keeps of a stored response."""

    id: str
    created_at: float
    nbytes: int
    session: str | None


@dataclass
class _Scope:
    rows: "OrderedDict[str, _Row]" = field(default_factory=OrderedDict)  # oldest first

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def encode(record: StoredResponse, scope: str) -> bytes:
    """A record's file: the header line, then the record line."""
    body = json.dumps({"response": record.response, "items": record.items, "context": record.context},
                      ensure_ascii=False).encode()
    head = {"v": 1, "id": record.id, "scope": scope, "created_at": record.created_at, "session": record.session,
            "nbytes": len(body)}
    return json.dumps(head).encode() + b"\n" + body + b"\n"


class ResponseStore:
    """Stored responses per scope, bounded by `limits`, durable under `folder` (None:
    in memory only, for as long as the process runs). Thread-safe; the index and the
    in-memory records are changed only under its lock."""

    def __init__(self, folder: Path | None, limits: StoreLimits = StoreLimits(),
                 clock: Callable[[], float] = time.time):
        self.folder, self.limits, self.clock = (Path(folder) if folder is not None else None), limits, clock
        self._lock = threading.Lock()
        self._scopes: dict[str, _Scope] = {}
        self._held: dict[tuple[str, str], StoredResponse] = {}  # written soon, or in memory only
        self._cache: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="justfit-responses")

    def run(self, fn: Callable, *args) -> Future:
        """`fn(*args)` on the store's thread, after every write queued before it."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Finish the queued writes, then stop."""
        self._pool.shutdown(wait=True)

    # -- paths ----------------------------------------------------------------------------
    def _dir(self, scope: str) -> Path:
        return self.folder / _hash("scope:" + scope)

    def _path(self, scope: str, rid: str) -> Path:
        return self._dir(scope) / (_hash("response:" + rid) + ".json")

    # -- the index --------------------------------------------------------------------------
    def load_scope(self, scope: str) -> None:
        """Index `scope`'s stored responses (once; its files' headers, expired ones
        deleted, unreadable ones quarantined). Blocking: on the store's thread."""
        with self._lock:
            if scope in self._scopes:
                return
        rows = []
        for path in self._listing(scope):
            head = self._header(path, scope)
            if head is None:
                continue
            if head.created_at < self.clock() - self.limits.max_age_s:
                _unlink(path)
                continue
            rows.append(head)
        with self._lock:
            if scope not in self._scopes:
                self._scopes[scope] = _Scope(OrderedDict((r.id, r) for r in sorted(rows, key=lambda r: r.created_at)))

    def _listing(self, scope: str) -> list[Path]:
        if self.folder is None:
            return []
        try:
            return [p for p in self._dir(scope).iterdir() if p.suffix == ".json" and p.is_file()]
        except OSError:
            return []

    def _header(self, path: Path, scope: str) -> _Row | None:
        try:
            with open(path, "rb") as f:
                head = json.loads(f.readline(4096))
            row = _Row(str(head["id"]), float(head["created_at"]), int(head["nbytes"]),
                       head.get("session") if isinstance(head.get("session"), str) else None)
            if head.get("scope") != scope or path != self._path(scope, row.id):
                raise ValueError("the header names another response or scope")
            return row
        except OSError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            self._quarantine(path, e)
            return None

    def ids(self, scope: str) -> list[str]:
        """`scope`'s stored response ids, oldest first (its index loaded)."""
        with self._lock:
            return list(self._scopes[scope].rows) if scope in self._scopes else []

    def is_head(self, scope: str, record: StoredResponse) -> bool:
        """Whether `record` is the newest stored response of its session: a response
        continuing it may take the session on; one continuing an older one forks."""
        with self._lock:
            rows = self._scopes.get(scope, _Scope()).rows.values()
            newest = [r.id for r in rows if r.session == record.session]
        return record.session is not None and bool(newest) and newest[-1] == record.id

    # -- records ------------------------------------------------------------------------------
    def put(self, scope: str, record: StoredResponse) -> list[str]:
        """Store `record` in `scope` (its index loaded): indexed and held in memory now,
        its file written on the store's thread; the oldest responses past the limits go.
        Returns the sessions no stored response of `scope` names any more."""
        record.nbytes = len(encode(record, scope))
        with self._lock:
            rows = self._scopes.setdefault(scope, _Scope()).rows
            rows[record.id] = _Row(record.id, record.created_at, record.nbytes, record.session)
            self._held[(scope, record.id)] = record
            gone = self._over_limits(scope)
            orphans = self._orphans(scope, gone)
        if self.folder is not None:
            self.run(self._write, scope, record)
        for row in gone:
            self.run(self._remove_file, scope, row.id)
        return orphans

    def _over_limits(self, scope: str) -> list[_Row]:
        """Drop (under the lock) the oldest rows past the count, bytes and age limits; the
        newest one always stays."""
        s, lim, gone = self._scopes[scope], self.limits, []
        oldest_allowed = self.clock() - lim.max_age_s
        total = s.nbytes
        while len(s.rows) > 1:
            row = next(iter(s.rows.values()))
            if len(s.rows) <= lim.max_count and total <= lim.max_bytes and row.created_at >= oldest_allowed:
                break
            self._forget(scope, row.id)
            total -= row.nbytes
            gone.append(row)
        return gone

    def _orphans(self, scope: str, gone: list[_Row]) -> list[str]:
        named = {r.session for r in self._scopes[scope].rows.values()}
        return sorted({r.session for r in gone if r.session is not None and r.session not in named})

    def get(self, scope: str, rid: str) -> StoredResponse | None:
        """`scope`'s stored response `rid`, or None (never stored, another scope's, deleted,
        evicted, expired or unreadable). Blocking: on the store's thread."""
        self.load_scope(scope)
        key = (scope, rid)
        with self._lock:
            row = self._scopes[scope].rows.get(rid)
            if row is None:
                return None
            expired = row.created_at < self.clock() - self.limits.max_age_s
            if expired:
                self._forget(scope, rid)
            found = None if expired else self._held.get(key) or self._cache.get(key)
            if found is not None and key in self._cache:
                self._cache.move_to_end(key)
        if expired:
            self._remove_file(scope, rid)
        if expired or found is not None:
            return found
        record = self._read(scope, rid, row)
        with self._lock:
            if record is None:
                self._scopes[scope].rows.pop(rid, None)
            elif rid in self._scopes[scope].rows:
                self._remember(key, record)
        return record

    def _forget(self, scope: str, rid: str) -> _Row | None:
        """Drop `rid` from the index and memory (under the lock)."""
        self._held.pop((scope, rid), None)
        self._cache.pop((scope, rid), None)
        return self._scopes[scope].rows.pop(rid, None)

    def _remember(self, key: tuple[str, str], record: StoredResponse) -> None:
        self._cache[key] = record
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_RECORDS:
            self._cache.popitem(last=False)

    def _read(self, scope: str, rid: str, row: _Row) -> StoredResponse | None:
        if self.folder is None:
            return None
        path = self._path(scope, rid)
        try:
            with open(path, "rb") as f:
                head, body = json.loads(f.readline()), json.loads(f.readline())
            if head.get("id") != rid or head.get("scope") != scope:
                raise ValueError("the header names another response or scope")
            response, items = body["response"], body["items"]
            if not isinstance(response, dict) or not isinstance(items, list) or not all(
                    isinstance(i, dict) and isinstance(i.get("type"), str) for i in items):
                raise ValueError("the record is not a response and its items")
            return StoredResponse(rid, row.created_at, row.session, response, items, row.nbytes,
                                  _context(body.get("context")))
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("could not read a stored response: %s", e)
            return None
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            self._quarantine(path, e)
            return None

    def delete(self, scope: str, rid: str) -> tuple[bool, list[str]]:
        """Delete `scope`'s stored response `rid`: whether it was there, and the sessions
        no stored response of `scope` names any more. Blocking: on the store's thread."""
        self.load_scope(scope)
        with self._lock:
            row = self._forget(scope, rid)
            orphans = self._orphans(scope, [row]) if row is not None else []
        if row is not None:
            self._remove_file(scope, rid)
        return row is not None, orphans

    # -- files (on the store's thread) --------------------------------------------------------
    def _write(self, scope: str, record: StoredResponse) -> None:
        key = (scope, record.id)
        with self._lock:
            if self._held.get(key) is not record:
                return  # deleted or evicted before its turn to be written
        folder = self._dir(scope)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode(record, scope))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(scope, record.id))
        except OSError as e:  # a full disk: kept in memory for this process's life
            log.warning("could not store a response on disk (kept in memory): %s", e)
            _unlink(tmp)
            return
        with self._lock:
            if self._held.get(key) is record:
                del self._held[key]
                self._remember(key, record)
            elif record.id not in self._scopes.get(scope, _Scope()).rows:
                _unlink(self._path(scope, record.id))  # deleted while it was being written

    def _remove_file(self, scope: str, rid: str) -> None:
        if self.folder is not None:
            _unlink(self._path(scope, rid))

    def _quarantine(self, path: Path, err: Exception) -> None:
        """Move an unreadable file aside (never read again), keeping the newest few."""
        log.warning("a stored response could not be read (quarantined): %s: %s", path.name, err)
        dest = self.folder / QUARANTINE
        try:
            dest.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}-{path.name}")
            kept = sorted(dest.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in kept[:-QUARANTINE_KEEP]:
                _unlink(old)
        except OSError as e:
            log.warning("could not quarantine %s: %s", path, e)
            _unlink(path)


def _context(value) -> dict | None:
    """A stored context as it must be (text and token ids), else None: the next turn then
    tokenizes its prompt afresh."""
    if (isinstance(value, dict) and isinstance(value.get("text"), str) and isinstance(value.get("ids"), list)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value["ids"])):
        return {"text": value["text"], "ids": value["ids"]}
    return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)
