"""The scheduler's worker: every request runs as a sequence of one batch
(justfit.engine.batch.BatchRunner), at most `max_batch` at once (1: strictly one at a time).
Jobs leave the queue in arrival order and join the batch while their plans fit beside
the running ones (the head of the queue waits for room, so order is kept); each step
serves every running job; a job whose client went away leaves the batch before the
next step, its state stored. The scheduler (justfit.engine.scheduler) owns the queue and the
counters; this module only calls its methods."""

from __future__ import annotations

import logging
import time

from justfit import runtime
from justfit.engine.batch import BatchRunner
from justfit.engine.events import End, Failure, Progress, Token
from justfit.errors import JustFitError
from justfit.engine.sequence import Sequence

log = logging.getLogger("justfit.scheduler")


def work_batched(sched) -> None:
    """Run the jobs of `sched` (a justfit.engine.scheduler.Scheduler) until it closes and its
    queue and batch are drained."""
    runtime.setup()  # this thread computes on the shared execution stream
    _Worker(sched).run()


class _Worker:
    def __init__(self, sched):
        self.sched = sched
        self.runner = sched.batch = BatchRunner(sched.engine, sched.max_batch, preempt=sched.preempt)
        self.jobs: dict[int, object] = {}  # id(Sequence) -> its job
        self.planned: tuple[object, Sequence] | None = None  # the queue's head, planned, waiting for room

    @property
    def busy(self) -> bool:
        return bool(self.runner.running or self.runner.parked)

    def run(self) -> None:
        was_busy, watch = False, None
        try:
            while True:
                busy = self.busy
                if was_busy and not busy:
                    # The batch drained: what the process holds besides MLX is measured again
                    # (a whole-process budget's outside share), its peak while it ran too.
                    self.runner.engine.budget.remeasure(seen=watch.stop() if watch is not None else 0)
                    watch = None
                was_busy = busy
                closing = self._admit(block=not busy)
                if closing and not self.busy:
                    return
                self._drop_cancelled()
                if self.busy:
                    if watch is None:
                        watch = self.runner.engine.budget.watch()
                    self._step()
        finally:
            if watch is not None:
                watch.stop()

    def _admit(self, block: bool) -> bool:
        """Start jobs from the head of the queue while the batch has a free row and
        they fit; True once the scheduler is closing."""
        r, sched = self.runner, self.sched
        while len(r.running) < r.max_batch and not r.parked:
            job, closing = sched.next_job(block)
            block = False
            if job is None:
                return closing
            if job.cancel.is_set():  # its client left while it waited
                sched.finished(job, "cancelled")
                job.ended_by_stop()
                job.emit(End(None))
                continue
            now = time.monotonic()
            job.publish(started=now, last_event=now)  # its wait in the queue is no stall
            sched.active = self._active() + [job]
            seq = self.planned[1] if self.planned and self.planned[0] is job else self._plan(job)
            self.planned = None
            if seq is None:
                continue
            if not r.fits(seq):  # it waits at the head, planned, for room beside the batch
                self.planned = (job, seq)
                job.publish(started=None)
                sched.active = self._active()
                sched.put_back(job)
                return False
            try:
                r.admit(seq)
            except Exception as e:
                self._fail(job, e)
                continue
            self.jobs[id(seq)] = job
            sched.active = self._active()
            self._progress(job, len(seq.held), len(seq.tokens))  # what a stored state already holds
        return False

    def _progress(self, job, processed: int, total: int) -> None:
        job.emit(Progress(processed, total, time.monotonic() - job.status.started))

    def _plan(self, job) -> Sequence | None:
        """The job's sequence (the planner refuses what cannot fit alone), or None
        when it was refused or failed (its client told)."""
        try:
            return Sequence(self.runner.engine, job.tokens, job.sampling, job.session, job.scope)
        except Exception as e:
            self._fail(job, e)
            return None

    def _fail(self, job, error: Exception) -> None:
        if not isinstance(error, JustFitError):
            log.exception("request failed")
        self.sched.active = self._active()
        self.sched.finished(job, "failed")
        job.emit(Failure.of(error))
        job.emit(End(None))

    def _drop_cancelled(self) -> None:
        r = self.runner
        for seq in r.running + r.parked:
            if self.jobs[id(seq)].cancel.is_set():
                r.leave(seq)
                self._finish(seq, "cancelled")

    def _step(self) -> None:
        r = self.runner
        try:
            results = r.step()
        except Exception as e:  # a failed step leaves every sequence's cache unknown: end them all
            log.exception("batched step failed")
            for seq in r.running + r.parked:
                r.leave(seq)
                self.jobs[id(seq)].emit(Failure.of(e))
                self._finish(seq, "failed")
            return
        for seq, chunk in results:
            job = self.jobs.get(id(seq))
            if job is None:  # finished earlier in this step's results
                continue
            if chunk is None or job.status.processed < len(seq.tokens):  # a prefill chunk, or the prompt's last
                self._progress(job, len(seq.tokens) if chunk is not None else len(seq.held), len(seq.tokens))
            if chunk is None:
                continue
            job.emit(Token(chunk))
            if seq.finished and chunk.finish_reason is not None:
                self._finish(seq, "completed")
        self.sched.active = self._active()

    def _active(self) -> list:
        """The jobs in the batch, running or set aside, oldest first, each with its phase."""
        r = self.runner
        for s in r.running + r.parked:
            self.jobs[id(s)].publish(phase="preempted" if s.parked is not None else "decode" if s.remaining == 0
                                     else "prefill")
        return [self.jobs[id(s)] for s in sorted(r.running + r.parked, key=lambda s: s.admitted)]

    def _finish(self, seq: Sequence, outcome: str) -> None:
        """Count the job, hand its stats on and tell its client it is done."""
        job = self.jobs.pop(id(seq))
        stats = seq.stats if outcome != "failed" else None
        self.sched.finished(job, outcome, stats)
        self.sched.active = [j for j in self.sched.active if j is not job]
        if outcome == "cancelled":
            job.ended_by_stop()
        job.emit(End(stats))
