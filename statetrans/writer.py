"""Write-through of named sessions: at the end of each turn the session's state is
queued (a bounded queue) for a background thread that publishes it as the session's
next generation. A turn's write waits for the previous turn's of the same session to
be durable first, so a crash loses at most the last turn, never more.

Each write has a handle (`Write`, statetrans/write_outcome.py) whoever must know the
turn is durable waits on (a server, before a response's last byte), saying what became
of it: stored, stored as a fork (the session had moved on since the turn began), or not
stored and why. After each write the sessions' ledger the job carries applies the
disk quota (statetrans.session_ledger). Failures are kept, the latest few with their reasons, all of them
as counts."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from statetrans.index import Entry
from statetrans.session_ledger import SessionLedger
from statetrans.sessions import SessionStore, folder_name
from statetrans.write_outcome import Write

log = logging.getLogger("justfit.statetrans")

KEPT_FAILURES = 32  # failure messages kept (the counts cover all)


@dataclass
class Job:
    """A session's state waiting to be published: its entry, arrays and manifest, the
    generation the turn started from (None: unchecked), the name the turn asked for
    (a fork's origin), the handle its outcome goes to and the sessions' ledger that
    applies their disk quota once it is written (None: none)."""

    entry: Entry
    arrays: dict[str, mx.array]  # shallow copies: the store's later in-place writes do not reach them
    meta: dict  # JSON-able, copied
    base: int | None = None
    origin: str = ""
    write: Write | None = None  # made here when not given
    ledger: SessionLedger | None = None

    def __post_init__(self) -> None:
        self.origin = self.origin or self.entry.session
        if self.write is None:
            self.write = Write(self.origin, self.entry.scope)
        self.key = (self.entry.scope, self.entry.session)  # as submitted (a fork renames the entry later)


class WriteThrough:
    """A background thread publishing sessions' states from a bounded queue, in order per session."""

    def __init__(self, store: SessionStore, depth: int = 2):
        self.store = store
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=depth)
        self._pending: dict[tuple[str, str], int] = {}  # (scope, session) -> jobs queued or running
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failures: deque[str] = deque(maxlen=KEPT_FAILURES)  # the latest that could not be written
        self.written = self.write_failures = 0
        self.last_error = ""  # why the latest write failed, until one succeeds again
        self.settled: deque[Job] = deque()  # done jobs whose outcome the index must follow (forks, evictions)
        self.seconds = self.last_seconds = 0.0  # spent writing in the background: in all, the latest write

    @property
    def writes(self) -> int:
        """Writes attempted: written or failed."""
        return self.written + self.write_failures

    @property
    def pending(self) -> list[tuple[str, str]]:
        """(scope, session) of the writes queued or running."""
        with self._cond:
            return list(self._pending)

    def submit(self, job: Job) -> None:
        """Queue a session's state for publishing, once its previous one is durable."""
        key = job.key
        with self._cond:
            while self._pending.get(key):
                self._cond.wait()
            self._pending[key] = 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="statetrans-writer", daemon=True)
                self._thread.start()
        self._queue.put(job)  # blocks while the queue is full: memory for copies is bounded

    def wait(self, key: tuple[str, str] | None = None, timeout: float | None = None) -> bool:
        """Until the writes of `key` (scope, session) (default: all) are done, at most
        `timeout` seconds; whether they are."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending.get(key) if key is not None else self._pending:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def write(self, job: Job) -> bool:
        """Publish `job` now, in this thread; whether it was written (its handle says more)."""
        e, w = job.entry, job.write
        start = time.perf_counter()
        try:
            got = self.store.publish(e.session, job.arrays, job.meta, e.generation, e.scope, job.base, job.origin)
        except Exception as err:  # e.g. a full disk: the state stays in memory, the previous generation on disk
            self.write_failures += 1
            self.failures.append(f"session {e.session!r}: {err}")
            self.last_error = f"a session's state could not be written: {reason_of(err)}"
            log.warning("could not write session %r: %s", e.session, err)
            w.finish("not-stored", reason=reason_of(err))
            return False
        e.generation, e.path, e.disk_bytes = got.generation, got.path, got.bytes
        self.written += 1
        self.last_error = ""
        evicted: list[tuple[str, bool]] = []
        if job.ledger is not None:
            job.ledger.noted(got.path.parent.name, self.store.folder_usage(got.path.parent.name), e.scope)
            try:
                evicted = job.ledger.enforce(self.store, folder_name(got.name, e.scope), e.scope)
            except OSError as err:  # the write itself stands
                log.warning("could not enforce the sessions' disk quota: %s", err)
        self.last_seconds = time.perf_counter() - start
        self.seconds += self.last_seconds
        w.finish("stored" if got.name == job.origin else "stored-as-fork", got.name, got.generation,
                 evicted=evicted)
        if got.name != e.session or evicted:
            self.settled.append(job)
        return True

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                with self._cond:  # idle: the thread ends (the next submit starts one)
                    if not self._pending:
                        self._thread = None
                        return
                continue
            try:
                self.write(job)
            finally:
                job.arrays = {}
                with self._cond:
                    self._pending.pop(job.key, None)
                    self._cond.notify_all()


def reason_of(err: Exception) -> str:
    """A failure's reason without paths (it may reach clients and /health)."""
    if isinstance(err, OSError) and err.errno is not None:
        return f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror or ''}".strip(": ")
    return type(err).__name__
