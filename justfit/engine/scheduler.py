"""The step loop every request runs on, and the bounded queue in front of it.

The scheduler owns the queue (jobs waiting, in arrival order), admission (the head of
the queue joins while its plan fits beside the sequences computing: the planner is
asked here, `engine.planner.check_fits`, and the Sequence handed its plan), preemption (with
`preempt`, the most recently admitted sequence is parked on disk through StateTrans
when the next step would outgrow the budget, and resumed, before anything new joins,
once it fits again) and `step()`: admit, forward (justfit.engine.batch.forward: one
decode forward for every decoding sequence, one prefill chunk), postprocess (chunks
and progress to the jobs, finished sequences stored and measured as they leave).

The server's worker thread is `while not closing: step()` (blocking on the queue when
idle); `Engine.generate` drives the same loop in the caller's thread (`generate_here`,
a batch of one). The HTTP side talks to it through `Job`s (justfit.engine.job): typed
events (justfit.engine.events) come back on the job's asyncio queue, and setting
`cancel` stops the request within one step, its state stored. Every interaction with a
job is in the `_tell_*` functions below, on the engine's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from justfit import runtime
from justfit.config import SamplingParams
from justfit.engine.batch import Pipeline, Produced, forward
from justfit.planning.plan import RequestMeasure, measure_request
from justfit.engine.drafting import DrafterFactory
from justfit.engine.events import End, Event, Failure, Progress, Token
from justfit.engine.generate import ProgressFn
from justfit.engine.job import Job
from justfit.engine.sequence import Sequence, Status
from justfit.engine.stats import Chunk
from justfit.errors import JustFitError
from justfit.memory import trim_heap
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


log = logging.getLogger("justfit.scheduler")

# The status page's word for a job's phase, from its sequence's status.
PHASES = {Status.WAITING: "prefill", Status.PREFILLING: "prefill", Status.DECODING: "decode",
          Status.PARKED: "preempted", Status.FINISHED: "decode"}


def plan_sequence(engine, tokens: list[int], sp: SamplingParams, session: str | None = None, scope: str = "",
                  drafter: DrafterFactory | None = None) -> Sequence:
    """The planner's footprint for `tokens` alone (refusing, before any work, what cannot
    fit, and an output constraint that does not compile: GrammarError) handed to a new
    Sequence, its state kept where the engine's runner keeps it."""
    if not tokens:
        raise ValueError("empty prompt")
    if sp.constraint is not None:  # compiled once, then found in the cache by the sequence
        engine.grammars.check(sp.constraint)
        # The grammar tokenizer and the cache's room come out of a whole-process budget
        # from the first constrained request: measured before this one is planned.
        engine.budget.remeasure()
    offloaded, plan = engine.planner.check_fits(len(tokens), sp.max_tokens)
    return Sequence(engine, tokens, sp, offloaded, plan, engine.runner.states(engine), session, scope, drafter)


