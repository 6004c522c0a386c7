"""The write timeout: a client that stops reading a response is dropped once the
server's writes have waited on it for `write_timeout_s`, its turn is stored as on a
hang-up, and the server goes on serving. The client's raw socket has a small receive
buffer and announces a small segment size (the kernel sizes the server's send buffer
from it: loopback's 64 KiB segments would let that buffer take megabytes), and the
reply (480 tokens, each with its 20 most likely alternatives) is larger than both
buffers and the transport's together, so only a client that reads can take it all.
`--long` runs 100 stalled streams on SmolLM2, whose replies (2,000 tokens) outgrow any buffer."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from tests.helpers.server_harness import CHAT, LiveServer, health_latency, request

WRITE_TIMEOUT_S = 0.5
SLACK_S = 0.6  # the timer's drop, seen by a test polling every 10 ms on a shared machine
RCVBUF = 4096  # asked for the client's socket; the kernel may double it (read back below)
MSS = 536  # the client's announced segment size (the smallest every IPv4 host takes)
HIGH_WATER = 64 * 1024  # asyncio's transport buffer before it pauses the writer (its default)
REPLY = {**CHAT, "max_tokens": 480, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}


@pytest.fixture(scope="module")
def engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(engine, max_queue=64, write_timeout_s=WRITE_TIMEOUT_S)
    yield s
    s.close()


def stalled_client(port: int, path: str, body: dict, rcvbuf: int = RCVBUF, mss: int = MSS) -> socket.socket:
    """A raw connection with a small receive buffer and segment size that sends `body`
    to `path` and then reads nothing."""
    raw = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(raw)) + raw)
    return sock


async def _accepted(live, known: set, n: int, limit: float = 30.0) -> list:
    """The server's side of the `n` connections opened since `known`, once all are accepted."""
    end = time.monotonic() + limit
    while len(new := [c for c in live.site.guard.open if c not in known]) < n and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert len(new) == n, len(new)
    return new


