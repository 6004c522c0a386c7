"""Slowloris, for tests: N connections to a server, each sending a request's line and
headers one byte per interval (never finishing them) and, once the server closes it,
connecting again after a pause, for `hold` seconds; then the last ones wait
(still dribbling) for the server to close them. Run as
its own process (`python -m tests.helpers.slow_clients PORT ...`) so that its work does not
share an interpreter lock with the server it stalls. Prints one JSON object: how many
connections it made, how many the server closed, the longest and shortest any lived
(from its connect to the server's close), and how many were never closed."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

REQUEST = b"GET /health HTTP/1.1\r\nHost: slow\r\nUser-Agent: one-byte-at-a-time\r\nX-Padding: " + b"p" * 4096


async def one_slot(port: int, interval: float, pause: float, end: float, give_up: float, lives: list,
                   stats: dict) -> None:
    """Until `end`: connect, dribble, note when the server closed the connection, connect
    again. A connection still open at `give_up` counts as never closed."""
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats["connect_failed"] += 1
            await asyncio.sleep(pause)
            continue
        start, sent, closed = time.monotonic(), 0, False
        stats["connected"] += 1
        try:
            while sent < len(REQUEST) and time.monotonic() < give_up:
                writer.write(REQUEST[sent:sent + 1])
                sent += 1
                try:
                    if await asyncio.wait_for(reader.read(1024), interval) == b"":
                        closed = True
                        break
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            closed = True
        if closed:
            lives.append(time.monotonic() - start)
        else:
            stats["never_closed"] += 1
        writer.close()
        await asyncio.sleep(pause)


async def main(port: int, n: int, interval: float, pause: float, hold: float, wait: float, ramp: float) -> dict:
    lives: list[float] = []
    stats = {"connected": 0, "connect_failed": 0, "never_closed": 0}
    end = time.monotonic() + hold
    tasks = []
    for i in range(n):  # spread over `ramp` seconds, as a flood arrives
        tasks.append(asyncio.create_task(one_slot(port, interval, pause, end, end + wait, lives, stats)))
        if ramp and i % 50 == 49:
            await asyncio.sleep(ramp * 50 / n)
    await asyncio.gather(*tasks)
    return {**stats, "closed": len(lives), "longest": max(lives, default=0.0), "shortest": min(lives, default=0.0)}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--n", type=int, default=500, help="connections at once")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between bytes")
    p.add_argument("--pause", type=float, default=0.5, help="seconds before connecting again once closed")
    p.add_argument("--hold", type=float, default=70.0, help="seconds to keep reconnecting")
    p.add_argument("--wait", type=float, default=20.0, help="after that: how long the last ones may stay open")
    p.add_argument("--ramp", type=float, default=0.5, help="seconds over which the first connections arrive")
    a = p.parse_args()
    print(json.dumps(asyncio.run(main(a.port, a.n, a.interval, a.pause, a.hold, a.wait, a.ramp))))
