"""What the engine thread tells a request's HTTP side, one frozen event at a time
(justfit.engine.job: `Job.emit`, `Job.stream`). A request's events are Progress and
Token events, a Failure when it fails (or a server's stop ends it), then one End; a Tick
is made on the loop side when nothing arrived for a while. The HTTP side turns them into a reply
(justfit.server.pump)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

from justfit.errors import error_code

if TYPE_CHECKING:
    from justfit.engine.stats import Chunk, GenerationStats


@dataclass(frozen=True)
class Progress:
    """Prompt positions computed so far (cached ones included) of `total`, `elapsed`
    seconds after the request started computing."""

    processed: int
    total: int
    elapsed: float


@dataclass(frozen=True)
class Token:
    """One piece of output: the engine's Chunk (its text, token id, log-probabilities,
    and on the last one the finish reason)."""

    chunk: Chunk


@dataclass(frozen=True)
class Failure:
    """The request failed: the exception, and the stable code its answer carries
    (justfit.errors; the server maps codes to HTTP statuses)."""

    error: BaseException
    code: str

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        """`error` with its code."""
        return cls(error, error_code(error))


@dataclass(frozen=True)
class End:
    """The request is over: its stats, or None when it failed or never ran."""

    stats: GenerationStats | None


@dataclass(frozen=True)
class Tick:
    """No event for the stream's tick period (a long prefill chunk, a wait in the
    queue): the job's status as last published, and when (monotonic seconds)."""

    status: JobStatus
    at: float


Event = Union[Progress, Token, Failure, End, Tick]


@dataclass(frozen=True)
class JobStatus:
    """A running job as last published by the engine thread."""

    started: float | None = None  # when it left the queue (monotonic); None while it waits
    processed: int = 0  # prompt positions computed so far (cached ones included)
    generated: int = 0  # tokens generated so far
    phase: str = ""  # with batching: "prefill", "decode" or "preempted" (set aside on disk)
    last_event: float = field(default_factory=time.monotonic)  # for a runner's watch (justfit.pipeline.stall)

    def after(self, event: Event) -> JobStatus:
        """This status once `event` is sent: a Progress or Token moves it on."""
        now = time.monotonic()
        if isinstance(event, Progress):
            return replace(self, processed=event.processed, last_event=now)
        if isinstance(event, Token):
            return replace(self, generated=self.generated + (event.chunk.token is not None), last_event=now)
        return self
