"""The scheduler's worker for a runner that computes one request at a time (a layer
pipeline, justfit.engine.pipeline_runner): each job, in arrival order, runs whole
through `engine.generate` before the next starts. The scheduler
(justfit.engine.scheduler) owns the queue and the counters; this module only calls its
methods."""

from __future__ import annotations

import logging
import time

from justfit import runtime
from justfit.engine.events import End, Failure, Progress, Token
from justfit.errors import JustFitError

log = logging.getLogger("justfit.scheduler")


class _Cancelled(Exception):
    pass


def work_serially(sched) -> None:
    """Run the jobs of `sched` (a justfit.engine.scheduler.Scheduler) one at a time
    until it closes."""
    runtime.setup()  # this thread computes on the shared execution stream
    while True:
        job, _ = sched.next_job(block=True)
        if job is None:  # the scheduler is closing
            return
        if job.cancel.is_set():  # its client left while it waited
            sched.finished(job, "cancelled")
            job.ended_by_stop()
            job.emit(End(None))
            continue
        now = time.monotonic()
        job.publish(started=now, last_event=now)  # its wait in the queue is no stall
        sched.active = [job]
        try:
            _run(sched, job)
        finally:
            sched.active = []


def _run(sched, job) -> None:
    def progress(done: int, total: int) -> None:
        if job.cancel.is_set():
            raise _Cancelled
        job.emit(Progress(done, total, time.monotonic() - job.status.started))

    gen = sched.engine.generate(job.tokens, job.sampling, progress, session=job.session, scope=job.scope)
    failed, stats = False, None
    try:
        for chunk in gen:
            stats = chunk.stats or stats
            job.emit(Token(chunk))
            if job.cancel.is_set():
                break
    except _Cancelled:
        pass
    except Exception as e:  # JustFitError: the client's to fix; others: logged, a clean 500
        if not isinstance(e, JustFitError):
            log.exception("request failed")
        failed = True
        job.emit(Failure.of(e))
    finally:
        gen.close()  # stores the state computed so far
        outcome = "failed" if failed else "cancelled" if job.cancel.is_set() else "completed"
        sched.finished(job, outcome, stats)
        if not failed:
            job.ended_by_stop()
        job.emit(End(stats))
