"""The HTTP server: an aiohttp app over one engine. Middlewares answer every error
as JSON (never a traceback or an exception's text), check the API keys (each its own
scope: justfit/server/keys.py) and answer CORS preflights; the CORS headers go on
every response, streams and errors included. Its listener times and counts every
connection (justfit/server/connections.py). A generation request too large for the
context by its size alone is refused at once (justfit/server/prompt_bytes.py); the
others are templated, tokenized and planned on the tokenizer thread
(justfit/server/tokenizing.py), refused with the numbers when they cannot fit, then
queued on the scheduler's engine thread. The event loop itself only parses, routes
and writes."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from aiohttp import web

import justfit
from justfit import runtime
from justfit.planning.breakdown import process_breakdown
from justfit.planning.disk_plan import DiskStatus
from justfit.errors import BudgetExceeded, ContextTooLong, PipelineLost, ServerStopping
from justfit.engine.job import Job
from justfit.engine.scheduler import QueueFull, Scheduler
from justfit.engine.tickets import TICKET_HEADER
from justfit.server import connections, keys, status_page, structured
from justfit.server.metrics import Metrics, acceptance_rate, memory, prometheus
from justfit.server.responses_store import ResponseStore, StoreLimits
from justfit.server.schema import BadRequest, Options
from justfit.server.sessions import scope_of
from justfit.server.tokenizing import TokenizerThread

log = logging.getLogger("justfit.server")

CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, X-JustFit-Ticket"
CORS_EXPOSE_HEADERS = "Retry-After, X-JustFit-Ticket, X-JustFit-State"


@dataclass
class ServerConfig:
    """How the server listens, whom it lets in, and the limits and defaults of its requests."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # one more accepted key, beside api_keys
    api_keys: tuple[str, ...] = ()  # each key its own scope of stored state (justfit.server.keys)
    cors_origin: str | None = None
    max_body_bytes: int = 16 * 2**20
    max_queue: int = 16
    max_batch: int = 1  # requests computed at once (justfit.engine.batch); 1: one at a time
    preempt: bool = True  # batching: set sequences aside on disk when the batch outgrows the budget
    default_max_tokens: int = 1024
    model_name: str | None = None  # the id clients use; default: the engine's model name
    keepalive_s: float = 1.0  # a stream silent this long (a long prefill chunk) gets a comment or ping
    rank_timeout_s: float = 300.0  # a request silent this long is lost, where the runner watches (a layer pipeline)
    drain_s: float = 10.0  # on a stop signal: how long running requests get to finish (justfit.server.lifecycle)
    write_wait_s: float = 60.0  # how long a response waits for its session's write before saying it is not stored
    # A connection's read timeouts and the connection limit (justfit.server.connections):
    header_timeout_s: float = 10.0  # a request's line and headers must be in within this
    body_timeout_s: float = 30.0  # and its body within this, once the headers are
    idle_timeout_s: float = 75.0  # a keep-alive connection idle between requests this long is closed
    max_connections: int = 256  # past it a new connection closes the oldest one not in a handler
    write_timeout_s: float = 60.0  # a client that takes none of a response for this long is dropped
    responses: StoreLimits = StoreLimits()  # the Responses API's stored responses, per key