class Scheduler:
    """The queue, the sequences computing (`live`) and set aside (`parked`), and the
    step loop over them (see the module doc); with `serve`, its own worker thread runs
    the loop, and the engine's runner may watch, given `stall_s`, for a request that
    stops moving."""

    def __init__(self, engine, max_queue: int = 16, on_done: Callable[[Any], None] | None = None,
                 max_batch: int = 1, preempt: bool = True, stall_s: float | None = None,
                 step_tokens: int = 128, serve: bool = True):
        if max_batch < 1 or step_tokens < 1:
            raise ValueError("max_batch and step_tokens must be >= 1")
        self.engine, self.max_queue, self.on_done, self.max_batch = engine, max_queue, on_done, max_batch
        self.preempt = preempt  # park sequences on disk rather than count each at its plan's end
        # While any sequence decodes, a step's prefill chunk is at most step_tokens, so
        # the decoding replies keep their pace during a long prefill.
        self.step_tokens = step_tokens
        # The decode step dispatched ahead (justfit.engine.batch.Pipeline), where the
        # engine's settings pipeline decode steps: undone before anything changes a
        # sequence's cache or stores it. None: never.
        self.pipe: Pipeline | None = Pipeline()
        self._queue: deque[Job | None] = deque()  # None: the signal to stop
        self._arrived = threading.Condition()  # guards _queue; notified on every put
        self.live: list[Sequence] = []  # computing, in admission order
        self.parked: list[Sequence] = []  # preempted, in admission order: resumed first
        self._jobs: dict[int, Job] = {}  # id(Sequence) -> its job (none for a sequence admitted directly)
        self._measures: dict[int, RequestMeasure] = {}  # id(Sequence) -> its measure, done as it leaves
        self._shared: set[int] = set()  # ids of sequences that computed beside another
        self._admitting: Job | None = None  # the queue's head while it is planned and started
        self._planned: tuple[Job, Sequence] | None = None  # the head, planned, waiting for room
        self._closing = False
        self._admitted = 0
        self.steps = 0  # decode forwards taken
        self.preemptions, self.swap_s = 0, 0.0
        self.completed = self.cancelled = self.failed = self.rejected = 0
        self._seconds = 1.0  # recent request duration, for Retry-After
        self.last_stats = None  # the stats of the request that finished last
        self.tickets = Tickets()  # places kept for clients turned away (touched on the server's loop only)
        self._thread = threading.Thread(target=self._serve, name="justfit-engine", daemon=True) if serve else None
        if self._thread is not None:
            self._thread.start()
        # The runner's bound on a request that stops moving, or None where it needs none.
        self.watch = engine.runner.watch(self, stall_s) if stall_s is not None else None

    # -- what runs now, derived ----------------------------------------------------
    @property
    def busy(self) -> bool:
        """Sequences computing or set aside."""
        return bool(self.live or self.parked)

    @property
    def active(self) -> list[Job]:
        """The jobs computing now, oldest first (set aside ones included)."""
        jobs = []
        for seq in sorted(list(self.live) + list(self.parked), key=lambda s: s.admitted):
            job = self._jobs.get(id(seq))
            if job is not None:
                jobs.append(job)
        admitting = self._admitting
        return jobs + ([admitting] if admitting is not None and admitting not in jobs else [])

    @property
    def running(self) -> Job | None:
        """The oldest job computing now, or None."""
        active = self.active
        return active[0] if active else None

    @property
    def waiting(self) -> int:
        """Jobs waiting in the queue (the running ones excluded)."""
        with self._arrived:
            return sum(j is not None for j in self._queue)

    def queued(self) -> list[Job]:
        """The jobs waiting, in order (a snapshot)."""
        with self._arrived:
            return [j for j in self._queue if j is not None]

    def live_layers(self) -> list:
        """Every layer of the running sequences' caches (the status page's KV), a snapshot."""
        return [layer for s in list(self.live) if s.cache is not None for layer in s.cache]

    def batch_stats(self) -> dict:
        """Sequences set aside now, preemptions so far, seconds swapping."""
        return {"preempted": len(self.parked), "preemptions": self.preemptions, "swap_s": round(self.swap_s, 3)}

    def idle(self) -> bool:
        """Nothing computing, set aside or waiting."""
        return not self.busy and self._admitting is None and not self.waiting

    def uses_session(self, name: str, scope: str) -> bool:
        """Whether a job computing or waiting names session `name` of `scope`."""
        return any(j.session == name and j.scope == scope for j in self.active + self.queued())

    # -- the queue -------------------------------------------------------------------
    def _put(self, job: Job | None, at: int | None = None) -> None:
        with self._arrived:
            self._queue.insert(len(self._queue) if at is None else at, job)
            self._arrived.notify()

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

    def next_job(self, block: bool) -> tuple[Job | None, bool]:
        """Take the first job waiting out of the queue (waiting for one if `block`);
        None when there is none or the scheduler is closing (the second value)."""
        with self._arrived:
            while block and not self._queue:
                self._arrived.wait()
            if not self._queue or self._queue[0] is None:
                return None, bool(self._queue)
            return self._queue.popleft(), False

    def stop_all(self) -> int:
        """Cancel every job, computing or waiting, for the server's stop; how many."""
        jobs = self.active + self.queued()
        for job in jobs:
            job.stop()
        return len(jobs)

    def close(self) -> None:
        """Cancel the running jobs and stop the worker thread once what is queued is done."""
        if self.watch is not None:
            self.watch.stop()
        for job in self.active:
            job.cancel.set()
        self._put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

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

    # -- the loop --------------------------------------------------------------------
    def _serve(self) -> None:
        """The worker thread: steps until the scheduler closes and its queue and batch drain."""
        runtime.setup()  # this thread computes on the shared execution stream
        while not (self._closing and not self.busy):
            self.step(block=True)

    def step(self, block: bool = False) -> Produced:
        """Admit what fits from the queue (waiting for a job if `block` and nothing
        runs), drop what was cancelled, run one forward and hand on what it produced;
        what each sequence produced, in order (None: a prefill chunk)."""
        self._admit(block and not self.busy)
        self.drop_cancelled()
        if not self.live and not self.parked:
            return []
        try:
            produced = self._forward()
        except Exception as e:  # a failed step leaves every sequence's cache unknown: end them all
            self._fail_all(e)
            return []
        self._postprocess(produced)
        return produced

    def _forward(self) -> Produced:
        """Resume and park to fit the budget, one forward, finished sequences out."""
        if self.preempt:
            self._resume()
            self._make_room()
        prefilling = any(s.remaining > 0 for s in self.live)
        pipe = self.pipe if self.pipe is not None and self.engine.config.pipeline else None
        produced, forwards = forward(self.engine, self.live, self.step_tokens, pipe)
        self.steps += forwards
        # Under a budget the C heap's free pages go back to the system after each prefill
        # chunk and every 16 decode steps: MLX's many small buffers fragment the heap, and
        # what fragments hold counts against a budget but not in MLX's accounting.
        if self.engine.budget.bytes is not None and (prefilling or self.steps % 16 == 0):
            trim_heap()
        for s in [s for s in self.live if s.finished]:
            self.leave(s)
        return produced

    def _postprocess(self, produced: Produced) -> None:
        """Progress and chunks to the jobs; a finished one is told it is done."""
        for seq, chunk in produced:
            job = self._jobs.get(id(seq))
            if job is None:  # admitted directly, or finished earlier in these results
                continue
            if chunk is None or job.status.processed < len(seq.tokens):  # a prefill chunk, or the prompt's last
                _tell_progress(job, len(seq.tokens) if chunk is not None else len(seq.held), len(seq.tokens))
            if chunk is None:
                continue
            _tell_chunk(job, chunk)
            if seq.finished and chunk.finish_reason is not None:
                self._finish(seq, "completed")
        for seq in self.live + self.parked:
            job = self._jobs.get(id(seq))
            if job is not None:
                _tell_phase(job, PHASES[seq.status])

    def drop_cancelled(self) -> None:
        """Sequences whose client went away leave, their state stored."""
        for seq in self.live + self.parked:
            job = self._jobs.get(id(seq))
            if job is not None and job.cancel.is_set():
                self.leave(seq)
                self._finish(seq, "cancelled")

    def _fail_all(self, error: Exception) -> None:
        """End every sequence after a failed step, their jobs told what it means."""
        ended = self.live + self.parked
        if self.pipe is not None:  # the caches are unknown: nothing is stored from them
            self.pipe.discard()
        if not any(isinstance(s.source.failure(error), JustFitError) for s in ended):
            log.exception("step failed", exc_info=error)
        for seq in ended:
            told = seq.source.failure(error)
            self.leave(seq)
            job = self._jobs.get(id(seq))
            if job is not None:
                _tell_error(job, told)
                self._finish(seq, "failed")

    def _finish(self, seq: Sequence, outcome: str) -> None:
        """Count the job, hand its stats on and tell its client it is done."""
        job = self._jobs.pop(id(seq))
        stats = seq.stats if outcome != "failed" else None
        self.finished(job, outcome, stats)
        if outcome == "cancelled":
            _tell_stopped(job)
        _tell_done(job, stats)

    # -- admission -------------------------------------------------------------------
    def _admit(self, block: bool) -> None:
        """Start jobs from the head of the queue while a row is free and they fit (the
        head waits, planned, for room: order is kept); notes when the queue closed."""
        while len(self.live) < self.max_batch and not self.parked:
            job, closing = self.next_job(block)
            block = False
            if job is None:
                self._closing = self._closing or closing
                return
            if job.cancel.is_set():  # its client left while it waited
                self.finished(job, "cancelled")
                _tell_stopped(job)
                _tell_done(job, None)
                continue
            if not self._start(job):
                return

    def _start(self, job: Job) -> bool:
        """Plan `job` and admit it when it fits; False when it must wait for room."""
        _tell_started(job)
        self._admitting = job
        try:
            seq = self._planned[1] if self._planned and self._planned[0] is job else self._plan(job)
            self._planned = None
            if seq is None:
                return True
            if not self.fits(seq):  # it waits at the head, planned, for room beside the batch
                self._planned = (job, seq)
                _tell_waiting(job)
                self._put(job, 0)
                return False
            try:
                self.admit(seq, job)
            except Exception as e:
                self._fail(job, seq.source.failure(e))
                return True
            _tell_progress(job, len(seq.held), len(seq.tokens))  # what a stored state already holds
            return True
        finally:
            self._admitting = None

    def _plan(self, job: Job) -> Sequence | None:
        """The job's sequence (the planner refuses what cannot fit alone), or None
        when it was refused or failed (its client told)."""
        try:
            return plan_sequence(self.engine, job.tokens, job.sampling, job.session, job.scope)
        except Exception as e:
            self._fail(job, e)
            return None

    def _fail(self, job: Job, error: Exception) -> None:
        if not isinstance(error, JustFitError):
            log.exception("request failed", exc_info=error)
        self.finished(job, "failed")
        _tell_error(job, error)
        _tell_done(job, None)

    def _counted(self, seq: Sequence) -> int:
        """Positions `seq` is counted at: with `preempt`, what it holds after its next
        step (its whole prompt from the start), so more fit; else its plan's end."""
        if not self.preempt:
            return seq.plan.positions
        return min(seq.plan.positions, max(len(seq.tokens), len(seq.held)) + 1)

    def _need(self, seqs: list[Sequence]) -> int:
        """Bytes `seqs` need together: weights and the largest transient once, every
        sequence's KV, the largest reserve."""
        plans = [s.plan.at(self._counted(s)) for s in seqs]
        shared = max(p.weights + p.working + p.transient for p in plans)
        return shared + sum(p.kv for p in plans) + max(p.reserve for p in plans)

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join now: nothing parked waits before it, a free row, the
        same layers on disk as the batch, and within the budget beside the batch."""
        if self.parked and seq is not self.parked[0]:
            return False
        if not self.live:
            return True
        if len(self.live) >= self.max_batch or seq.offloaded != tuple(self.engine.swap.offloaded):
            return False
        budget = self.engine.budget.bytes
        return budget is None or self._need(self.live + [seq]) <= budget

    def admit(self, seq: Sequence, job: Job | None = None) -> None:
        """Start `seq` (for `job`, if any) beside the batch (the caller checked `fits`);
        it is measured from here until it leaves."""
        e = self.engine
        if not self.live:
            e.swap.offload(seq.offloaded)
        budget = e.budget.bytes
        # Stored states in memory keep out of what the batch needs now and of what this
        # sequence needs at its plan's end (alone, nothing is set aside to make room).
        need = max(self._need(self.live + [seq]), seq.plan.total)
        measure = measure_request(e.planner)
        try:
            seq.start(None if budget is None else max(0, budget - need))
        except BaseException:
            if measure.watch is not None:
                measure.watch.stop()
            raise
        if self.busy:  # the reserve is measured on requests that computed alone
            self._shared.update([id(s) for s in self.live + self.parked] + [id(seq)])
        self._admitted += 1
        seq.admitted = self._admitted
        self._measures[id(seq)] = measure
        if job is not None:
            self._jobs[id(seq)] = job
        self.live.append(seq)

    def _settle(self) -> None:
        """Undo the decode step dispatched ahead, if any: the batch is about to change."""
        if self.pipe is not None:
            self.pipe.settle()

    # -- preemption ------------------------------------------------------------------
    def _resume(self) -> None:
        """Parked sequences back, oldest first, while they fit."""
        while self.parked and self.fits(self.parked[0]):
            seq = self.parked.pop(0)
            if not self.live:
                self.engine.swap.offload(seq.offloaded)
            self.swap_s += seq.resume()
            self.live.append(seq)
            self.live.sort(key=lambda s: s.admitted)

    def _make_room(self) -> None:
        """Park the most recently admitted sequences until the next step fits (one always runs)."""
        budget = self.engine.budget.bytes
        while budget is not None and len(self.live) > 1 and self._need(self.live) > budget:
            self._settle()
            seq = self.live[-1]
            try:
                self.swap_s += seq.park()
            except Exception as e:  # e.g. a full disk: it keeps running, over the estimate
                log.warning("could not preempt a sequence to disk: %s", e)
                return
            self.live.pop()
            self.parked.append(seq)
            self.parked.sort(key=lambda s: s.admitted)
            self.preemptions += 1

    def leave(self, seq: Sequence) -> None:
        """Take `seq` out, running or parked (finished, cancelled or failed), storing
        what it computed; the one place a request is measured as it ends."""
        self._settle()
        if seq in self.live:
            self.live.remove(seq)
        if seq in self.parked:
            self.parked.remove(seq)
        try:
            seq.store()
            if not self.busy:  # as after a lone request: stored states back within what the budget leaves
                e = self.engine
                e.states.fit(e.planner.state_allowance(e.planner.footprint(1, e.swap.offloaded)))
        finally:
            measure, shared = self._measures.pop(id(seq), None), id(seq) in self._shared
            self._shared.discard(id(seq))
            if measure is not None:  # a batch's MLX peak is not one request's: only a lone one counts it
                measure.done(seq.plan, len(seq.held), None if shared else seq.stats.memory)


# -- a job's events: every interaction with a job is here ---------------------------
def _tell_started(job: Job) -> None:
    now = time.monotonic()
    job.publish(started=now, last_event=now)  # its wait in the queue is no stall


def _tell_waiting(job: Job) -> None:
    """Back at the head of the queue, waiting for room."""
    job.publish(started=None)


def _tell_phase(job: Job, phase: str) -> None:
    """What the status page shows it doing (prefill, decode, preempted)."""
    if job.status.phase != phase:
        job.publish(phase=phase)


def _tell_progress(job: Job, processed: int, total: int) -> None:
    job.emit(Progress(processed, total, time.monotonic() - job.status.started))


def _tell_chunk(job: Job, chunk: Chunk) -> None:
    job.emit(Token(chunk))


def _tell_error(job: Job, error: Exception) -> None:
    job.emit(Failure.of(error))


def _tell_stopped(job: Job) -> None:
    """A stop of the server ended the job, when one did (its client is told so)."""
    job.ended_by_stop()


def _tell_done(job: Job, stats) -> None:
    job.emit(End(stats))


# -- Engine.generate -------------------------------------------------------------------
@dataclass
class _CallerJob(Job):
    """A job whose events the caller's thread takes itself (no server loop); its
    progress is reported as it happens, within the step (a caller may act on it
    before the next chunk is computed)."""

    loop: Any = None
    progress: ProgressFn | None = None
    inbox: deque = field(default_factory=deque)

    def emit(self, event: Event) -> None:
        """Progress to the caller's callback at once; the rest to the caller's inbox."""
        if isinstance(event, (Progress, Token)):
            self.status = self.status.after(event)
        if not isinstance(event, Progress):
            self.inbox.append(event)
        elif self.progress is not None:
            self.progress(event.processed, event.total)


def generate_here(engine, tokens: list[int], sp: SamplingParams, progress: ProgressFn | None = None,
                  session: str | None = None, scope: str = "") -> Iterator[Chunk]:
    """Stream the reply to `tokens` through the step loop in the caller's thread: a
    lone request is a batch of one (see Engine.generate). Closing the iterator early
    cancels it between steps, the state computed so far stored."""
    sched = Scheduler(engine, max_batch=1, serve=False)
    job = _CallerJob(tokens, sp, session=session, scope=scope, progress=progress)
    sched.submit(job)
    try:
        while True:
            sched.step()
            while job.inbox:
                event = job.inbox.popleft()
                if isinstance(event, Token):
                    yield event.chunk
                elif isinstance(event, Failure):
                    raise event.error
                elif isinstance(event, End):
                    return
    finally:
        job.cancel.set()
        sched.drop_cancelled()
