"""Anthropic's Messages API: POST /v1/messages (streamed as Anthropic's named SSE
events, or whole) and /v1/messages/count_tokens, so Claude Code (ANTHROPIC_BASE_URL)
and the `anthropic` package talk to the local model. Errors come back in Anthropic's
shape (see app.py); output_config and tool_choice are mapped by
justfit.server.structured; requests are checked, tokenized (on the tokenizer thread), planned
and queued exactly as OpenAI's are, and the reply pumped (justfit.server.pump) in
Anthropic's shapes (justfit.server.anthropic_format)."""

from __future__ import annotations

from aiohttp import web

from justfit.server import pump
from justfit.server.anthropic_format import AnthropicFormat
from justfit.server.anthropic_request import anthropic_options, chat_messages, openai_tools
from justfit.server.openai_routes import chat_tokens
from justfit.server.schema import parse_body
from justfit.server.structured import anthropic_structure


def add_routes(app: web.Application, server) -> None:
    """Register the Messages API's routes on `app`."""
    routes = AnthropicRoutes(server)
    app.router.add_post("/v1/messages", routes.messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)


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
        opts = anthropic_structure(body, anthropic_options(body, self.engine.default_sampling))
        msgs = chat_messages(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, opts.tools)
        tokens = await self.server.prepare(lambda: chat_tokens(self.engine, msgs, opts.tools), opts)
        job, _ = self.server.submit(tokens, opts, "anthropic", request)
        fmt = AnthropicFormat(model, len(tokens))
        return await pump.reply(self.server, request, job, fmt, opts.tool_mode, opts.stream)
