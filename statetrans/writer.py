"""Write-through of named sessions: at the end of each turn the session's state is
queued (a bounded queue) for a background thread that publishes it as the session's
next generation. A turn's write waits for the previous turn's of the same session to
be durable first, so a crash loses at most the last turn, never more."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
import mlx.core as mx

from statetrans.memory_tier import Entry
from statetrans.sessions import SessionStore

log = logging.getLogger("justfit.statetrans")


@dataclass
class Job:
    """A session's state waiting to be published: its entry, arrays and manifest."""

    entry: Entry
    arrays: dict[str, mx.array]  # shallow copies: the store's later in-place writes do not reach them
    meta: dict  # JSON-able, copied


class WriteThrough:
    """A background thread publishing sessions' states from a bounded queue, in order per session."""

    def __init__(self, store: SessionStore, depth: int = 2):
        self.store = store
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=depth)
        self._pending: dict[str, int] = {}  # session -> jobs queued or running
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._at_exit = False  # the exit hook is registered
        self.failures: list[str] = []  # what could not be written (the state stays in memory)
        self.written = 0
        self.seconds = self.last_seconds = 0.0  # spent writing in the background: in all, the latest write

    def submit(self, job: Job) -> None:
        """Queue a session's state for publishing, once its previous one is durable."""
        name = job.entry.session
        with self._cond:
            while self._pending.get(name):
                self._cond.wait()
            self._pending[name] = 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="statetrans-writer", daemon=True)
                self._thread.start()
                if not self._at_exit:
                    self._at_exit = True
                    _wait_at_exit(self)
        self._queue.put(job)  # blocks while the queue is full: memory for copies is bounded

    def wait(self, session: str | None = None) -> None:
        """Until `session`'s writes (default: all) are done."""
        with self._cond:
            while self._pending.get(session) if session is not None else self._pending:
                self._cond.wait()

    def write(self, job: Job) -> bool:
        """Publish `job` now, in this thread; whether it was written."""
        e = job.entry
        start = time.perf_counter()
        try:
            generation, path, size = self.store.publish(e.session, job.arrays, job.meta, e.generation)
        except Exception as err:  # e.g. a full disk: the state stays in memory, the previous generation on disk
            self.failures.append(f"session {e.session!r}: {err}")
            log.warning("could not write session %r: %s", e.session, err)
            return False
        e.generation, e.path, e.disk_bytes = generation, path, size
        self.written += 1
        self.last_seconds = time.perf_counter() - start
        self.seconds += self.last_seconds
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
                    self._pending.pop(job.entry.session, None)
                    self._cond.notify_all()


def _wait_at_exit(writer: WriteThrough) -> None:
    """At interpreter exit, let queued writes finish (the thread is a daemon: without
    this, exit would cut a write short)."""
    ref = weakref.ref(writer)
    atexit.register(lambda: (w := ref()) is not None and w.wait())
