"""Bounded waits for a layer pipeline. A rank that stops answering (alive but
stuck, or cut off without its connection closing) leaves the engine thread blocked in a
transfer MLX cannot time out. This watchdog bounds the wait: past `stall_s` without an
event from the running job (a prefill chunk done, a token), the group is marked lost
(/health degraded, later requests 503) and the running and waiting jobs get
PipelineLost. The blocked thread stays behind: only restarting every rank mends it."""

from __future__ import annotations

import threading
import time

from justfit.engine.events import End, Failure
from justfit.errors import PipelineLost


class StallWatch(threading.Thread):
    """Watches `scheduler`'s running job and marks `pipeline_run` (a
    justfit.pipeline.layers.PipelineRun) lost (see the module's docstring)."""

    def __init__(self, scheduler, pipeline_run, stall_s: float, every: float = 0.25):
        super().__init__(name="justfit-stall-watch", daemon=True)
        self.scheduler, self.pipeline_run, self.stall_s, self.every = scheduler, pipeline_run, stall_s, every
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Stop watching (the scheduler is closing)."""
        self.stopped.set()

    def run(self) -> None:
        """Until stopped, or until it has marked the group lost."""
        while not self.stopped.wait(self.every):
            job, run = self.scheduler.running, self.pipeline_run
            if job is None or run.lost or time.monotonic() - job.status.last_event < self.stall_s:
                continue
            run.lost = f"no answer from the layer pipeline for {self.stall_s:g} s"
            error = PipelineLost(run.lost)
            for waiting in [job, *self.scheduler.queued()]:
                waiting.cancel.set()  # should the thread ever come back, it drops them
                waiting.emit(Failure.of(error))
                waiting.emit(End(None))
            return
