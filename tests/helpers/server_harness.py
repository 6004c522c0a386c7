"""A live `justfit serve` for tests: a server on a random port on its own event loop
thread, a one-request client, /health's latency, and an engine whose generation waits for a gate."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import ClientSession, ClientTimeout, web

from justfit.server import Server, ServerConfig, connections


class LiveServer:
    """A server on a random port, on its own event loop thread."""

    def __init__(self, engine, **config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(engine, ServerConfig(port=0, **config))

        async def start():  # the listener `justfit serve` uses: timeouts and the connection limit
            self.runner = web.AppRunner(self.server.app(), handler_cancellation=True)
            await self.runner.setup()
            self.site, port = await connections.listener(self.server.config)(self.runner, "127.0.0.1", 0)
            return port

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def idle(self, timeout=30.0):
        """Wait until the engine thread has nothing running or waiting."""
        end = time.monotonic() + timeout
        while (self.server.scheduler.running or self.server.scheduler.waiting) and time.monotonic() < end:
            time.sleep(0.01)


def request(live, method, path, body=None, raw=None, headers=None):
    """(status, headers, text) of one request, sent with aiohttp from a fresh loop."""
    async def go():
        async with ClientSession(timeout=ClientTimeout(total=60)) as s:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            async with s.request(method, live.url + path, data=data, headers=headers) as r:
                return r.status, r.headers, await r.text()

    return asyncio.run(go())


async def health_latency(port: int) -> float:
    """One GET /health on a new connection: its latency (connect to full answer)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    return time.perf_counter() - start


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0}


class Starting:
    """The engine, calling `hook()` on the engine thread as each request starts (when
    its sequence takes its stored state), before any work."""

    def __init__(self, engine, hook):
        self._engine, self._hook = engine, hook

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def states(self):
        return _HookedStates(self._engine.states, self._hook)


class _HookedStates:
    def __init__(self, states, hook):
        self._states, self._hook = states, hook

    def __getattr__(self, name):
        return getattr(self._states, name)

    def take(self, *args, **kwargs):
        self._hook()
        return self._states.take(*args, **kwargs)


class Gate(Starting):
    """The engine, each request held as it starts until the test opens the gate."""

    def __init__(self, engine):
        self.open = threading.Event()
        super().__init__(engine, lambda: self.open.wait(30))