class Server:
    """The HTTP server over one engine: planning, queueing, middlewares and the operations routes."""

    def __init__(self, engine, config: ServerConfig | None = None):
        runtime.setup()  # idempotent; the engine thread sets itself up too
        self.engine, self.config = engine, config or ServerConfig()
        self.tokenizing = TokenizerThread()
        self.metrics = Metrics()
        self.kv_disk = DiskStatus(engine)  # what pages on disk cost, for the status (justfit.planning.disk_plan)
        self.scheduler = Scheduler(engine, self.config.max_queue, on_done=self.metrics.record,
                                   max_batch=self.config.max_batch, preempt=self.config.preempt,
                                   stall_s=self.config.rank_timeout_s)
        self.model_id = self.config.model_name or _short_name(str(engine.name))
        self.created = int(time.time())
        self.draining = False  # a stop signal came: new requests get 503 (justfit.server.lifecycle)
        self.keys = keys.accepted(self.config.api_key, self.config.api_keys)  # every key let in
        states = getattr(engine, "states", None)
        if states is not None:  # each key's stored states within its own share of the disk
            states.share_among(keys.scope(k) for k in self.keys)  # (no keys: one share for all)
        # the Responses API's stored responses: beside the models' state folders (in memory without them)
        self.responses = ResponseStore(Path(states.dir).parent / "responses" if states is not None else None,
                                       self.config.responses)

    # -- models -------------------------------------------------------------------
    def check_model(self, name) -> None:
        """Unknown model -> 404; absent -> the one served."""
        if name is None:
            return
        if not isinstance(name, str):
            raise BadRequest("'model' must be a string", "model")
        if name.removesuffix(":latest") not in (self.model_id, self.engine.name, "default"):
            raise BadRequest(f"model {name!r} is not served here; this server runs {self.model_id!r}",
                             "model", 404, code="model_not_found")

    # -- generation -----------------------------------------------------------------
    async def prepare(self, tokenize: Callable[[], list[int]], opts: Options) -> list[int]:
        """The request's constraint compiled (structured.check), then `tokenize()`
        (templating, tokenization, token checks) and the plan, on the tokenizer thread:
        the prompt's tokens, or BadRequest."""
        def tokenize_and_plan() -> list[int]:
            structured.check(self.engine, opts)
            tokens = tokenize()
            self.plan(tokens, opts)
            return tokens

        return await self.tokenizing.run(tokenize_and_plan)

    def plan(self, tokens: list[int], opts: Options) -> None:
        """Fit the request or refuse it (400 context_length_exceeded) before any work;
        a default max_tokens shrinks to what fits instead."""
        sp, n = opts.sampling, len(tokens)
        if not tokens:
            raise BadRequest("the prompt is empty", "messages")
        for _ in range(2):  # context first, then the budget
            try:
                self.engine.planner.check_fits(n, sp.max_tokens)
                return
            except (ContextTooLong, BudgetExceeded) as e:
                limit = e.limit if isinstance(e, ContextTooLong) else e.fits_positions
                if not opts.max_tokens_given and limit - n >= 1:
                    sp = opts.sampling = replace(sp, max_tokens=min(sp.max_tokens, limit - n))
                    continue
                details = {"prompt_tokens": n, "max_tokens": sp.max_tokens, "max_positions": limit,
                           "budget_bytes": self.engine.budget.bytes,
                           "context_limit": self.engine.context_limit}
                raise BadRequest(f"{e}", "messages", 400, "context_length_exceeded",
                                 "context_length_exceeded", details) from None
        raise BadRequest("the request does not fit", "messages", 400, "context_length_exceeded",
                         "context_length_exceeded")

    def submit(self, tokens: list[int], opts: Options, route: str = "", request=None) -> tuple[Job, int]:
        """Queue a planned request (`route`: the API it came through, for the status
        page); the ticket a retry brings in the TICKET_HEADER of `request` keeps its place."""
        if self.draining:
            raise BadRequest(str(ServerStopping()), None, 503, "server_error", "server_stopping",
                             {"retry_after": 5, "ticket": ""})
        runner = self.engine.runner
        if runner.lost:  # nothing can run until every rank is restarted
            raise BadRequest(str(PipelineLost(runner.lost)), None, 503, "server_error", "pipeline_degraded")
        try:
            runner.refuse_session(opts.session)
        except ValueError as e:
            raise BadRequest(str(e), "session", 400, "invalid_request_error", "session_unsupported") from None
        job = Job(tokens, opts.sampling, asyncio.get_running_loop(), session=opts.session, route=route,
                  scope=scope_of(request))
        ticket = request.headers.get(TICKET_HEADER) if request is not None else None
        try:
            return job, self.scheduler.submit(job, ticket)
        except QueueFull as e:
            raise BadRequest(str(e), None, 503, "server_busy", "server_busy",
                             {"waiting": e.waiting, "retry_after": e.retry_after, "ticket": e.ticket}) from None

    def flush_states(self) -> int:
        """Publish (and fsync) every queued or unwritten session state; how many were pending."""
        states = getattr(self.engine, "states", None)
        if states is None:
            return 0
        pending = len(states.writer.pending)
        states.flush()
        return pending

    def close(self) -> None:
        """Stop the engine thread (cancelling what runs) and the tokenizer thread."""
        self.tokenizing.close()
        self.scheduler.close()
        self.responses.close()

    # -- the app --------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application with every route and middleware."""
        from justfit.server import anthropic_routes, ollama_routes, openai_routes, responses_routes, sessions

        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[connections.track, self._errors, self._cors, self._auth])
        app.on_response_prepare.append(self._cors_headers)  # every response: streams and errors too
        self.tokenizing.measure(self.engine.tokenizer)  # the prompt size bound, first on the thread
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/justfit/status", self.status)
        openai_routes.add_routes(app, self)
        ollama_routes.add_routes(app, self)
        anthropic_routes.add_routes(app, self)
        responses_routes.add_routes(app, self)
        sessions.add_routes(app, self)
        status_page.add_routes(app, self)
        app.on_shutdown.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.close))
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        ollama = request.path.startswith("/api/")
        anthropic = request.path.startswith("/v1/messages")
        try:
            resp = await handler(request)
        except BadRequest as e:
            resp = _error_response(e, ollama, anthropic)
        except connections.BodyTimeout as e:  # the client stopped sending its body
            resp = _error_response(BadRequest(str(e), "body", 408, code="request_timeout"), ollama, anthropic)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            status = e.status
            msg = {413: f"request body over {self.config.max_body_bytes} bytes",
                   404: f"no route {request.method} {request.path}",
                   405: f"{request.method} not allowed on {request.path}"}.get(status, e.reason)
            resp = _error_response(BadRequest(msg, None, status, code=e.reason.lower().replace(" ", "_")), ollama,
                                   anthropic)
        except asyncio.CancelledError:
            self.metrics.observe(route, 499)  # the client went away
            raise
        except Exception:  # a bug: logged here, a clean 500 there
            log.exception("unhandled error on %s", request.path)
            resp = _error_response(BadRequest("internal server error", None, 500, "server_error"), ollama,
                                   anthropic)
        self.metrics.observe(route, resp.status)
        return resp

    @web.middleware
    async def _cors(self, request: web.Request, handler):
        """Answers a browser's preflight (OPTIONS) when --cors-origin is set; the headers
        themselves go on every response in _cors_headers."""
        if self.config.cors_origin and request.method == "OPTIONS":
            return web.Response(status=204)
        return await handler(request)

    async def _cors_headers(self, request: web.Request, resp: web.StreamResponse) -> None:
        """on_response_prepare: the CORS headers, on every response as its headers go out."""
        origin = self.config.cors_origin
        if origin:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Allow-Headers"] = CORS_ALLOW_HEADERS
            resp.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """Lets in a request carrying an accepted key, or none where the server has none,
        and sets request[keys.SCOPE] (justfit.server.keys): the key's scope, "" without
        keys, None on a public route (/health, the status page) or a preflight reached
        without a valid key."""
        if not self.keys:
            request[keys.SCOPE] = ""
            return await handler(request)
        request[keys.SCOPE] = keys.match(keys.presented(request.headers), self.keys)
        public = request.path == "/health" or status_page.is_page(request.path)  # the page asks for the key itself
        if request[keys.SCOPE] is None and not public and request.method != "OPTIONS":
            raise BadRequest("missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                             None, 401, "authentication_error", "invalid_api_key")
        return await handler(request)

    # -- operations -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """GET /health: ok (degraded once the runner is lost: a pipeline rank gone), the
        model served, and what the runner adds (a pipeline's ranks)."""
        runner = self.engine.runner
        states = getattr(self.engine, "states", None)
        failing = states.degraded() if states is not None else ""
        status = "stopping" if self.draining else "degraded" if runner.lost or failing else "ok"
        body = {"status": status, "model": self.model_id}
        if failing:  # the newest session write failed (e.g. a full disk): said here, details in the log
            body["reason"] = "session writes are failing: the latest turns are held in memory only"
        body.update(runner.health())
        return web.json_response(body, status=503 if self.draining else 200)

    async def prometheus(self, request: web.Request) -> web.Response:
        """GET /metrics: the counters as Prometheus text."""
        return web.Response(text=prometheus(self.metrics, self.engine, self.scheduler),
                            content_type="text/plain", charset="utf-8")

    async def status(self, request: web.Request) -> web.Response:
        """GET /v1/justfit/status: the engine, memory, states, queue and last request as JSON."""
        e, s = self.engine, self.scheduler.last_stats
        last = None
        if s is not None:
            last = {"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                    "restored_from": s.restored_from, "generated_tokens": s.generated_tokens,
                    "prefill_tps": s.prefill_tps, "decode_tps": s.decode_tps, "finish_reason": s.finish_reason,
                    "queue_s": s.queue_s, "prefill_s": s.prefill_s, "decode_s": s.decode_s,
                    "preemptions": s.preemptions, "preempted_s": s.preempted_s, "swap_s": s.swap_s,
                    "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
                    "acceptance_rate": acceptance_rate(s.drafted_tokens, s.accepted_tokens),
                    "memory": s.memory.as_dict() if s.memory else None, "kv_disk": s.kv_disk,
                    "phases": [p.as_dict() if hasattr(p, "as_dict") else vars(p) for p in s.phases]}
        return web.json_response({
            "model": self.model_id, "path": str(e.path) if e.path else None, "version": justfit.__version__,
            "policy": e.policy.name, "kv_format": e.config.kv.format if e.config.kv else "mlx-lm",
            "numerics": e.numerics.as_dict(), "blas": e.blas, "context_limit": e.context_limit, "memory": {**memory(e), "breakdown": process_breakdown(e, self.scheduler.live_layers(), s)},
            "states": {"stored": len(e.states.entries), "in_memory": e.states.memory_bytes,
                       "on_disk": e.states.disk_bytes, "spilled": e.states.spilled,
                       "restored": e.states.restored},
            "sessions": sessions_seen_by(e.states, scope_of(request)), "queue": {"waiting": self.scheduler.waiting,
                                                 "running": self.scheduler.running is not None,
                                                 "running_count": len(self.scheduler.active),
                                                 "max": self.config.max_queue, "max_batch": self.config.max_batch,
                                                 **self.scheduler.batch_stats()},
            "requests": {"completed": self.scheduler.completed, "cancelled": self.scheduler.cancelled,
                         "failed": self.scheduler.failed, "rejected_busy": self.scheduler.rejected},
            "cache_hit_ratio": self.metrics.cache_hit_ratio, "last_request": last,
            "speculation": {"draft": e.config.draft, "drafted_tokens": self.metrics.drafted_tokens,
                            "accepted_tokens": self.metrics.accepted_tokens,
                            "acceptance_rate": acceptance_rate(self.metrics.drafted_tokens,
                                                               self.metrics.accepted_tokens)},
            "kv_disk": {"folder": e.config.kv_disk, "bytes_last": self.metrics.kv_disk_bytes_last,
                        "read_bytes": self.metrics.kv_disk_read_bytes,
                        "read_per_token_last": round(self.metrics.kv_disk_read_per_token_last),
                        "read_mb_s": round(self.metrics.kv_disk_read_bytes / self.metrics.kv_disk_read_seconds / 1e6,
                                           1) if self.metrics.kv_disk_read_seconds else None,
                        **self.kv_disk.figures(self.metrics.kv_disk_bytes_last)},
        }, dumps=_dumps)


def sessions_seen_by(states, scope: str) -> dict:
    """The sessions a client may see: its own by name (positions each), every other
    key's only as counts."""
    own = {row["name"]: row["tokens"] for row in states.session_list(scope)}
    others = {k: n for k, n in states.session_counts().items() if k != scope}
    return {"own": own, "other_keys": len(others), "other_sessions": sum(others.values())}


def _short_name(name: str) -> str:
    """A path-like model name as its file or folder name; ids and aliases as they are."""
    p = Path(name)
    return p.name.removesuffix(".gguf") if (p.is_absolute() or p.exists()) else name


def _dumps(obj) -> str:
    import json

    return json.dumps(obj, default=str)


def _error_response(e: BadRequest, ollama: bool, anthropic: bool = False) -> web.Response:
    from justfit.server.anthropic_format import error_body

    body = {"error": e.message} if ollama else error_body(e) if anthropic else e.body()
    resp = web.json_response(body, status=e.status)
    if e.status == 503 and "retry_after" in e.details:
        resp.headers["Retry-After"] = str(e.details["retry_after"])
        resp.headers[TICKET_HEADER] = e.details.get("ticket", "")
    if e.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    if e.status == 408:  # what is left of the body would be read as the next request
        resp.force_close()
    return resp


def run(engine, config: ServerConfig, ready=None) -> None:
    """Serve until a stop signal, then stop gracefully (justfit.server.lifecycle);
    `ready(url)` is called once listening."""
    from justfit.server import lifecycle

    lifecycle.run(lambda: Server(engine, config), config.host, config.port, config.drain_s, ready,
                  start_site=connections.listener(config))
