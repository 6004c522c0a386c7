"""The scheduler's worker loop with batching on (`Scheduler(max_batch=N)`, `justfit
serve --max-batch N`): jobs leave the queue in arrival order and join the batch while
their plans fit beside the running ones (the head of the queue waits, so order is
kept); each step serves every running job (justfit.batch.BatchRunner.step); a job
whose client went away leaves the batch before the next step, its state stored."""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from justfit import runtime
from justfit.batch import BatchRunner
from justfit.batch_sequence import Sequence
from justfit.errors import JustFitError

if TYPE_CHECKING:
    from justfit.scheduler import Job, Scheduler

log = logging.getLogger("justfit.scheduler")


def work_batched(sched: Scheduler) -> None:
    """Run jobs from `sched`'s queue in batches until it is closed and drained."""
    runtime.setup()  # this thread computes on the shared execution stream
    runner = sched.batch = BatchRunner(sched.engine, sched.max_batch, preempt=sched.preempt)
    seqs: dict[int, Job] = {}  # id(Sequence) -> its job
    taken: list[Job] = []  # out of the queue, not yet admitted, in arrival order
    closing, was_busy = False, False
    while True:
        busy = bool(runner.running or runner.parked)
        if was_busy and not busy:
            # The batch drained: what the process holds besides MLX is measured again,
            # as after a lone request (a whole-process budget's outside share).
            runner.engine.remeasure_outside()
        was_busy = busy
        closing = _take_arrivals(sched, taken, block=not busy and not taken) or closing
        if closing and not busy and not taken:
            return
        _admit(sched, runner, taken, seqs)
        for seq in runner.running + runner.parked:
            job = seqs[id(seq)]
            if job.cancel.is_set():
                runner.leave(seq)
                _finish(sched, seqs.pop(id(seq)), seq, "cancelled")
        if not runner.running and not runner.parked:
            continue
        try:
            results = runner.step()
        except Exception as e:  # a failed step leaves every sequence's cache unknown: end them all
            log.exception("batched step failed")
            for seq in runner.running + runner.parked:
                runner.leave(seq)
                job = seqs.pop(id(seq))
                job.emit("error", e)
                _finish(sched, job, seq, "failed")
            continue
        for seq, chunk in results:
            job = seqs[id(seq)]
            job.processed = len(seq.held)
            if chunk is None:
                job.emit("progress", (len(seq.held), len(seq.tokens), time.monotonic() - job.started))
                continue
            job.generated += chunk.token is not None
            job.emit("chunk", chunk)
            if seq.finished:
                _finish(sched, seqs.pop(id(seq)), seq, "completed")
        sched.active = _active(runner, seqs)


def _active(runner: BatchRunner, seqs: dict) -> list:
    """The jobs in the batch, running or set aside, oldest first, each with its phase;
    the running sequences' caches as the engine's live state (the status page's KV)."""
    for s in runner.running + runner.parked:
        seqs[id(s)].phase = "preempted" if s.parked is not None else "decode" if s.remaining == 0 else "prefill"
    runner.engine.live_cache = [layer for s in runner.running if s.cache for layer in s.cache] or None
    return [seqs[id(s)] for s in sorted(runner.running + runner.parked, key=lambda s: s.admitted)]


def _take_arrivals(sched: Scheduler, taken: list, block: bool) -> bool:
    """Move what waits in the queue to `taken` (waiting for one if `block`); True once
    the scheduler is closing."""
    try:
        while True:
            job = sched._queue.get() if block else sched._queue.get_nowait()
            block = False
            if job is None:
                return True
            taken.append(job)
    except queue.Empty:
        return False


def _admit(sched: Scheduler, runner: BatchRunner, taken: list, seqs: dict) -> None:
    """Start jobs from the head of `taken` while they fit beside the batch."""
    while taken:
        job = taken[0]
        if job.cancel.is_set():  # its client left while it waited
            taken.pop(0)
            sched.cancelled += 1
            job.ended_by_stop()
            job.emit("done", None)
            continue
        try:
            seq = Sequence(sched.engine, job.tokens, job.sampling, job.session, job.scope)  # refuses what cannot fit alone
        except Exception as e:
            taken.pop(0)
            if not isinstance(e, JustFitError):
                log.exception("request failed")
            sched.failed += 1
            job.emit("error", e)
            job.emit("done", None)
            continue
        if not runner.fits(seq):
            return  # the head waits for room; those behind it wait behind it
        taken.pop(0)
        job.started = time.monotonic()
        try:
            runner.admit(seq)
        except Exception as e:
            log.exception("request failed")
            sched.failed += 1
            job.emit("error", e)
            job.emit("done", None)
            continue
        seqs[id(seq)] = job
        sched.active = _active(runner, seqs)


def _finish(sched: Scheduler, job: Job, seq: Sequence, outcome: str) -> None:
    """Count the job, hand its stats on and tell its client it is done."""
    setattr(sched, outcome, getattr(sched, outcome) + 1)
    stats = seq.stats if outcome != "failed" else None
    if stats is not None:
        stats.queue_s = job.started - job.submitted
        sched.engine.last_stats = stats
        if sched.on_done:
            sched.on_done(stats)
    sched._seconds = 0.7 * sched._seconds + 0.3 * (time.monotonic() - job.started)
    sched.active = [j for j in sched.active if j is not job]
    if outcome == "cancelled":
        job.ended_by_stop()
    job.emit("done", stats)
