"""The status page at `/`: static HTML/JS shipped in the package (uPlot vendored, no
build step), polling GET /v1/justfit/live for LiveStatus's document. The page and
its files need no key (they hold no data); the JSON is behind --api-key like every
other route, and the page asks for the key once and keeps it in the tab."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from aiohttp import web

from justfit.server.schema import BadRequest
from justfit.server.sessions import scope_of
from justfit.server.status_live import SAMPLE_EVERY_S, LiveStatus

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("justfit.server")


def is_page(path: str) -> bool:
    """The page and its static files: served without a key."""
    return path == "/" or path.startswith("/static/")


def add_routes(app: web.Application, server) -> None:
    """Register the page, its static files and the live document, and sample in the background."""
    live = LiveStatus(server)

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def document(request: web.Request) -> web.Response:
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            raise BadRequest("'since' must be a number (epoch seconds)", "since") from None
        return web.json_response(live.document(since, scope_of(request)), headers={"Cache-Control": "no-store"})

    async def sampling(app: web.Application):
        task = asyncio.create_task(_sample_forever(live))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC, follow_symlinks=False)  # aiohttp refuses paths outside it
    app.router.add_get("/v1/justfit/live", document)
    app.cleanup_ctx.append(sampling)


async def _sample_forever(live: LiveStatus) -> None:
    while True:
        try:
            live.sample()
        except Exception:  # a sample is not worth the server: log it, try again next time
            log.exception("status sample failed")
        await asyncio.sleep(SAMPLE_EVERY_S)
