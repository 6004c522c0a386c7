"""The answer to malformed HTTP: a fixed 400 that never echoes the client's bytes.

aiohttp answers what its parser rejects (a bad request line or header, invalid
chunked encoding, a line over its limit, bytes that are not HTTP) itself, before any
route or middleware, with the parser's message as the body, and that message quotes
the bytes it choked on. `PlainErrors` is aiohttp's protocol with those answers
replaced by one fixed JSON error; the listener (justfit.server.connections) builds
every connection's protocol with `protocol_factory`."""

from __future__ import annotations

import asyncio
import functools
from typing import Callable

from aiohttp import web

from justfit.server.schema import BadRequest

MALFORMED = BadRequest("malformed HTTP request", None, 400, code="malformed_http")


class PlainErrors(web.RequestHandler):
    """aiohttp's protocol for one connection, answering a request it cannot parse with MALFORMED."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's handling (its log line, its check that no response has begun); a
        parser's 400 then gets MALFORMED's body instead of the parser's message."""
        if status != 400:  # 500 and 504: aiohttp's fixed texts, which quote nothing
            return super().handle_error(request, status, exc, message)
        super().handle_error(request, status, exc, None)
        resp = web.json_response(MALFORMED.body(), status=400)
        resp.force_close()  # the rest of what the client sent cannot be parsed either
        return resp


def protocol_factory(server: web.Server) -> Callable[[], PlainErrors]:
    """What builds a connection's protocol for `server` (a runner's web.Server): a
    PlainErrors with the arguments aiohttp's own would get (access log, debug, the
    app's handler_args), which web.Server keeps for its own factory."""
    return functools.partial(PlainErrors, server, loop=asyncio.get_running_loop(), **server._kwargs)
