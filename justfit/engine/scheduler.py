"""One worker thread runs requests on the engine in arrival order, one at a time or,
with `max_batch` > 1, several at once (justfit.engine.batch: decode steps shared, prefill
chunks interleaved, admitted while their plans fit the budget together); the rest wait
in a bounded queue. How the worker runs them is the engine's runner's
(justfit.engine.runner: `work`, and `watch`, a bound on a stalled request's wait).
The HTTP side talks to it through `Job`s (justfit.engine.job): typed events come back on
the job's asyncio queue, and setting `cancel` stops the request within one decode step
(or between prefill chunks), leaving the engine's state consistent."""

from __future__ import annotations

import threading
from collections import deque
import time
from typing import Any, Callable

from justfit.errors import JustFitError
from justfit.engine.job import Job
from justfit.engine.tickets import Tickets


# A ticket lapses when its client has not retried within this many Retry-After
# periods (and never sooner than TICKET_FLOOR_S).
TICKET_PERIODS, TICKET_FLOOR_S = 3, 30.0


class QueueFull(JustFitError):
    """The queue is full: how many requests wait, when to retry, and the ticket that keeps the place."""

    code = "server_busy"

    def __init__(self, waiting: int, retry_after: int, ticket: str = ""):
        self.waiting, self.retry_after, self.ticket = waiting, retry_after, ticket
        super().__init__(f"server busy: {waiting} requests already waiting; retry in about {retry_after} s"
                         " with the ticket to keep your place")


class Scheduler:
    """The engine's worker thread and the bounded queue of jobs waiting for it; the
    engine's runner (`engine.runner`, justfit.engine.runner) works the queue and, given
    `stall_s`, may watch for a request that stops moving."""

    def __init__(self, engine, max_queue: int = 16, on_done: Callable[[Any], None] | None = None,
                 max_batch: int = 1, preempt: bool = True, stall_s: float | None = None):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_queue, self.on_done, self.max_batch = engine, max_queue, on_done, max_batch
        self.preempt = preempt  # batching: park sequences on disk rather than count each at its plan's end
        self._queue: deque[Job | None] = deque()  # None: the worker's signal to stop
        self._arrived = threading.Condition()  # guards _queue; notified on every put
        self.active: list[Job] = []  # the jobs computing now, oldest first
        self.completed = self.cancelled = self.failed = self.rejected = 0
        self._seconds = 1.0  # recent request duration, for Retry-After
        self.batch = None  # the BatchRunner its worker steps (justfit.engine.batch_worker)
        self.last_stats = None  # the stats of the request that finished last
        self.tickets = Tickets()  # places kept for clients turned away (touched on the server's loop only)
        runner = engine.runner
        self._thread = threading.Thread(target=runner.work, args=(self,), name="justfit-engine", daemon=True)
        self._thread.start()
        # The runner's bound on a request that stops moving, or None where it needs none.
        self.watch = runner.watch(self, stall_s) if stall_s is not None else None

    @property
    def running(self) -> Job | None:
        """The oldest job computing now, or None."""
        active = self.active
        return active[0] if active else None

    @property
    def waiting(self) -> int:
        """Jobs waiting in the queue (the running one excluded)."""
        with self._arrived:
            return sum(j is not None for j in self._queue)

    def queued(self) -> list[Job]:
        """The jobs waiting, in order (a snapshot)."""
        with self._arrived:
            return [j for j in self._queue if j is not None]

    def _put(self, job: Job | None, at: int | None = None) -> None:
        with self._arrived:
            self._queue.insert(len(self._queue) if at is None else at, job)
            self._arrived.notify()

    def live_layers(self) -> list:
        """Every layer of the running sequences' caches (the status page's KV), a snapshot."""
        b = self.batch
        running = list(b.running) if b is not None else []
        return [layer for s in running if s.cache is not None for layer in s.cache]

    def batch_stats(self) -> dict:
        """With batching: sequences set aside now, preemptions so far, seconds swapping."""
        b = self.batch
        if b is None:
            return {}
        return {"preempted": len(b.parked), "preemptions": b.preemptions, "swap_s": round(b.swap_s, 3)}

    def submit(self, job: Job, ticket: str | None = None) -> int:
        """Queue `job`; returns how many run or wait before it. Raises QueueFull with a
        ticket; a retry that brings it back (`ticket`) is queued ahead of every request
        that arrived after its first try (justfit.engine.tickets)."""
        now = time.monotonic()
        self.tickets.expire(now)
        issued = self.tickets.redeem(ticket)
        if issued is not None:
            job.submitted = issued  # its wait counts from its first try
            return self._queue_in_order(job)
        if self.waiting >= self.max_queue:
            self.rejected += 1
            retry = max(1, round(self._seconds * (self.waiting + 1)))
            held = self.tickets.hold(ticket, now, now + max(TICKET_FLOOR_S, TICKET_PERIODS * retry))
            raise QueueFull(self.waiting, retry, held)
        ahead = self.waiting + len(self.active)
        self._put(job)
        return ahead

    def _queue_in_order(self, job: Job) -> int:
        """Put `job` in the queue before the jobs submitted after it; how many are ahead."""
        with self._arrived:
            later = [i for i, j in enumerate(self._queue) if j is None or j.submitted > job.submitted]
            at = later[0] if later else len(self._queue)
            self._put(job, at)
        return at + len(self.active)

    def idle(self) -> bool:
        """Nothing computing, set aside or waiting."""
        b = self.batch
        return not self.active and not self.waiting and not (b is not None and (b.running or b.parked))

    def uses_session(self, name: str, scope: str) -> bool:
        """Whether a job computing or waiting names session `name` of `scope`."""
        return any(j.session == name and j.scope == scope for j in list(self.active) + self.queued())

    def stop_all(self) -> int:
        """Cancel every job, computing or waiting, for the server's stop; how many."""
        jobs = list(self.active) + self.queued()
        for job in jobs:
            job.stop()
        return len(jobs)

    def close(self) -> None:
        """Cancel the running jobs and stop the worker thread once what is queued is done."""
        if self.watch is not None:
            self.watch.stop()
        for job in list(self.active):
            job.cancel.set()
        self._put(None)
        self._thread.join(timeout=30)

    def next_job(self, block: bool) -> tuple[Job | None, bool]:
        """Take the first job waiting out of the queue (waiting for one if `block`);
        None when there is none or the scheduler is closing (the second value)."""
        with self._arrived:
            while block and not self._queue:
                self._arrived.wait()
            if not self._queue or self._queue[0] is None:
                return None, bool(self._queue)
            return self._queue.popleft(), False

    def put_back(self, job: Job) -> None:
        """Return a job taken by `next_job` to the head of the queue (it waits for room)."""
        self._put(job, 0)

    def finished(self, job: Job, outcome: str, stats=None) -> None:
        """Count `job` as "completed", "cancelled" or "failed" and hand its stats on
        (its wait in the queue set); the request durations behind Retry-After."""
        if outcome not in ("completed", "cancelled", "failed"):
            raise ValueError(f"unknown outcome {outcome!r}")
        setattr(self, outcome, getattr(self, outcome) + 1)
        started = job.status.started
        if started is not None:
            self._seconds = 0.7 * self._seconds + 0.3 * (time.monotonic() - started)
        if stats is not None:
            stats.queue_s = started - job.submitted
            self.last_stats = stats
            if self.on_done:
                self.on_done(stats)
