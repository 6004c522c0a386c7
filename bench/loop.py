"""Sequences stepped through the scheduler's loop directly (no jobs, no thread), for
benchmarks that watch each sequence: `run_all` admits them in order as they fit."""

from __future__ import annotations

from typing import Iterator


def run_all(sched, seqs: list) -> Iterator[tuple]:
    """Step `sched` (a justfit.engine.scheduler.Scheduler built with serve=False) until
    every one of `seqs` ends, admitting them in order as they fit; what each step
    produced (Scheduler.step)."""
    waiting = list(seqs)
    while waiting or sched.live or sched.parked:
        while waiting and sched.fits(waiting[0]):
            sched.admit(waiting.pop(0))
        yield from sched.step()
