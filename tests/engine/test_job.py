"""A Job's typed events: what the engine thread sends, the status it publishes, the
stream the loop reads (ticks included)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from justfit.config import SamplingParams
from justfit.engine.events import End, Failure, Progress, Tick, Token
from justfit.engine.events import JobStatus
from justfit.engine.job import Job
from justfit.engine.stats import Chunk
from justfit.errors import INTERNAL_ERROR, ServerStopping


def test_events_are_frozen_and_a_failure_carries_its_code():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Progress(1, 2, 0.5).processed = 3
    assert Failure.of(ServerStopping()).code == "server_stopping"
    assert Failure.of(KeyError("x")).code == INTERNAL_ERROR


def test_the_engine_threads_events_reach_the_stream_and_move_the_status_on():
    async def main():
        job = Job([1, 2, 3], SamplingParams(max_tokens=2), asyncio.get_running_loop())
        first = job.status

        def engine_thread():
            job.publish(started=5.0, phase="prefill")
            job.emit(Progress(3, 3, 0.1))
            job.emit(Token(Chunk("a", 7)))
            job.emit(Token(Chunk("", None)))  # no token: text held back, nothing generated
            job.emit(End(None))

        threading.Thread(target=engine_thread).start()
        got = [e async for e in job.stream()]
        return job, first, got

    job, first, got = asyncio.run(main())
    assert [type(e) for e in got] == [Progress, Token, Token, End]
    assert first == JobStatus(last_event=first.last_event)  # the snapshot read earlier never changes
    s = job.status
    assert (s.started, s.processed, s.generated, s.phase) == (5.0, 3, 1, "prefill") and s.last_event >= first.last_event


def test_a_silent_stream_ticks_with_the_status_and_a_stop_says_so():
    async def main():
        job = Job([1], SamplingParams(max_tokens=1), asyncio.get_running_loop())
        stream = job.stream(tick=0.01)
        tick = await stream.__anext__()
        job.stop()
        job.ended_by_stop()  # what a worker does with a job the stop cancelled
        job.emit(End(None))
        return job, tick, [e async for e in stream]

    job, tick, rest = asyncio.run(main())
    assert isinstance(tick, Tick) and tick.status.started is None and tick.at > 0
    assert job.cancel.is_set() and [type(e) for e in rest] == [Failure, End]
    assert rest[0].code == "server_stopping"
