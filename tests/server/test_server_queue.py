"""The server's queue under load: a full queue answers 503 with Retry-After and a
ticket; a retry with its ticket goes ahead of later arrivals, and a ticket lapses;
many clients at once all complete or get a clean 503, within the budget."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import ClientSession

import pytest

from justfit import Engine
from justfit.config import EngineConfig, SamplingParams
from justfit.engine.job import Job
from justfit.engine.scheduler import QueueFull, Scheduler
from justfit.engine.tickets import TICKET_HEADER, Tickets
from tests.helpers.server_harness import CHAT, Gate, LiveServer, Starting, request


@pytest.fixture(scope="module")
def tiny_engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))


def test_queue_full_is_503_with_retry_after(tiny_engine):
    gate = Gate(tiny_engine)
    live = LiveServer(gate, max_queue=1)
    try:
        async def go():
            async with ClientSession() as s:
                async def one():
                    async with s.post(live.url + "/v1/chat/completions", json=CHAT) as r:
                        return r.status, r.headers.get("Retry-After"), await r.text(), r.headers.get(TICKET_HEADER)
                first = asyncio.ensure_future(one())
                while not live.server.scheduler.running:
                    await asyncio.sleep(0.01)
                second = asyncio.ensure_future(one())
                while not live.server.scheduler.waiting:
                    await asyncio.sleep(0.01)
                third = await one()  # one running, one waiting: full
                gate.open.set()
                return await first, await second, third

        first, second, third = asyncio.run(go())
        assert first[0] == second[0] == 200
        assert third[0] == 503 and int(third[1]) >= 1 and json.loads(third[2])["error"]["code"] == "server_busy"
        assert third[3] and json.loads(third[2])["error"]["details"]["ticket"] == third[3]
    finally:
        gate.open.set()
        live.close()


class Turnstile(Starting):
    """The engine, each request held as it starts until the test lets one through."""

    def __init__(self, engine):
        self.turns = threading.Semaphore(0)
        super().__init__(engine, lambda: self._turn())

    def _turn(self) -> None:
        assert self.turns.acquire(timeout=30)


def test_a_retry_with_its_ticket_goes_ahead_of_later_arrivals(tiny_engine):
    gate = Turnstile(tiny_engine)
    sched = Scheduler(gate, max_queue=1)
    loop = asyncio.new_event_loop()

    def job(name: str) -> Job:
        return Job([5, 6, 7], SamplingParams(max_tokens=2), loop, route=name)

    def until(cond) -> None:
        for _ in range(3000):
            if cond():
                return
            time.sleep(0.01)
        raise AssertionError("timed out")

    try:
        sched.submit(job("a"))
        until(lambda: sched.running is not None)
        sched.submit(job("b"))  # waits: the queue is full
        with pytest.raises(QueueFull) as turned_away:
            sched.submit(job("c"))
        ticket = turned_away.value.ticket
        with pytest.raises(QueueFull) as again:
            sched.submit(job("c"), "forged")  # an unknown ticket is no ticket
        assert again.value.ticket != ticket
        gate.turns.release()  # a finishes, b runs, the queue has room
        until(lambda: sched.completed == 1 and not sched.waiting)
        sched.submit(job("d"))  # no ticket: queued, though it came after c's first try
        c = job("c")
        assert sched.submit(c, ticket) == 1  # past the bound, ahead of d: only b is before it
        assert [j.route for j in sched.queued()] == ["c", "d"]
        assert c.submitted < sched.queued()[1].submitted  # c's wait counts from its first try
        with pytest.raises(QueueFull):
            sched.submit(job("e"), ticket)  # a ticket is spent once
        for _ in range(3):
            gate.turns.release()
        until(lambda: sched.completed == 4)
        assert len(sched.tickets) == 2  # e's and the forged try's, lapsing in time
    finally:
        for _ in range(8):
            gate.turns.release()
        sched.close()
        loop.close()


def test_a_ticket_lapses_when_its_client_does_not_return():
    t = Tickets()
    a = t.hold(None, now=0.0, until=10.0)
    b = t.hold(None, now=1.0, until=20.0)
    assert t.hold(a, now=5.0, until=12.0) == a  # a retry turned away again keeps its ticket
    t.expire(15.0)
    assert t.redeem(a) is None and t.redeem("forged") is None
    assert t.redeem(b) == 1.0 and len(t) == 0


def test_many_clients_all_complete_or_get_a_clean_503(tiny_gemma3_dir):
    probe = Engine(str(tiny_gemma3_dir))
    budget = probe.planner.footprint(512).total
    engine = Engine(str(tiny_gemma3_dir), budget=budget)
    live = LiveServer(engine, max_queue=3)
    outcomes = []
    try:
        async def client(s, i):
            for j in range(3):
                body = {**CHAT, "messages": [{"role": "user", "content": f"client {i} asks {j}"}],
                        "stream": bool(j % 2)}
                for _ in range(200):
                    async with s.post(live.url + "/v1/chat/completions", json=body) as r:
                        text = await r.text()
                        outcomes.append(r.status)
                        if r.status == 503:
                            assert r.headers["Retry-After"]
                            await asyncio.sleep(0.05)
                            continue
                        assert r.status == 200 and (text.rstrip().endswith("[DONE]") or json.loads(text)["choices"])
                        break

        async def go():
            async with ClientSession() as s:
                await asyncio.gather(*(client(s, i) for i in range(8)))

        asyncio.run(go())
        assert outcomes.count(200) == 24 and set(outcomes) <= {200, 503}
        status = json.loads(request(live, "GET", "/v1/justfit/status")[2])
        assert status["requests"]["completed"] == 24 and status["queue"]["waiting"] == 0
        m = status["memory"]
        assert m["weights"] + status["states"]["in_memory"] <= budget
    finally:
        live.close()
