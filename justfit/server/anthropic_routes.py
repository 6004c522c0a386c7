"""Anthropic's Messages API: POST /v1/messages (streamed as Anthropic's named SSE
events, or whole) and /v1/messages/count_tokens, so Claude Code (ANTHROPIC_BASE_URL)
and the `anthropic` package talk to the local model. Errors come back in Anthropic's
shape (see app.py); requests are checked, tokenized (on the tokenizer thread), planned
and queued exactly as OpenAI's are."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from justfit.server.anthropic_request import anthropic_options, chat_messages, openai_tools
from justfit.server.openai_routes import chat_tokens, collect, engine_error
from justfit.server.schema import BadRequest, parse_body
from justfit.server.sessions import STATE_HEADER, state_outcome, stream_note
from justfit.server.tools import ToolCalls

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def add_routes(app: web.Application, server) -> None:
    """Register the Messages API's routes on `app`."""
    routes = AnthropicRoutes(server)
    app.router.add_post("/v1/messages", routes.messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)


# -- the response -----------------------------------------------------------------------
def usage(prompt: int, cached: int, output: int, stats=None) -> dict:
    """Anthropic counts input tokens served from a cache apart from the rest; a finished
    reply's `stats` add speculative decoding's drafted and accepted tokens."""
    out = {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
           "cache_creation_input_tokens": 0}
    if stats is not None:
        out.update(drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens)
    return out


def tool_blocks(calls: list[dict]) -> list[dict]:
    """Parsed tool calls (OpenAI's shape, arguments as JSON text) as tool_use blocks."""
    out = []
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = {}
        out.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                    "name": call["function"]["name"], "input": args if isinstance(args, dict) else {"value": args}})
    return out


def stop_reason(stats, calls: list) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished reply."""
    if calls:
        return "tool_use", None
    if stats is not None and stats.stop_sequence:
        return "stop_sequence", stats.stop_sequence
    return STOP_REASONS.get(stats.finish_reason if stats else "stop", "end_turn"), None


def event(kind: str, data: dict) -> bytes:
    """One named event of Anthropic's SSE stream, its data carrying the type too."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def tool_events(calls: list[dict], first: int) -> list[bytes]:
    """Streamed tool_use blocks from index `first`: each opens with an empty input,
    which one input_json_delta fills (the call is parsed whole, once it ended)."""
    out = []
    for index, block in enumerate(tool_blocks(calls), first):
        args = json.dumps(block.pop("input"))
        out += [event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                        "partial_json": args}}),
                event("content_block_stop", {"index": index})]
    return out


class AnthropicRoutes:
    """Handlers of Anthropic's Messages API over one server."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine

    def _model(self, body: dict) -> str:
        """Claude model names (what Claude Code sends unless told otherwise) mean the
        model served here; other names are checked as on every route."""
        name = body.get("model")
        if not (isinstance(name, str) and name.startswith("claude")):
            self.server.check_model(name)
        return self.server.model_id

    async def count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the prompt's token count, templated as for a reply."""
        body = parse_body(await request.read())
        self._model(body)
        msgs, tools = chat_messages(body), openai_tools(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, tools)
        tokens = await self.server.tokenizing.run(chat_tokens, self.engine, msgs, tools)
        return web.json_response({"input_tokens": len(tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages: a reply, streamed as Anthropic's events or whole."""
        body = parse_body(await request.read())
        model = self._model(body)
        opts = anthropic_options(body, self.engine.default_sampling)
        msgs = chat_messages(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, opts.tools)
        tokens = await self.server.prepare(lambda: chat_tokens(self.engine, msgs, opts.tools), opts)
        job, _ = self.server.submit(tokens, opts, "anthropic", request)
        tools = ToolCalls(self.engine.tokenizer, opts.tools)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model}
        try:
            if opts.stream:
                return await self._stream(request, job, tools, head)
            return await self._collect(job, tools, head)
        finally:
            job.cancel.set()  # a no-op once finished; stops the work if the client left

    async def _collect(self, job, tools: ToolCalls, head: dict) -> web.Response:
        text, calls, stats, _ = await collect(job, tools)
        content = ([{"type": "text", "text": text}] if text or not calls else []) + tool_blocks(calls)
        reason, sequence = stop_reason(stats, calls)
        cached = stats.cached_tokens if stats else 0
        stored = await state_outcome(stats, self.server.config.write_wait_s)  # durable before the answer
        resp = web.json_response({**head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                                  "usage": usage(len(job.tokens), cached, stats.generated_tokens if stats else 0,
                                                 stats)})
        if stored is not None:
            resp.headers[STATE_HEADER] = stored.header()
        return resp

    async def _stream(self, request, job, tools: ToolCalls, head: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        started, text_open, blocks, stats = False, False, 0, None

        async def start(cached: int) -> None:
            nonlocal started
            if not started:
                started = True
                await resp.write(event("message_start", {"message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": usage(len(job.tokens), cached, 0)}}))

        async def text(piece: str) -> None:
            nonlocal text_open, blocks
            if not text_open:
                text_open = True
                await resp.write(event("content_block_start", {"index": blocks,
                                                               "content_block": {"type": "text", "text": ""}}))
                await resp.write(event("ping", {}))
            if piece:
                await resp.write(event("content_block_delta", {"index": blocks,
                                                               "delta": {"type": "text_delta", "text": piece}}))

        try:
            async for kind, p in job.stream(tick=self.server.config.keepalive_s):
                if kind == "progress":
                    await start(p[0] if not started else 0)  # the first report: what the stored state held
                elif kind == "tick":  # queued, or a long prefill chunk: keep the connection alive
                    await start(0)
                    await resp.write(event("ping", {}))
                elif kind == "chunk":
                    await start(0)
                    shown = tools.feed(p.text)
                    if shown:
                        await text(shown)
                elif kind == "error":
                    await resp.write(event("error", {"error": anthropic_error(engine_error(p))}))
                    return resp
                elif kind == "done":
                    stats = p
            await start(0)
            # The turn's session state is durable before the message's end is sent.
            await resp.write(stream_note(await state_outcome(stats, self.server.config.write_wait_s)))
            tail = tools.flush()
            calls = tools.calls()
            if tail or not calls:
                await text(tail)
            if text_open:
                await resp.write(event("content_block_stop", {"index": blocks}))
                blocks += 1
            for piece in tool_events(calls, blocks):
                await resp.write(piece)
            reason, sequence = stop_reason(stats, calls)
            cached = stats.cached_tokens if stats else 0
            await resp.write(event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(len(job.tokens), cached, stats.generated_tokens if stats else 0, stats)}))
            await resp.write(event("message_stop", {}))
            await resp.write_eof()
        except ConnectionError:  # the client left: cancel (in messages), nobody to tell
            job.cancel.set()
        return resp


# -- errors -------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: BadRequest) -> dict:
    """The inner `error` object of Anthropic's error body."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error"),
            "message": message}


def error_body(e: BadRequest) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": anthropic_error(e)}
