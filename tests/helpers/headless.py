"""Headless Chromium for browser tests: Debian's `chromium`, driven over the DevTools
protocol with aiohttp's websocket client (evaluate JavaScript, take screenshots)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0"]


def chromium_path() -> str | None:
    """The browser binary, or None where it is not installed (./dev installs it on Debian)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with a fresh profile; use `async with`."""

    def __init__(self, width: int = 1400, height: int = 1100):
        self.width, self.height = width, height
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Browser":
        self.profile = Path(tempfile.mkdtemp(prefix="justfit-chromium-"))
        self.proc = subprocess.Popen([chromium_path(), *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={self.width},{self.height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, end = self.profile / "DevToolsActivePort", time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()
        await self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def send(self, method: str, **params) -> dict:
        """One DevTools command; its result (events in between are skipped)."""
        mid = next(self._ids)
        await self.ws.send_str(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive(timeout=30)).data)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10.0, every: float = 0.02):
        """Poll `expression` until truthy (errors, e.g. while the page loads, count as
        false); its value."""
        end = time.monotonic() + timeout
        while True:
            try:
                value = await self.js(expression)
            except RuntimeError:
                value = None
            if value or time.monotonic() > end:
                return value
            await asyncio.sleep(every)

    async def screenshot(self, path: Path) -> Path:
        data = (await self.send("Page.captureScreenshot", format="png"))["data"]
        path.write_bytes(base64.b64decode(data))
        return path
