"""How `justfit serve` runs and stops. SIGTERM, SIGINT and SIGHUP (what service
managers, a terminal and a closed session send) start a graceful stop: the listening
socket closes, new requests on open connections get 503, running and queued requests
get up to the drain time to finish, whatever is left is cancelled (its client told
so, its computed state stored), every queued session write is published and fsynced,
and `run` returns so the process exits 0. A second signal ends the drain at once.

A session's turn is durable before its response's last byte: the routes wait for the
write-through of the turn (`Server.state_outcome`) before they end the response, and
say in it when the state could not be stored."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

from aiohttp import web

log = logging.getLogger("justfit.server")

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
REPEAT_S = 1.0  # a second stop signal sooner than this is the same stop, delivered twice
SETTLE_S = 10.0  # after the drain: how long cancelled requests get to store their state and answer


class Stopper:
    """The stop signals, caught on the event loop: `requested` is set by the first,
    `hurry` by the second."""

    def __init__(self) -> None:
        self.requested, self.hurry = asyncio.Event(), asyncio.Event()
        self.signal = ""
        self.at = 0.0  # when the stop was requested (monotonic)
        self._installed: list[int] = []

    def install(self) -> None:
        """Catch the stop signals on the running loop (where the platform allows it)."""
        loop = asyncio.get_running_loop()
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                loop.add_signal_handler(signum, self._caught, name)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
                continue
            self._installed.append(signum)

    def remove(self) -> None:
        """Give the signals back to their default handling."""
        loop = asyncio.get_running_loop()
        for signum in self._installed:
            loop.remove_signal_handler(signum)
        self._installed = []

    def _caught(self, name: str) -> None:
        if self.requested.is_set() and time.monotonic() - self.at < REPEAT_S:
            return  # the same stop twice: from a layer pipeline's launcher and from the terminal or group
        if self.requested.is_set():
            log.warning("%s again: cancelling what is left now", name)
            self.hurry.set()
            return
        self.signal, self.at = name, time.monotonic()
        self.requested.set()


async def drain(server, seconds: float, hurry: asyncio.Event | None = None) -> dict:
    """Let the running and queued requests finish within `seconds` (sooner if `hurry`
    is set), cancel the rest, wait for them to store their state; then publish every
    queued session write. Returns what happened, for the log."""
    server.draining = True
    sched, start = server.scheduler, time.monotonic()
    end = start + seconds
    while not sched.idle() and time.monotonic() < end and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(0.05)
    cancelled = 0 if sched.idle() else sched.stop_all()
    settle = time.monotonic() + SETTLE_S
    while not sched.idle() and time.monotonic() < settle:
        await asyncio.sleep(0.05)
    flushed = await asyncio.get_running_loop().run_in_executor(None, server.flush_states)
    return {"drained_s": round(time.monotonic() - start, 3), "cancelled": cancelled, "flushed": flushed}


def run(make_server: Callable[[], object], host: str, port: int, drain_s: float,
        ready: Callable[[str], None] | None = None, start_site=None) -> None:
    """Serve `make_server()` on `host`:`port` until a stop signal, then stop gracefully
    (module doc); `ready(url)` once listening. `start_site(runner, host, port)` opens
    the listener (default: a plain TCPSite) and returns (site, port)."""
    async def main() -> None:
        stopper = Stopper()
        stopper.install()
        server = make_server()
        # Handlers still writing after the drain (waiting for a session's write) get
        # the settle time too before aiohttp cancels them.
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SETTLE_S)
        await runner.setup()
        site, bound = await (start_site or _tcp_site)(runner, host, port)
        if ready:
            ready(f"http://{host}:{bound}")
        try:
            await stopper.requested.wait()
            log.info("%s: stopping; running requests have %.0f s to finish", stopper.signal, drain_s)
            await site.stop()  # no new connections
            done = await drain(server, drain_s, stopper.hurry)
            log.info("drained in %.1f s (%d cancelled, %d session writes flushed)", done["drained_s"],
                     done["cancelled"], done["flushed"])
        finally:
            await runner.cleanup()
            stopper.remove()

    asyncio.run(main())


async def _tcp_site(runner: web.AppRunner, host: str, port: int) -> tuple[web.TCPSite, int]:
    site = web.TCPSite(runner, host, port)
    await site.start()
    return site, site._server.sockets[0].getsockname()[1]  # the real port when asked for 0