async def _watch(conns: list, limit: float) -> list[dict]:
    """Poll the server's side of `conns` until each has been closed (or `limit` seconds):
    for each, when aiohttp's writer was paused, when the connection was closed, and the
    largest send buffer its socket had."""
    seen, end = [{"paused": None, "dropped": None, "sndbuf": 0} for _ in conns], time.monotonic() + limit
    while time.monotonic() < end and not all(w["dropped"] for w in seen):
        for conn, w in zip(conns, seen):
            if w["dropped"] is None and conn.closing:
                w["dropped"] = time.monotonic()
            elif not conn.closing and conn.transport is not None:
                sock = conn.transport.get_extra_info("socket")
                w["sndbuf"] = max(w["sndbuf"], sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
                if w["paused"] is None and conn.inner.writing_paused:
                    w["paused"] = time.monotonic()
        await asyncio.sleep(0.01)
    return seen


async def _stall_watch(live, known: set, n: int, limit: float) -> list[dict]:
    """`_watch` on the `n` connections opened since `known`, once accepted."""
    return await _watch(await _accepted(live, known, n), limit)


def _read_rest(sock: socket.socket) -> bytes:
    """What reached the client before the server dropped it, read only now."""
    sock.settimeout(10)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except OSError:  # a reset once the buffered part is read
        pass
    sock.close()
    return got


def _hung_up(live) -> int:
    """Chat requests whose handler was cancelled (a client gone), as /metrics counts them."""
    return live.server.metrics.requests[("/v1/chat/completions", 499)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_reads_nothing_is_dropped_at_the_write_timeout(live, engine, stream):
    session = f"unread-{'stream' if stream else 'whole'}"
    closed, sched, hung_up = dict(live.site.guard.closed), live.server.scheduler, _hung_up(live)
    cancelled, ended = sched.cancelled, sched.cancelled + sched.completed
    known = set(live.site.guard.open)
    sock = stalled_client(live.port, "/v1/chat/completions", {**REPLY, "stream": stream, "session": session})
    (watched,) = asyncio.run(_stall_watch(live, known, 1, 30.0))
    paused, dropped, sndbuf = watched["paused"], watched["dropped"], watched["sndbuf"]
    rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    got = _read_rest(sock)
    live.idle()
    stats, cancelled, ended = sched.last_stats, sched.cancelled - cancelled, sched.cancelled + sched.completed - ended
    live.server.flush_states()
    stored = {r["name"]: r["tokens"] for r in engine.states.session_list("")}

    # The same reply read by a client that reads: its size, and the server still serves.
    status, _, full = request(live, "POST", "/v1/chat/completions", {**REPLY, "stream": stream})
    size = len(full.encode())
    assert paused is not None and dropped is not None, (paused, dropped)
    print(f"\nreply {size} bytes; client receive buffer {rcvbuf}, server send buffer {sndbuf}, transport "
          f"{HIGH_WATER}; the client got {len(got)} bytes; paused -> dropped {dropped - paused:.2f} s "
          f"(write timeout {WRITE_TIMEOUT_S:g} s); {stats.generated_tokens} tokens generated, "
          f"{'cancelled' if cancelled else 'finished'}")
    assert status == 200 and size > rcvbuf + sndbuf + HIGH_WATER  # no buffer could hold it unread
    assert WRITE_TIMEOUT_S - 0.02 <= dropped - paused < WRITE_TIMEOUT_S + SLACK_S
    after = live.site.guard.closed
    assert {k: after[k] - closed.get(k, 0) for k in after if after[k] != closed.get(k, 0)} == {"write": 1}
    assert len(got) < size and b"[DONE]" not in got  # cut short
    # Ended as a hang-up ends it: a running stream's handler cancelled (a whole reply's had
    # returned), the request cancelled unless it had finished, every token fed but the last stored.
    assert _hung_up(live) == hung_up + stream
    assert ended == 1 and (cancelled == 1) == (stats.generated_tokens < REPLY["max_tokens"])
    assert stored[session] == stats.prompt_tokens + stats.generated_tokens - 1


# -- 100 stalled readers on SmolLM2 (--long) -------------------------------------------------
STALLED = 100
LONG_TIMEOUT_S = 5.0
HEALTH_UNDER_S = 0.05


async def _stall_and_poll(live, n: int, body: dict, limit: float) -> tuple[list[dict], list[float], list]:
    """`n` stalled streams, each its own session, watched until all are dropped, with
    /health polled throughout: (the watch, every /health latency, the client sockets)."""
    known = set(live.site.guard.open)
    socks = [stalled_client(live.port, "/v1/chat/completions", {**body, "session": f"stalled-{i}"})
             for i in range(n)]
    watch = asyncio.create_task(_watch(await _accepted(live, known, n), limit))
    latencies = []
    while not watch.done():
        latencies.append(await health_latency(live.port))
        await asyncio.sleep(0.02)
    return await watch, latencies, socks


def _stalled_readers(engine, max_tokens: int) -> dict:
    """STALLED streams never read, four computed at a time: each one's paused -> dropped
    seconds ("waits"), every /health latency, what the guard closed, how many requests
    were cancelled, the positions each one's session stored."""
    live = LiveServer(engine, max_queue=STALLED + 8, max_batch=4, write_timeout_s=LONG_TIMEOUT_S)
    body = {**REPLY, "max_tokens": max_tokens, "stream": True}
    try:
        seen, latencies, socks = asyncio.run(_stall_and_poll(live, STALLED, body, 3600))
        for sock in socks:
            sock.close()
        live.idle()
        live.server.flush_states()
        stored = {r["name"]: r["tokens"] for r in engine.states.session_list("")}
        cancelled = live.server.scheduler.cancelled
        assert request(live, "POST", "/v1/chat/completions", CHAT)[0] == 200
    finally:
        live.close()
    waits = sorted(w["dropped"] - w["paused"] for w in seen if w["dropped"] and w["paused"])
    print(f"\n{STALLED} stalled streams, write timeout {LONG_TIMEOUT_S:g} s: {len(waits)} dropped, paused -> "
          f"dropped {waits[0]:.2f}-{waits[-1]:.2f} s; largest server send buffer "
          f"{max(w['sndbuf'] for w in seen)}; /health max {max(latencies) * 1000:.1f} ms, p99 "
          f"{sorted(latencies)[len(latencies) * 99 // 100] * 1000:.1f} ms over {len(latencies)} polls; "
          f"{cancelled} cancelled, {len(stored)} sessions stored; closed {dict(live.site.guard.closed)}")
    return {"waits": waits, "latencies": latencies, "closed": dict(live.site.guard.closed), "cancelled": cancelled,
            "stored": [stored.get(f"stalled-{i}", 0) for i in range(STALLED)]}


def _check_stalled(seen: dict) -> None:
    """Every stalled stream dropped at the write timeout, its turn stored, /health fast throughout."""
    waits = seen["waits"]
    assert len(waits) == STALLED and seen["closed"].get("write") == STALLED
    assert LONG_TIMEOUT_S - 0.02 <= waits[0] and waits[-1] < LONG_TIMEOUT_S + SLACK_S
    assert all(n > 0 for n in seen["stored"])
    assert max(seen["latencies"]) < HEALTH_UNDER_S


@pytest.mark.skipif("not config.getoption('--long')", reason="long variant: --long")
def test_100_stalled_readers_on_smollm2(smollm2_gguf):
    """The target: every one dropped at the write timeout, its reply (longer than any
    buffer's worth) cancelled and its turn stored, /health under 50 ms throughout."""
    seen = _stalled_readers(Engine(str(smollm2_gguf)), 2000)
    _check_stalled(seen)
    assert seen["cancelled"] == STALLED

