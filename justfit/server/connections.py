"""The server's listener: read and write timeouts and a connection limit on every connection.

aiohttp bounds neither how long a client may take to send a request's headers or body
nor how many connections are open, so one client holding hundreds of connections open
with half a request each would keep them forever. Each accepted connection gets a
`GuardedProtocol` around aiohttp's own protocol, with one read timer at a time:

- headers: from the connection's start, or from the first byte of a later request,
  to the moment the request reaches the app (`track`, the outermost middleware);
  past `header_timeout_s` the connection is closed;
- body: from there until the body has arrived in full; past `body_timeout_s` a
  handler reading it gets `BodyTimeout` (answered 408), and the connection is closed;
- idle: a keep-alive connection between requests is closed after `idle_timeout_s`.

While the app works on a request whose body is in (a generation, a stream) no read
timer runs. Nor does aiohttp bound a write: a client that stops reading a stream
would hold its handler forever. So, under every route and response alike, once the
client's and the kernel's buffers are full and asyncio pauses aiohttp's writer, a
write timer runs; a client that has not read enough to resume it within
`write_timeout_s` is dropped (aborted: a close would first wait for bytes nobody
reads), and aiohttp ends the handler as on a hang-up: the request is cancelled and
its state stored the same way.

At `max_connections` a new connection first closes an older one that is not in
a handler (one still sending headers, then an idle one, then one sending a body,
oldest first), so a flood of stalled connections never locks out /health; only when
every connection is inside a handler is the new one refused. A connection whose
request head has arrived in full is not stalled: it is on its way to the app (the
next turn of the loop) and is not closed to make room, or a burst of new connections
on a loaded machine could close a complete request before it was served."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import Counter
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from aiohttp import web

from justfit.server import malformed

log = logging.getLogger("justfit.server")

# Each connection's kernel send buffer. Linux grows an unset one (autotuning) as a reply
# waits, which resumes a writer the client's silence paused and restarts the write timer:
# a client reading nothing would be dropped only once the buffer stopped growing, after
# megabytes and many timeouts. Token streams need far less.
SEND_BUFFER = 64 << 10  # Linux doubles it for its bookkeeping
FD_RESERVE = 128  # descriptors kept for everything but client connections (weights, states, pipes)
CLOSE_GRACE_S = 5.0  # after a body timeout: time for the 408 to go out before the connection is cut
HEAD, READY, BODY, BUSY, IDLE = "head", "ready", "body", "busy", "idle"
HEAD_END = b"\r\n\r\n"
EVICT_ORDER = (HEAD, IDLE, BODY)  # who goes first when the limit is reached


class BodyTimeout(asyncio.TimeoutError):
    """A request's body did not arrive in time (raised where the handler reads it;
    a TimeoutError so that aiohttp's own drain of an unread body ends quietly)."""


