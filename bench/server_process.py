"""A `justfit serve` subprocess for the HTTP benchmarks: started on a free port with a
fresh state folder (nothing warm from earlier runs), ready once /health answers,
stopped with SIGINT (the server's own clean shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp


@dataclass
class Served:
    url: str
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def launched(command, prefix: str, ready_s: float = 180, stop_s: float = 20):
    """A server started by `command(port)` on a free port, its stored states in a fresh
    folder (nothing warm from earlier runs), logging to that folder's server.log; yields
    (url, process, log) once GET /health answers 200, stops it with SIGINT (the server's
    own clean shutdown) on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    port, log = free_port(), tmp / "server.log"
    env = {**os.environ, "JUSTFIT_STATE_DIR": str(tmp / "state")}
    with open(log, "wb") as f:
        proc = subprocess.Popen(command(port), stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, proc, log, timeout=ready_s)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.asynccontextmanager
async def served(model: str, *extra: str):
    """A `justfit serve` subprocess, ready (GET /health is 200), stopped on exit."""
    def command(port: int) -> list[str]:
        return [str(Path(sys.executable).parent / "justfit"), "serve", "--port", str(port), "--model", model, *extra]

    async with launched(command, "justfit-serve-bench-") as (url, proc, log):
        yield Served(url, proc, log)


async def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s: {log.read_text()[-2000:]}")
