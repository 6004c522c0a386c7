"""Named sessions over HTTP: what a response says about its turn's stored state, and
the routes that list and delete a client's sessions.

A request naming a `session` ends only once the turn's write-through is durable (or
failed): non-streamed responses carry the outcome in the `x-justfit-state` header,
streams in a comment (SSE) or field (NDJSON) before their last event. Values:
`stored`, `stored; as=NAME~2` (another writer had moved the session on since this
turn started: the turn is kept as a fork, nothing is overwritten), `not-stored;
reason=CODE`; `; evicted-recent=N` when the disk quota had to drop N sessions used in
the last minutes. Every session route is scoped by the client's key
(`request[SCOPE]`, justfit.server.keys): no client lists, reads or deletes another's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import quote

from aiohttp import web

from justfit.server.keys import SCOPE
from justfit.server.schema import BadRequest, session_name

STATE_HEADER = "x-justfit-state"


@dataclass(frozen=True)
class StateOutcome:
    """What became of a turn's session state."""

    stored: bool
    fork: str | None = None  # the name it was kept under, when not the one asked for
    reason: str = ""  # a stable code when not stored
    evicted_recent: int = 0

    def header(self) -> str:
        """The `x-justfit-state` value (names percent-encoded: headers are ASCII)."""
        parts = ["stored" if self.stored else "not-stored"]
        if self.fork:
            parts.append(f"as={quote(self.fork, safe='~')}")
        if self.reason:
            parts.append(f"reason={self.reason}")
        if self.evicted_recent:
            parts.append(f"evicted-recent={self.evicted_recent}")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        """For NDJSON and JSON bodies."""
        out: dict = {"stored": self.stored}
        if self.fork:
            out["session"] = self.fork
        if self.reason:
            out["reason"] = self.reason
        if self.evicted_recent:
            out["evicted_recent"] = self.evicted_recent
        return out


async def state_outcome(stats, wait_s: float) -> StateOutcome | None:
    """Wait (off the event loop, at most `wait_s`) for the turn's session write; its
    outcome, or None when the request named no session."""
    write = getattr(stats, "state_write", None) if stats is not None else None
    if write is None:
        return None
    done = await asyncio.get_running_loop().run_in_executor(None, write.wait, wait_s)
    if not done:
        return StateOutcome(False, reason="write-timeout")
    if not write.ok:
        return StateOutcome(False, reason="write-failed")
    fork = write.stored_as if write.stored_as and write.stored_as != write.session else None
    return StateOutcome(True, fork=fork, evicted_recent=write.evicted_recent)


def stream_note(outcome: StateOutcome | None) -> bytes:
    """The outcome as an SSE comment line (clients ignore comments); b"" without one."""
    return f": {STATE_HEADER} {outcome.header()}\n\n".encode() if outcome is not None else b""


def add_routes(app: web.Application, server) -> None:
    """GET /v1/justfit/sessions and DELETE /v1/justfit/sessions/{name}."""
    routes = SessionRoutes(server)
    app.router.add_get("/v1/justfit/sessions", routes.list)
    app.router.add_delete("/v1/justfit/sessions/{name}", routes.delete)


class SessionRoutes:
    """The calling client's sessions over one server."""

    def __init__(self, server):
        self.server = server

    async def list(self, request: web.Request) -> web.Response:
        """GET: name, positions, bytes on disk, generation, last use; newest first."""
        states = self.server.engine.states
        rows = await asyncio.get_running_loop().run_in_executor(None, states.session_list, scope_of(request))
        return web.json_response({"object": "list", "data": rows})

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE: the session, in memory and on disk; 404 if the client has none by that name."""
        name = session_name(request.match_info["name"], "name")
        scope = scope_of(request)
        if self.server.scheduler.uses_session(name, scope):
            raise BadRequest(f"session {name!r} is in use by a running request; delete it once that ends",
                             "name", 409, "invalid_request_error", "session_busy")
        states = self.server.engine.states
        found = await asyncio.get_running_loop().run_in_executor(None, states.drop, name, scope)
        if not found:
            raise BadRequest(f"no session {name!r}", "name", 404, "invalid_request_error", "session_not_found")
        return web.json_response({"deleted": name})


def scope_of(request) -> str:
    """Whose stored states a request may use: its API key's scope (set by the auth
    middleware), "" on a server without keys (every client shares one cache)."""
    return (request.get(SCOPE) or "") if request is not None else ""
