"""What the engine thread tells a request's HTTP side, one frozen event at a time
(justfit.engine.job: `Job.emit`, `Job.stream`). A request's events are Progress and
Token events, a Failure when it fails (or a server's stop ends it), then one End; a Tick
is made on the loop side when nothing arrived for a while. The HTTP side turns them into a reply
(justfit.server.pump)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from justfit.errors import error_code

if TYPE_CHECKING:
    from justfit.engine.job import JobStatus
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
