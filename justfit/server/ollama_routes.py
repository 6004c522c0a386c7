"""The Ollama-compatible subset editor plugins use: /api/chat, /api/generate (NDJSON
streaming by default, or one object: pumped by justfit.server.pump in the shapes of
justfit.server.ollama_format; `format` mapped by justfit.server.structured), /api/tags,
/api/show, /api/version."""

from __future__ import annotations

from aiohttp import web

import justfit
from justfit.model.chat_template import has_chat_template
from justfit.server import pump
from justfit.server.ollama_format import OllamaFormat, now_stamp
from justfit.server.openai_routes import chat_tokens, vocab_size
from justfit.server.schema import get, messages, ollama_options, parse_body, token_ids
from justfit.server.structured import ollama_structure

OLLAMA_VERSION = "0.6.0"  # the API level this subset follows (clients check it)


def add_routes(app: web.Application, server) -> None:
    """Register the Ollama routes on `app`."""
    routes = OllamaRoutes(server)
    app.router.add_post("/api/chat", routes.chat)
    app.router.add_post("/api/generate", routes.generate)
    app.router.add_get("/api/tags", routes.tags)
    app.router.add_post("/api/show", routes.show)
    app.router.add_get("/api/version", routes.version)


class OllamaRoutes:
    """Handlers of the Ollama-compatible API over one server."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine

    def _model(self) -> dict:
        e = self.engine
        return {"name": self.server.model_id, "model": self.server.model_id, "modified_at": now_stamp(),
                "size": e.stored_bytes(), "digest": "", "details": {
                    "format": "mlx", "family": e.model_config.get("model_type", ""),
                    "parameter_size": "", "quantization_level": e.policy.resident}}

    async def tags(self, request: web.Request) -> web.Response:
        """GET /api/tags: the one model served."""
        return web.json_response({"models": [self._model()]})

    async def version(self, request: web.Request) -> web.Response:
        """GET /api/version: the Ollama API level followed, and JustFit's version."""
        return web.json_response({"version": OLLAMA_VERSION, "justfit": justfit.__version__})

    async def show(self, request: web.Request) -> web.Response:
        """POST /api/show: the model's details, chat-template flag and context length."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model") or body.get("name"))
        arch = self.engine.model_config.get("model_type", "model")
        m = self._model()
        return web.json_response({"details": m["details"], "modified_at": m["modified_at"], "template": "",
                                  "has_chat_template": has_chat_template(self.engine.tokenizer),
                                  "model_info": {"general.architecture": arch,
                                                 f"{arch}.context_length": self.engine.context_limit},
                                  "capabilities": ["completion"]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /api/chat: a chat reply, streamed as NDJSON or whole."""
        body = parse_body(await request.read())
        self.server.check_model(get(body, "model", str, None))
        opts = ollama_structure(body, ollama_options(body, self.server.config.default_max_tokens,
                                                     self.engine.default_sampling))
        msgs = messages(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, opts.tools)
        return await self._generate(request, lambda: chat_tokens(self.engine, msgs, opts.tools), opts, chat=True)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """POST /api/generate: a continuation of the prompt, streamed as NDJSON or whole."""
        body = parse_body(await request.read())
        self.server.check_model(get(body, "model", str, None))
        opts = ollama_structure(body, ollama_options(body, self.server.config.default_max_tokens,
                                                     self.engine.default_sampling))
        prompt, system = get(body, "prompt", str, ""), get(body, "system", str, None)
        context = get(body, "context", list, [])
        if not prompt and not context:  # Ollama's "load the model" call
            return web.json_response({"model": self.server.model_id, "created_at": now_stamp(), "response": "",
                                      "done": True, "done_reason": "load"})
        await self.server.tokenizing.refuse_oversized(self.engine, prompt, system, ids=len(context), param="prompt")
        raw = get(body, "raw", bool, False) or not has_chat_template(self.engine.tokenizer)

        def tokenize() -> list[int]:  # on the tokenizer thread
            ids = token_ids(context, vocab_size(self.engine), "context")
            if raw:
                return ids + self.engine.encode(f"{system}\n\n{prompt}" if system else prompt)
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return ids + chat_tokens(self.engine, msgs, None)

        return await self._generate(request, tokenize, opts, chat=False)

    async def _generate(self, request, tokenize, opts, chat: bool) -> web.StreamResponse:
        """`tokenize()` and the plan on the tokenizer thread, then the request queued and
        its reply pumped in Ollama's shape."""
        tokens = await self.server.prepare(tokenize, opts)
        job, _ = self.server.submit(tokens, opts, "ollama", request)
        fmt = OllamaFormat(self.server.model_id, chat, tokens)
        return await pump.reply(self.server, request, job, fmt, opts.tool_mode if chat else None, opts.stream)
