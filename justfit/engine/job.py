"""A request as the engine thread sees it (`Job`), and what the engine publishes about
it while it runs (`JobStatus`).

Threads: the server's loop builds a job and hands it to the scheduler; from then on
only three things cross between the loop and the engine thread: the events queue
(engine -> loop, justfit.engine.events), the `cancel` event and the `stopping` event
(loop -> engine). What the status page, the metrics and a runner's stall watch read
about a running job is its `status`: a frozen JobStatus the engine thread alone
replaces whole, so a reader on any thread gets one consistent snapshot with one read.
(Applying events on the loop side instead would leave the status page as stale as the
slowest client's reads, and the stall watch needs the engine's own clock.)"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field, replace

from justfit.config import SamplingParams
from justfit.errors import ServerStopping
from justfit.engine.events import End, Event, Failure, JobStatus, Progress, Tick, Token


@dataclass
class Job:
    """One request for the engine thread: its tokens and sampling, and the events it sends back."""

    tokens: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    session: str | None = None
    scope: str = ""  # whose stored states it may reuse and write (a client key's hash; "": shared)
    route: str = ""  # the API it came through, for the status page
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)  # cancelled by the server's stop
    submitted: float = field(default_factory=time.monotonic)  # set on the loop before the engine sees it
    status: JobStatus = field(default_factory=JobStatus)  # replaced by the engine thread only

    def stop(self) -> None:
        """Cancel for the server's stop: its client is told so (503), not left with a short reply."""
        self.stopping.set()
        self.cancel.set()

    def ended_by_stop(self) -> None:
        """Tell the client a stop ended its request, when one did."""
        if self.stopping.is_set():
            self.emit(Failure.of(ServerStopping()))

    def publish(self, **changes) -> None:
        """Replace the status with `changes` applied (the engine thread only)."""
        self.status = replace(self.status, **changes)

    def emit(self, event: Event) -> None:
        """Send `event` to the job's loop (a Progress or Token moves the status on
        first); cancel the job when that loop is gone."""
        if isinstance(event, (Progress, Token)):  # sent by the engine thread only
            self.status = self.status.after(event)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's loop is gone: nobody is listening
            self.cancel.set()

    async def stream(self, tick: float | None = None):
        """The job's events up to and including End; with `tick`, also a Tick after
        every `tick` seconds without one (a long prefill chunk, a wait in the queue),
        so streams can keep proxies awake."""
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), tick)
            except TimeoutError:
                yield Tick(self.status, time.monotonic())
                continue
            yield event
            if isinstance(event, End):
                return
