"""Templating, tokenization and planning run on the server's tokenizer thread, never on
the event loop: /health answers at once while a 100K-token prompt is tokenized."""

from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import ClientSession, ClientTimeout, web

from justfit import Engine
from justfit.config import EngineConfig
from justfit.server import Server, ServerConfig

PROMPT_TOKENS = 100_000
HOLD_S = 1.0
# A loop that tokenized itself would miss polls for HOLD_S or more; half of that leaves
# room for a busy machine's pause of one poll.
HEALTH_LIMIT_S = HOLD_S / 2


def _long_prompt(engine, tokens: int) -> str:
    """Text of at least `tokens` tokens."""
    text = "The quick brown fox jumps over the lazy dog; 0123456789 and more. " * 64
    per_copy = len(engine.encode(text))
    return text * (tokens // per_copy + 1)


async def _health_while_tokenizing(server: Server, prompt: str, path: str, body: dict):
    """(status and body of the long request, how long it took, every /health latency
    while it was in flight)."""
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with ClientSession(timeout=ClientTimeout(total=120)) as session:
            async def long_request():
                async with session.post(url + path, json=body) as r:
                    return r.status, await r.json()

            start = time.perf_counter()
            task = asyncio.create_task(long_request())
            latencies = []
            while not task.done():
                t = time.perf_counter()
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)
            return await task, time.perf_counter() - start, latencies
    finally:
        await runner.cleanup()


def test_health_answers_while_a_100k_token_prompt_is_tokenized(tiny_gemma3_dir):
    # A context the prompt's size alone does not rule out (justfit.server.prompt_bytes):
    # it is tokenized in full, then refused by its count.
    engine = Engine(str(tiny_gemma3_dir), config=EngineConfig(context_limit=16384))
    server = Server(engine, ServerConfig(port=0))
    prompt = _long_prompt(engine, PROMPT_TOKENS)
    start = time.perf_counter()
    n = len(engine.encode(prompt))
    tokenize_s = time.perf_counter() - start
    assert n >= PROMPT_TOKENS
    loop_threads = []
    # Which thread tokenizes; and at least HOLD_S per call, as a slow tokenizer or chat
    # template on a big prompt takes: a loop that ran it itself would miss every poll.
    engine.encode = _recording(engine.encode, loop_threads)
    (status, body), took, latencies = asyncio.run(
        _health_while_tokenizing(server, prompt, "/v1/completions", {"prompt": prompt, "max_tokens": 1}))
    # Tokenized in full, then planned: far past this model's context, refused with the count.
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["details"]["prompt_tokens"] == n
    assert loop_threads and all(name.startswith("justfit-tokenizer") for name in loop_threads)
    # The loop kept answering the whole time: many polls, none slow.
    assert took >= HOLD_S and len(latencies) >= 5, (took, tokenize_s, len(latencies))
    assert max(latencies) < HEALTH_LIMIT_S, max(latencies)
    server.close()


def _recording(encode, threads: list):
    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        start = time.perf_counter()
        out = encode(*args, **kwargs)
        time.sleep(max(0.0, HOLD_S - (time.perf_counter() - start)))
        return out

    return recorded
