"""The server's queue under load: a full queue answers 503 with Retry-After, and many
clients at once all complete or get a clean 503, within the budget."""

from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from tests.server_harness import CHAT, Gate, LiveServer, request


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
                        return r.status, r.headers.get("Retry-After"), await r.text()
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
    finally:
        gate.open.set()
        live.close()


def test_many_clients_all_complete_or_get_a_clean_503(tiny_gemma3_dir):
    probe = Engine(str(tiny_gemma3_dir))
    budget = probe.footprint(512).total
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
