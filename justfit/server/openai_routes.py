"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions,
streamed (SSE) or not, structured output and tool_choice mapped by
justfit.server.structured; the reply is pumped (justfit.server.pump) in OpenAI's shapes
(justfit.server.openai_format)."""

from __future__ import annotations

import logging

from aiohttp import web

from justfit.model.chat_template import has_chat_template
from justfit.server import pump
from justfit.server.openai_format import OpenAIFormat
from justfit.server.schema import BadRequest, get, messages, openai_options, parse_body, token_ids
from justfit.server.structured import openai_structure

log = logging.getLogger("justfit.server")


def add_routes(app: web.Application, server) -> None:
    """Register the OpenAI routes on `app`."""
    routes = OpenAIRoutes(server)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/completions", routes.completions)


NO_CHAT_TEMPLATE = ("this model has no chat template (it is a base model): send the text to /v1/completions "
                    "(OpenAI) or /api/generate (Ollama), which continue it as given, or start `justfit serve` "
                    "with --chat-template FILE")


def chat_tokens(engine, msgs: list[dict], tools: list | None) -> list[int]:
    """`msgs` (and `tools`) through the chat template; BadRequest when there is none or it refuses."""
    if not has_chat_template(engine.tokenizer):  # never a made-up role format the model never saw
        raise BadRequest(NO_CHAT_TEMPLATE, "messages", code="no_chat_template")
    from jinja2.exceptions import TemplateError

    try:
        return engine.apply_chat_template(msgs, tools=tools)
    except TemplateError as e:  # the template's own rules (e.g. alternating roles), in its words
        raise BadRequest(f"the chat template rejected the messages: {e.message or 'no reason given'}",
                         "messages") from None
    except Exception:  # anything else is not the client's to read: details in the log
        log.warning("the chat template failed on a request", exc_info=True)
        raise BadRequest("the chat template could not render these messages", "messages",
                         code="chat_template_failed") from None


def vocab_size(engine) -> int:
    """The model's vocabulary size: its config's, else the tokenizer's."""
    return int(engine.model_config.get("vocab_size") or len(engine.tokenizer.vocab))


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible API over one server."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one model served."""
        return web.json_response({"object": "list", "data": [
            {"id": self.server.model_id, "object": "model", "created": self.server.created, "owned_by": "justfit",
             "context_length": self.engine.context_limit,
             "has_chat_template": has_chat_template(self.engine.tokenizer)}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: a chat reply, streamed (SSE) or whole."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model"))
        opts = openai_structure(body, openai_options(body, self.server.config.default_max_tokens,
                                                     defaults=self.engine.default_sampling))
        msgs = messages(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, opts.tools)
        return await self._generate(request, lambda: chat_tokens(self.engine, msgs, opts.tools), opts, True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: a continuation of a text or token prompt, streamed or whole."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model"))
        opts = openai_structure(body, openai_options(body, self.server.config.default_max_tokens, False,
                                                     self.engine.default_sampling), chat=False)
        if get(body, "echo", bool, False) or body.get("best_of", 1) not in (1, None):
            raise BadRequest("echo and best_of are not supported", "echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            await self.server.tokenizing.refuse_oversized(self.engine, prompt, param="prompt")
            return await self._generate(request, lambda: self.engine.encode(prompt), opts, False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return await self._generate(request, lambda: token_ids(prompt, vocab_size(self.engine), "prompt"),
                                        opts, False)
        raise BadRequest("'prompt' must be a string, an array of token ids, or a batch of one", "prompt")

    # -- the common part -------------------------------------------------------------
    async def _generate(self, request, tokenize, opts, chat: bool) -> web.StreamResponse:
        """`tokenize()` and the plan on the tokenizer thread, then the request queued and
        its reply pumped in OpenAI's shape."""
        tokens = await self.server.prepare(tokenize, opts)
        job, ahead = self.server.submit(tokens, opts, "openai", request)
        fmt = OpenAIFormat(self.server.model_id, chat, len(tokens), opts.sampling.logprobs is not None,
                           opts.include_usage)
        return await pump.reply(self.server, request, job, fmt, opts.tool_mode, opts.stream, ahead)
