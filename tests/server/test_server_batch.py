"""`justfit serve --max-batch N`: concurrent clients are computed together and get the
replies they get one at a time; a short request is answered while a long prompt is
still prefilling; a client that disconnects leaves the batch and the rest finish; under
a budget for two, four clients get their replies, requests set aside on disk and back."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import ClientSession, ClientTimeout

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from tests.helpers.server_harness import LiveServer, request


def _completion(prompt: str, n: int) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0}


PROMPTS = ["the quick brown fox", "a b c d e f g h", "once upon a time there was", "hello"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), config=EngineConfig(prefill_chunk=32))


async def _post(session, url, body):
    async with session.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        return r.status, data, time.monotonic()


def _replies(live, bodies):
    async def go():
        async with ClientSession(timeout=ClientTimeout(total=120)) as s:
            return await asyncio.gather(*[_post(s, live.url, b) for b in bodies])

    return asyncio.run(go())


def _one_at_a_time(engine, bodies) -> list[str]:
    """Each body's reply text from a server without batching, one request after another."""
    alone = LiveServer(engine)
    try:
        return [_replies(alone, [b])[0][1]["choices"][0]["text"] for b in bodies]
    finally:
        alone.close()
        engine.reset()


def test_concurrent_clients_get_their_one_at_a_time_replies(engine):
    bodies = [_completion(p, 10) for p in PROMPTS]
    expected = _one_at_a_time(engine, bodies)
    batched = LiveServer(engine, max_batch=4)
    try:
        got = _replies(batched, bodies)
        assert all(status == 200 for status, _, _ in got)
        assert [d["choices"][0]["text"] for _, d, _ in got] == expected
        sched = batched.server.scheduler
        assert sched.completed == len(bodies) and not sched.active
    finally:
        batched.close()
    engine.reset()


def test_a_short_request_is_answered_during_a_long_prefill(engine):
    long_prompt = "lorem ipsum " * 30  # within the tiny model's 512 positions: many 32-token chunks
    assert 4 * 32 < len(engine.encode(long_prompt)) < 500
    live = LiveServer(engine, max_batch=2)
    try:
        async def go():
            async with ClientSession(timeout=ClientTimeout(total=120)) as s:
                long = asyncio.ensure_future(_post(s, live.url, _completion(long_prompt, 2)))
                for _ in range(2000):
                    if live.server.scheduler.active or long.done():
                        break
                    await asyncio.sleep(0.005)
                short = await _post(s, live.url, _completion("hi", 2))
                return short, await long

        (s_status, _, s_done), (l_status, _, l_done) = asyncio.run(go())
        assert s_status == 200 and l_status == 200
        assert s_done < l_done  # served between the long prompt's chunks, not after them
    finally:
        live.close()
    engine.reset()


def test_a_disconnected_client_leaves_the_batch(engine):
    live = LiveServer(engine, max_batch=4)
    try:
        async def go():
            async with ClientSession(timeout=ClientTimeout(total=120)) as s:
                keep = asyncio.ensure_future(_post(s, live.url, _completion(PROMPTS[0], 12)))
                body = {**_completion(PROMPTS[1], 400), "stream": True}
                async with s.post(live.url + "/v1/completions", json=body) as r:
                    async for _ in r.content:  # the first event, then hang up
                        break
                return await keep

        status, data, _ = asyncio.run(go())
        assert status == 200 and data["usage"]["completion_tokens"] == 12
        sched = live.server.scheduler
        end = time.monotonic() + 30
        while sched.active and time.monotonic() < end:
            time.sleep(0.01)
        assert sched.cancelled == 1 and sched.completed == 1 and not sched.active
    finally:
        live.close()
    engine.reset()


def test_four_clients_outgrowing_the_budget_get_their_replies_with_preemption(tiny_llama_dir, tmp_path):
    prompts = [" ".join(f"w{i}{j}" for j in range(40)) for i in range(4)]
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(budget_bytes=1 << 30, prefill_chunk=32,
                                                             state_dir=str(tmp_path)))
    longest = max(len(engine.encode(p)) for p in prompts) + 48
    assert longest < 400
    engine.reply(prompts[0], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))  # the reserve measured
    engine.reset()
    one, early = engine.planner.footprint(longest), engine.planner.footprint(longest - 40)
    # three join while their replies are short, and no longer fit together as they grow
    engine.set_budget(one.weights + one.working + one.transient + 3 * early.kv + one.reserve)
    bodies = [{**_completion(p, 48), "ignore_eos": True} for p in prompts]
    expected = _one_at_a_time(engine, bodies)
    live = LiveServer(engine, max_batch=4)
    try:
        got = _replies(live, bodies)
        assert [s for s, _, _ in got] == [200] * 4
        assert [d["choices"][0]["text"] for _, d, _ in got] == expected
        status = json.loads(request(live, "GET", "/v1/justfit/status")[2])
        queue, last = status["queue"], status["last_request"]
        assert queue["preemptions"] > 0 and queue["swap_s"] > 0 and queue["preempted"] == 0
        assert {"queue_s", "prefill_s", "decode_s", "preemptions", "preempted_s", "swap_s"} <= set(last)
    finally:
        live.close()
    engine.reset()