@dataclass(frozen=True)
class Limits:
    """How long a client may take, and how many connections may be open."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0
    max_connections: int = 256
    write_timeout_s: float = 60.0

    @classmethod
    def of(cls, config) -> "Limits":
        """The limits a ServerConfig asks for."""
        return cls(config.header_timeout_s, config.body_timeout_s, config.idle_timeout_s, config.max_connections,
                   config.write_timeout_s)


class Guard:
    """The open connections of one listener and what became of the closed ones."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.open: dict[GuardedProtocol, None] = {}  # insertion order: oldest first
        self.closed: Counter = Counter()  # why connections were closed: head, body, idle, write, evicted, refused
        self.peak = 0  # the most connections open at once

    def admit(self, conn: "GuardedProtocol") -> bool:
        """Count a new connection, closing an older one when at the limit; False when
        every connection is inside a handler (the new one is then closed)."""
        if len(self.open) >= self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                self.closed["refused"] += 1
                log.debug("connection limit (%d) reached with every connection busy: refused one",
                          self.limits.max_connections)
                return False
            self.closed["evicted"] += 1
            victim.close()
        self.open[conn] = None
        self.peak = max(self.peak, len(self.open))
        return True

    def _victim(self) -> "GuardedProtocol | None":
        first: dict[str, GuardedProtocol] = {}
        for conn in self.open:
            if conn.phase not in first:
                first[conn.phase] = conn
                if conn.phase == EVICT_ORDER[0]:
                    break
        return next((first[p] for p in EVICT_ORDER if p in first), None)

    def forget(self, conn: "GuardedProtocol") -> None:
        """Stop counting a connection (closed, or closing)."""
        self.open.pop(conn, None)


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection (`inner`), with the timers of the module doc."""

    def __init__(self, inner: asyncio.Protocol, guard: Guard):
        self.inner, self.guard = inner, guard
        self.transport: asyncio.Transport | None = None
        self.phase, self.in_handler, self.closing = HEAD, False, False
        self._tail = b""  # the head's last bytes: its end may straddle two reads
        self._pending = False  # bytes of a next request came while the app worked on this one
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # -- asyncio's side: everything goes on to aiohttp ----------------------------------
    def connection_made(self, transport) -> None:
        """Admitted (maybe in an older one's place) or refused; the header timer starts."""
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # a fixed size: the kernel would otherwise grow it while the client reads nothing
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
        self.inner.connection_made(transport)
        if not self.guard.admit(self):
            self.close()
            return
        self._arm(HEAD, self.guard.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        """The bytes go to aiohttp; the first of a new request starts its header timer."""
        if self.phase == IDLE:  # the first byte of the next request
            self._arm(HEAD, self.guard.limits.header_timeout_s)
        elif self.phase == BUSY:  # a pipelined request: timed once the current one is answered
            self._pending = True
        if self.phase == HEAD:
            seen = self._tail + data
            if HEAD_END in seen:  # its header timer still runs until the app has it
                self.phase = READY
            self._tail = seen[-(len(HEAD_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self):
        """aiohttp's answer to a half-closed connection."""
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        """Flow control, aiohttp's: the buffer is full, so the write timer starts."""
        self.inner.pause_writing()
        self._arm_write()

    def resume_writing(self) -> None:
        """Flow control, aiohttp's: the client is taking bytes again."""
        self._cancel_write()
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        """No more timers, no longer counted; aiohttp ends what ran on the connection."""
        self.closing = True
        self._cancel()
        self._cancel_write()
        self.guard.forget(self)
        self.inner.connection_lost(exc)

    # -- the app's side (track) ---------------------------------------------------------
    def request_started(self, payload) -> None:
        """A request reached the app: its headers are in; time its body, if any."""
        if self.closing:
            return
        self.in_handler, self._pending = True, False
        if payload.is_eof():
            self._enter(BUSY)
        else:
            self._arm(BODY, self.guard.limits.body_timeout_s, payload)
            payload.on_eof(self._body_in)  # aiohttp's StreamReader calls it once the body is complete

    def request_finished(self) -> None:
        """The app answered (a stream has ended); idle, or the next request's headers."""
        self.in_handler = False
        if self.closing or self.phase != BUSY:  # a body still arriving keeps its timer
            return
        if self._pending:
            self._arm(HEAD, self.guard.limits.header_timeout_s)
        else:
            self._arm(IDLE, self.guard.limits.idle_timeout_s)

    def _body_in(self) -> None:
        if self.closing or self.phase != BODY:
            return
        if self.in_handler:
            self._enter(BUSY)
        else:  # answered before its body was read (a 401): the next request may follow
            self._arm(IDLE, self.guard.limits.idle_timeout_s)

    # -- timers -----------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self._cancel()
        self.phase, self._tail = phase, b""

    def _arm(self, phase: str, seconds: float, payload=None) -> None:
        self._enter(phase)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(seconds, self._expired, phase, payload)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str, payload) -> None:
        self._timer = None
        if self.closing or phase != (HEAD if self.phase == READY else self.phase):
            return
        self.guard.closed[phase] += 1
        log.debug("closing a connection: %s not complete within its timeout", phase)
        if phase == BODY and payload is not None:
            # The handler (or aiohttp, draining an unread body) is waiting on it: it
            # answers 408 and closes; the timer below cuts a client that does not read.
            payload.set_exception(BodyTimeout(f"request body not received within "
                                              f"{self.guard.limits.body_timeout_s:g} s"))
            self.phase = BODY + "-expired"
            self._timer = asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self.close)
            return
        self.close()

    def _arm_write(self) -> None:
        if self.closing:
            return
        self._write_timer = asyncio.get_running_loop().call_later(self.guard.limits.write_timeout_s,
                                                                  self._write_expired)

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.closing:
            return
        self.guard.closed["write"] += 1
        log.debug("dropping a connection: its client read nothing for %g s", self.guard.limits.write_timeout_s)
        self.close(abort=True)

    def close(self, abort: bool = False) -> None:
        """Close the connection (aiohttp cancels a handler still running on it); `abort`,
        or bytes still buffered for it (its client stopped reading a reply that fit the
        buffers): at once, dropping them, since a close would wait for them forever."""
        if self.closing:
            return
        self.closing = True
        self._cancel()
        self._cancel_write()
        self.guard.forget(self)  # no longer counted, though the socket closes on the next turn of the loop
        if self.transport is None:
            return
        if abort or self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()


def _guarded(request: web.Request) -> GuardedProtocol | None:
    transport = request.transport
    proto = transport.get_protocol() if transport is not None else None
    return proto if isinstance(proto, GuardedProtocol) else None


@web.middleware
async def track(request: web.Request, handler):
    """The outermost middleware: tells the connection's guard when a request starts
    (its headers are in) and when it has been answered."""
    conn = _guarded(request)
    if conn is None:  # served by a listener without a guard (aiohttp's own TCPSite)
        return await handler(request)
    conn.request_started(request.content)
    try:
        return await handler(request)
    finally:
        conn.request_finished()


class GuardedSite(web.BaseSite):
    """A TCP listener whose every connection is a GuardedProtocol; registered with its
    runner like aiohttp's TCPSite, so `stop()` and `runner.cleanup()` close it."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: Limits):
        super().__init__(runner, backlog=max(128, limits.max_connections))
        self.host, self.requested_port, self.guard = host, port, Guard(limits)

    @property
    def name(self) -> str:
        """The URL listened on."""
        return f"http://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        """The port listened on (the real one when asked for 0)."""
        return self._server.sockets[0].getsockname()[1] if self._server else self.requested_port

    async def start(self) -> None:
        """Listen; each connection accepted gets aiohttp's protocol (answering malformed
        HTTP plainly: justfit.server.malformed) inside a GuardedProtocol."""
        await super().start()  # registers with the runner
        make_protocol, guard = malformed.protocol_factory(self._runner.server), self.guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedProtocol(make_protocol(), guard), self.host, self.requested_port, backlog=self._backlog)


def fit_descriptors(limits: Limits) -> Limits:
    """`limits` with max_connections within the process's open-file limit, raising
    the soft limit toward the hard one first (macOS starts processes at 256)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fits = max(1, soft - FD_RESERVE)
        log.warning("open-file limit %d: serving at most %d connections, not %d", soft, fits,
                    limits.max_connections)
        return replace(limits, max_connections=fits)
    return limits


def listener(config) -> Callable[[web.BaseRunner, str, int], Awaitable[tuple[GuardedSite, int]]]:
    """`start_site(runner, host, port) -> (site, port)` for `config`'s limits (a
    ServerConfig): a started GuardedSite and the port it listens on."""
    async def start_site(runner: web.BaseRunner, host: str, port: int) -> tuple[GuardedSite, int]:
        site = GuardedSite(runner, host, port, fit_descriptors(Limits.of(config)))
        await site.start()
        return site, site.port

    return start_site
